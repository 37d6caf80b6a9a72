"""`fusegen.ops.<name>`: the op built earlier under that name, loaded on first access.

    import fusegen
    fma = fusegen.ops.fma              # after `fusegen "a*b+c" --name fma`, in any process
    from fusegen.ops import fma        # the same

An attribute is `fusegen.load(name)` (the request index in the cache: no sympy, no
compiler); an unknown name is an AttributeError that says where it looked.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name.startswith("_"):  # dunders (pickle, inspect, copy ask for them) are never ops
        raise AttributeError(f"module 'fusegen.ops' has no attribute {name!r}")
    from fusegen.api import OpNotFound, load

    try:
        return load(name)
    except OpNotFound as err:
        raise AttributeError(f"fusegen.ops.{name}: {err}", name=name, obj=None) from None


def __dir__():
    from fusegen.build.index import names
    return names()

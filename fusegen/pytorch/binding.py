"""Binding a call's arguments to an op's parameters, with errors that name the op."""

from __future__ import annotations

import inspect


def bind(signature: inspect.Signature, args, kwargs, who: str, name: str) -> tuple:
    """The arguments in the signature's order (defaults applied), or a TypeError that names
    every unexpected keyword and the parameters (Signature.bind reports a missing argument
    before an unexpected keyword, so a misspelt `d=` for `c` would read "missing 'c'")."""
    params = signature.parameters
    expected = f"expected {name}({', '.join(params)})"
    unexpected = [k for k in kwargs if k not in params]
    if unexpected:
        words = ", ".join(repr(k) for k in unexpected)
        plural = "s" if len(unexpected) > 1 else ""
        raise TypeError(f"{who}: unexpected keyword argument{plural} {words}; {expected}")
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"{who}: {err}; {expected}") from None
    bound.apply_defaults()
    return tuple(bound.arguments[p] for p in params)

"""@fused: a PyTorch function whose body is one expression becomes a fused op.

    @fusegen.fused
    def silu(x):
        return x * torch.sigmoid(x)

The function is read as source (never run) by the same parser as the CLI, so the
undecorated function stays valid eager PyTorch and serves as the reference.
A parameter is a runtime scalar when it is annotated `float` or `int`, or when its
default is a number; defaults work as in Python.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import textwrap

from .api import Request, fuse_many
from .errors import ParseError, SpecError

_SCALAR_ANNOTATIONS = (float, int, "float", "int")


def _is_scalar(param: inspect.Parameter) -> bool:
    default = param.default
    number_default = isinstance(default, numbers.Real) and not isinstance(default, bool)
    return param.annotation in _SCALAR_ANNOTATIONS or number_default


def fused(fn=None, *, name: str | None = None):
    """Decorate a function; usable bare (`@fused`) or with a name (`@fused(name="silu")`)."""
    if fn is None:
        return lambda f: fused(f, name=name)
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as err:
        raise ParseError(f"@fused needs the source of '{getattr(fn, '__name__', fn)}' ({err})",
                         repr(fn)) from None
    signature = inspect.signature(fn)
    for p in signature.parameters.values():
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise SpecError(f"@fused function '{fn.__name__}': parameter '{p.name}' is *args or "
                            "**kwargs; expected named parameters only")
        if p.default is not p.empty and not _is_scalar(p):
            raise SpecError(f"@fused function '{fn.__name__}': parameter '{p.name}' has default "
                            f"{p.default!r}; expected a number (a runtime scalar) or no default")
    params = tuple(signature.parameters)
    scalars = tuple(p for p, v in signature.parameters.items() if _is_scalar(v))
    request = Request(source, name=name or fn.__name__, scalars=scalars, params=params,
                      command=f"@fusegen.fused on {fn.__module__}.{fn.__qualname__}")
    op = fuse_many([request])[0]
    order = list(op.params)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return op(*(bound.arguments[p] for p in order))  # FusedOp: autograd, torch.func

    wrapper.op = op           # the FusedOp (torch.ops.fusegen.<name> is op.op)
    wrapper.eager = fn        # the undecorated function: the reference
    return wrapper

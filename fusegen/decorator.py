"""@fused: a PyTorch function whose body is one expression becomes a fused op.

    @fusegen.fused
    def silu(x):
        return x * torch.sigmoid(x)

The function is read as source (never run) by the same parser as the CLI, so the
undecorated function stays valid eager PyTorch and serves as the reference.
Parameters annotated `float` or `int` are runtime scalars.
"""

from __future__ import annotations

import functools
import inspect
import textwrap

from .api import fuse_parsed
from .errors import ParseError
from .parse import parse_function

_SCALAR_ANNOTATIONS = (float, int, "float", "int")


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
    params = list(signature.parameters)
    scalars = [p for p, v in signature.parameters.items() if v.annotation in _SCALAR_ANNOTATIONS]
    parsed = parse_function(source, params, scalars)
    op = fuse_parsed(parsed, name=name or fn.__name__,
                     command=f"@fusegen.fused on {fn.__module__}.{fn.__qualname__}")
    order = list(op.params)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        return op.op(*(bound.arguments[p] for p in order))

    wrapper.op = op           # the FusedOp (torch.ops.fusegen.<name> is op.op)
    wrapper.eager = fn        # the undecorated function: the reference
    return wrapper

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


def place(params, args: tuple, kwargs: dict):
    """The arguments in `params`' order when the keywords name exactly the parameters after
    the positional ones (the common `op(x, w, eps=1e-6)`), placed without binding a
    Signature (10-25 us a call, as much as an op's own host time); None otherwise, for
    `bind` to place or report."""
    if len(args) > len(params):
        return None
    rest = params[len(args):]
    if len(rest) != len(kwargs):
        return None
    try:
        return args + tuple(kwargs[p] for p in rest)
    except KeyError:
        return None


def arguments(params, signature: inspect.Signature, args: tuple, kwargs: dict, who: str, name: str) -> tuple:
    """The arguments in the signature's order: `place`d where they can be, else bound (which
    applies defaults or reports what is wrong). `params` None: always bound (positional-only
    or keyword-only parameters, whose rules only `bind` applies)."""
    placed = None if params is None else place(params, args, kwargs)
    return bind(signature, args, kwargs, who, name) if placed is None else placed

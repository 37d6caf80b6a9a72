"""Eager PyTorch evaluation of an op's sympy tree: the oracle for `--check` and `--bench`.

Each sympy node maps to the torch function the user meant (relu -> torch.where, Max ->
torch.maximum, Clamp -> torch.clamp, ...), so torch.autograd over this evaluation gives
PyTorch's own gradients, independent of fusegen's derivation. No eval, no lambdify: a
table and a tree walk.
"""

from __future__ import annotations

import math

import sympy
import torch
from sympy.codegen.cfunctions import expm1, log1p

from . import functions as fn


def _piecewise(*pairs):
    # Piecewise((v0, c0), (v1, c1), ..., (vn, True)): nested torch.where, last branch default.
    out = None
    for value, cond in reversed(pairs):
        out = value if out is None else torch.where(cond, value, out)
    return out


def _number(x, like):
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


# sympy node class -> torch implementation over already-evaluated args.
TORCH_OPS = {
    sympy.Add: lambda *a: _fold(torch.add, a),
    sympy.Mul: lambda *a: _fold(torch.mul, a),
    sympy.exp: torch.exp,
    expm1: torch.expm1,
    sympy.log: torch.log,
    log1p: torch.log1p,
    sympy.sin: torch.sin,
    sympy.cos: torch.cos,
    sympy.tan: torch.tan,
    sympy.tanh: torch.tanh,
    sympy.atan: torch.atan,
    sympy.erf: torch.erf,
    sympy.erfc: torch.erfc,
    sympy.Abs: torch.abs,
    fn.Sign: torch.sign,
    sympy.sign: torch.sign,
    fn.Sigmoid: torch.sigmoid,
    fn.Power: torch.pow,
    fn.Clamp: lambda x, lo, hi: torch.clamp(x, lo, hi),
    sympy.Max: lambda *a: _fold(torch.maximum, a),
    sympy.Min: lambda *a: _fold(torch.minimum, a),
    sympy.And: lambda *a: _fold(torch.logical_and, a),
    sympy.Or: lambda *a: _fold(torch.logical_or, a),
    sympy.StrictGreaterThan: torch.gt,
    sympy.StrictLessThan: torch.lt,
    sympy.GreaterThan: torch.ge,
    sympy.LessThan: torch.le,
    sympy.Equality: torch.eq,
    sympy.Unequality: torch.ne,
}


def _fold(f, args):
    out = args[0]
    for a in args[1:]:
        out = f(out, a)
    return out


def evaluate(expr: sympy.Expr, values: dict[str, object]):
    """Evaluate `expr` with eager torch; `values` maps input and scalar names to tensors or
    floats. The first tensor sets dtype and device for constants."""
    like = next(v for v in values.values() if isinstance(v, torch.Tensor))
    values = {k: v if isinstance(v, torch.Tensor) else _number(v, like) for k, v in values.items()}

    def walk(e):
        if isinstance(e, sympy.Symbol):
            return values[e.name]
        if e in (sympy.oo, -sympy.oo):
            return _number(math.copysign(math.inf, float(e)), like)
        if e.is_Number or isinstance(e, sympy.NumberSymbol):
            return _number(float(e), like)
        if isinstance(e, sympy.Pow):
            base, exponent = e.args
            if exponent.is_Number:
                return torch.pow(walk(base), float(exponent))
            return torch.pow(walk(base), walk(exponent))
        if isinstance(e, sympy.Piecewise):
            pairs = [(walk(v), c if c is sympy.true else walk(c)) for v, c in e.args]
            return _piecewise(*pairs)
        impl = TORCH_OPS.get(type(e))
        if impl is None:
            for cls, f in TORCH_OPS.items():
                if isinstance(e, cls):
                    impl = f
                    break
        if impl is None:
            raise NotImplementedError(f"no eager reference for {type(e).__name__}")
        return impl(*[walk(a) for a in e.args])

    return walk(expr)

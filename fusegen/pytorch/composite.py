"""An op's sympy tree evaluated with eager PyTorch, one torch call per node.

The fallback for derivatives fusegen does not fuse (third order and above, forward mode
through a backward op): autograd and torch.func differentiate this composite to any order,
with PyTorch's own formulas, since every node is the eager operation it stands for
(functions.py). It computes in the promoted dtype itself (fp16/bf16 in fp16/bf16, not in
float as the kernels do). Nothing is compiled: it is plain torch calls.
"""

from __future__ import annotations

import operator

import sympy
import torch

from fusegen.ir import dag
from fusegen.ir import primitives as fn

_BINARY = {fn.Plus: operator.add, fn.Minus: operator.sub, fn.Times: operator.mul,
           fn.Divide: operator.truediv, fn.Less: operator.lt, fn.LessEqual: operator.le,
           fn.Greater: operator.gt, fn.GreaterEqual: operator.ge, fn.Equal: operator.eq,
           fn.NotEqual: operator.ne}

# Nodes whose torch function wants tensors (a number argument becomes a 0-dim tensor).
_TENSOR_FUNCTIONS = {
    fn.Negative: torch.neg, fn.Reciprocal: torch.reciprocal, fn.Abs: torch.abs, fn.Exp: torch.exp,
    fn.Expm1: torch.expm1, fn.Log: torch.log, fn.Log1p: torch.log1p, fn.Sqrt: torch.sqrt,
    fn.Rsqrt: torch.rsqrt, fn.Sin: torch.sin, fn.Cos: torch.cos, fn.Tan: torch.tan,
    fn.Tanh: torch.tanh, fn.Atan: torch.atan, fn.Sigmoid: torch.sigmoid, fn.Relu: torch.relu,
    fn.Erf: torch.erf, fn.Erfc: torch.erfc, fn.Sign: torch.sign, fn.Maximum: torch.maximum,
    fn.Minimum: torch.minimum, fn.LogicalAnd: torch.logical_and, fn.LogicalOr: torch.logical_or,
}


def promoted_dtype(tensors) -> torch.dtype:
    """torch's promotion over the tensors, as the runtime computes it (dimensioned tensors
    before 0-dim ones)."""
    ranked = [t for t in tensors if t.dim() > 0] or list(tensors)
    dtype = ranked[0].dtype
    for t in ranked[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def evaluate(exprs, values: dict[str, object], shape, dtype, device) -> list[torch.Tensor]:
    """Each expression evaluated with torch ops over `values` (symbol -> tensor of `dtype`,
    or Python float), broadcast to `shape`."""
    memo: dict = {}

    def tensor(v):
        if isinstance(v, torch.Tensor):
            return v
        return torch.tensor(v, dtype=torch.bool if isinstance(v, bool) else dtype, device=device)

    def value(node):
        if node in memo:
            return memo[node]
        if isinstance(node, sympy.Symbol):
            result = values[node]
        elif fn.is_number(node):
            result = float(node)
        elif type(node) in _BINARY:
            a, b = (value(x) for x in node.args)
            result = _BINARY[type(node)](a, b) if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) \
                else _BINARY[type(node)](tensor(a), b)
        elif type(node) is fn.Power:
            base, exponent = (value(x) for x in node.args)
            result = torch.pow(base if isinstance(base, torch.Tensor) or isinstance(exponent, torch.Tensor)
                               else tensor(base), exponent)
        elif type(node) is fn.Where:
            c, a, b = (value(x) for x in node.args)
            result = torch.where(tensor(c), a, b)
        elif type(node) is fn.Clamp:
            x, lo, hi = (value(x) for x in node.args)
            bounds = [None if isinstance(v, float) and abs(v) == float("inf") else v for v in (lo, hi)]
            if any(isinstance(v, torch.Tensor) for v in bounds):
                bounds = [None if v is None else tensor(v) for v in bounds]
                x, *rest = torch.broadcast_tensors(tensor(x), *[v for v in bounds if v is not None])
                it = iter(rest)
                bounds = [None if v is None else next(it) for v in bounds]
            result = torch.clamp(tensor(x), *bounds)
        else:
            f = _TENSOR_FUNCTIONS[type(node)]
            result = f(*(tensor(value(x)) for x in node.args))
        memo[node] = result
        return result

    # Children before parents, so that value() finds every argument computed and never
    # recurses: an op's tree may be hundreds of nodes deep (a @fused body of many lines).
    for node in dag.postorder(exprs):
        value(node)
    out = []
    for e in exprs:
        v = tensor(value(e)).to(dtype)
        out.append(v if tuple(v.shape) == tuple(shape) else v.expand(shape).clone())
    return out

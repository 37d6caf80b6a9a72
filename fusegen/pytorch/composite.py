"""An op's sympy tree evaluated with eager PyTorch, one torch call per node.

The fallback for derivatives fusegen does not fuse (third order and above, forward mode
through a backward op): autograd and torch.func differentiate this composite to any order,
with PyTorch's own formulas, since every node is the eager operation it stands for
(functions.py). It computes in the promoted dtype itself (fp16/bf16 in fp16/bf16, not in
float as the kernels do). Nothing is compiled: it is plain torch calls.
"""

from __future__ import annotations

import sympy
import torch

from fusegen.ir import dag
from fusegen.ir import primitives as fn
from fusegen.ir import rows

# Each node's eager callable (primitives.PRIMITIVES). Python's operators take a number as
# it is; the torch functions want tensors (a number argument becomes a 0-dim tensor).
_BINARY = {p.node: fn.eager(p) for p in fn.PRIMITIVES if not p.tensor_args}
_TENSOR_FUNCTIONS = {p.node: fn.eager(p) for p in fn.PRIMITIVES if p.tensor_args}


def promoted_dtype(tensors) -> torch.dtype:
    """torch's promotion over the tensors, as the runtime computes it (dimensioned tensors
    before 0-dim ones)."""
    ranked = [t for t in tensors if t.dim() > 0] or list(tensors)
    dtype = ranked[0].dtype
    for t in ranked[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an op's expression is evaluated in, as the kernels compute it (`acc_t`):
    float32 for float16 and bfloat16 (each output rounded to the op's dtype once, at the
    end), the op's dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def index_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gather's index is compared in, as the kernels hold it: float32 (exact
    below 2^24), float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
        if fn.is_random(node):
            # torch's random numbers, one draw per stream and call (not the kernels' bits), in
            # float as the kernels compare them (float64 for float64)
            result = torch.rand(tuple(shape), device=device,
                                dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        elif node == fn.COLUMN:  # each element's index along its row, as a gather's index is held
            result = torch.arange(shape[-1], dtype=index_dtype(dtype), device=device)
        elif isinstance(node, sympy.Symbol):
            result = values[node]
        elif fn.is_number(node):
            result = float(node)
        elif type(node) in _BINARY:
            a, b = (value(x) for x in node.args)
            result = _BINARY[type(node)](a, b) if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) \
                else _BINARY[type(node)](tensor(a), b)
        elif type(node) is fn.Power:
            base, exponent = (value(x) for x in node.args)
            result = _TENSOR_FUNCTIONS[fn.Power](base if isinstance(base, torch.Tensor) or isinstance(exponent, torch.Tensor)
                               else tensor(base), exponent)
        elif type(node) is fn.Where:
            c, a, b = (value(x) for x in node.args)
            result = _TENSOR_FUNCTIONS[fn.Where](tensor(c), a, b)
        elif type(node) is fn.Clamp:
            x, lo, hi = (value(x) for x in node.args)
            bounds = [None if isinstance(v, float) and abs(v) == float("inf") else v for v in (lo, hi)]
            if any(isinstance(v, torch.Tensor) for v in bounds):
                bounds = [None if v is None else tensor(v) for v in bounds]
                x, *rest = torch.broadcast_tensors(tensor(x), *[v for v in bounds if v is not None])
                it = iter(rest)
                bounds = [None if v is None else next(it) for v in bounds]
            result = _TENSOR_FUNCTIONS[fn.Clamp](tensor(x), *bounds)
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
    tensors = {s for s, v in values.items() if isinstance(v, torch.Tensor)} - fn.index_symbols(exprs)
    row_shape = tuple(shape[:-1]) + (1,) if len(shape) else ()
    for e in exprs:
        v = tensor(value(e)).to(dtype)
        want = row_shape if len(shape) and rows.is_row_value(e, tensors) else tuple(shape)  # one value per row
        out.append(v if tuple(v.shape) == want else v.expand(want).clone())
    return out

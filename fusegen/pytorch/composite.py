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


_X, _RESULT, _GRAD = sympy.symbols("x result grad")


def _result_gradient(p: fn.Primitive):
    """The derivative (derivatives.yaml's formula, the table's `backward`) of a one-argument
    elementwise primitive whose formula reads its result, in _X, _RESULT and _GRAD; None for
    any other. (A row reduction's result is one value a row: saving it is the cheap side.)"""
    if p.backward is None or p.node.nargs != sympy.FiniteSet(1) or p.node in fn.REDUCTION_NAMES.values():
        return None
    formulas = [f for _, f in p.backward((_X,), _RESULT, _GRAD)]  # none for detach
    return formulas[0] if formulas and _RESULT in formulas[0].free_symbols else None


# The primitives evaluate(recompute_results=True) wraps in _Recomputed, with their derivative.
_RESULT_GRADIENTS = {p.node: f for p in fn.PRIMITIVES if (f := _result_gradient(p)) is not None}


class _Recomputed(torch.autograd.Function):
    """An elementwise primitive whose backward recomputes its result from its input and
    applies the table's formula (eager's), instead of autograd saving the result. Under
    torch.compile a saved result (sigmoid's, exp's, tanh's) reaches the backward through a
    detach, which AOTAutograd's partitioner counts as materialized: it keeps the full-size
    float32 tensor of a 16-bit op's float math (written by the forward, read by the
    backward) rather than recompute it from the 16-bit input that the backward reads
    anyway. Saving the input leaves the choice to the partitioner. The Jacobian is
    diagonal, so forward mode applies the same formula to the tangent; torch.func's vmap
    runs through it as through the eager ops (generate_vmap_rule)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, node):
        return _TENSOR_FUNCTIONS[node](x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.node = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)

    @staticmethod
    def backward(ctx, grad):
        return _derivative(ctx.node, ctx.saved_tensors[0], grad), None

    @staticmethod
    def jvp(ctx, tangent, _):
        return _derivative(ctx.node, ctx.saved_tensors[0], tangent)


def _derivative(node, x, grad):
    """The table's derivative of `node` at `x`, times `grad`, its result recomputed."""
    values = {_X: x, _RESULT: _TENSOR_FUNCTIONS[node](x), _GRAD: grad}
    return evaluate([_RESULT_GRADIENTS[node]], values, x.shape, x.dtype, x.device)[0]


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


def evaluate(exprs, values: dict[str, object], shape, dtype, device,
             recompute_results: bool = False, stored: torch.dtype | None = None) -> list[torch.Tensor]:
    """Each expression evaluated with torch ops over `values` (symbol -> tensor of `dtype`,
    or Python float), broadcast to `shape`. With `recompute_results`, the primitives whose
    derivative reads their result recompute it in the backward (_Recomputed). With
    `stored` (the outputs' dtype, narrower than `dtype`), an output that other outputs
    read (`h = x + r; (h, norm(h))`) is read as stored, rounded to `stored`: as the same
    statements compute in eager PyTorch, and as the kernels' backward reads a saved
    output; the backward then needs that output in `stored`, not in `dtype`. Such an
    output that is one primitive of the op's tensors and numbers (`x + r`) is computed
    on them in `stored`: the same bits (ATen computes a 16-bit op in float and rounds
    once), and Inductor keeps a 16-bit sum where torch 2.11's joint-graph pass
    `pointless_convert` drops a float -> 16-bit -> float round trip as pointless."""
    memo: dict = {}
    tensors = {s for s, v in values.items() if isinstance(v, torch.Tensor)} - fn.index_symbols(exprs)
    shared = {e for e in exprs if stored and not (isinstance(e, sympy.Symbol) or fn.is_number(e))
              and any(o != e and o.has(e) for o in exprs)}
    scalars = {s for s, v in values.items() if not isinstance(v, torch.Tensor)}
    narrow = {e for e in shared if any(a in tensors for a in e.args)
              and all(a in tensors or a in scalars or fn.is_number(a) for a in e.args)}

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
        elif recompute_results and type(node) in _RESULT_GRADIENTS:
            result = _Recomputed.apply(tensor(value(node.args[0])), type(node))
        else:
            f = _TENSOR_FUNCTIONS[type(node)]
            result = f(*(tensor(value(x)) for x in node.args))
        if node in shared and isinstance(result, torch.Tensor) and result.dtype == dtype:
            result = result.to(stored).to(dtype)
        memo[node] = result
        return result

    # Children before parents, so that value() finds every argument computed and never
    # recurses: an op's tree may be hundreds of nodes deep (a @fused body of many lines).
    for node in dag.postorder(exprs):
        if node in narrow:  # its arguments in `stored` while it computes, then read in `dtype`
            wide = {a: memo[a] for a in node.args if a in tensors}
            memo.update({a: t.to(stored) for a, t in wide.items()})
            memo[node] = value(node).to(dtype)
            memo.update(wide)
        else:
            value(node)
    out = []
    row_shape = tuple(shape[:-1]) + (1,) if len(shape) else ()
    for e in exprs:
        v = tensor(value(e)).to(dtype)
        want = row_shape if len(shape) and rows.is_row_value(e, tensors) else tuple(shape)  # one value per row
        out.append(v if tuple(v.shape) == want else v.expand(want).clone())
    return out

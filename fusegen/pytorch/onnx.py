"""ONNX export: each fused op's forward tree as standard ONNX operators, node by node.

    table = fusegen.onnx_translations()                  # every op loaded in this process
    onnx_program = torch.onnx.export(model, args, dynamo=True, custom_translation_table=table)

torch.onnx's exporter (torch.export, then one onnxscript function per graph node) keeps a
`torch.ops.fusegen.<name>` call as one node and asks `custom_translation_table` for its
ONNX: there is no registry a library can add to, so the table goes with each call. The
translation walks the op's sympy tree (functions.py's nodes, the ones the kernels compute)
and emits, per node, the ONNX operators that compute what the kernel computes
(`templates/runtime/fusegen-math.h`, `printer.py`), in the kernels' compute type: fp16/bf16 are
Cast to float, computed, and Cast back once, float64 stays double. Only the forward is
exported (ONNX is for inference). Written against ONNX opset 18 (`OPSET`, torchlib's own),
so it serves any model opset from 18 on (torch 2.13 exports opset 20 by default).

Each node's lowering is its `onnx` in fusegen.ir.primitives.PRIMITIVES: one operator, a
decomposition into other primitives, or one of the formulas below. Where ONNX has no
operator, or onnxruntime's is not torch's, the node is a formula:

  torch              ONNX                                       why
  expm1, log1p       Kahan's exp(x)-1 / log(1+x) corrections    no operator; exp(x)-1 loses digits
  erfc               1-Erf(x) below 0.5, a rational exp form     no operator; 1-erf(x) underflows
                     (in double, relative error < 2.7e-7) above
  sigmoid            1/(1+Exp(-x)), the kernels' formula         onnxruntime's Sigmoid is 0 below -30ish
  sign               Where(IsNaN(x), 0, Sign(x))                 torch.sign(NaN) is 0, Sign's is NaN
  rsqrt              Reciprocal(Sqrt(x))                         no operator
  x != y             Not(Equal(x, y))                            no operator
  pow special cases  x*x, x*x*x, Sqrt, Reciprocal, ...           torch.pow's own spellings
  clamp              Clip (number bounds), Max/Min (tensor)      Clip's bounds must be scalars
  softplus           Where(x > 20, x, log1p(Exp(x)))             no operator (Softplus has no threshold)

onnxruntime's CPU provider has no double Atan, Erf or Tan: in a float64 model Tan is
Sin/Cos and Atan/Erf compute in float (so they agree with torch to ~1e-7, not 1e-16).
"""

from __future__ import annotations

import inspect
from typing import Callable

import numpy as np
import torch

try:
    from onnxscript import ir
    from onnxscript import opset18 as op
except ModuleNotFoundError as err:  # an optional feature: say which extra brings it
    raise ModuleNotFoundError(f"fusegen's ONNX export needs {err.name}: pip install 'fusegen[onnx]' "
                              f"(onnx, onnxscript, onnxruntime)", name=err.name) from err

from fusegen.ir import dag
from fusegen.ir import primitives as fn
from fusegen.errors import FusegenError
from fusegen.ir.expr import symbol

OPSET = op.version  # 18: the ONNX operators below are this opset's

# ONNX element types and torch dtypes of the tensors a fused op accepts.
_TORCH_DTYPES = {
    ir.DataType.FLOAT: torch.float32, ir.DataType.DOUBLE: torch.float64,
    ir.DataType.FLOAT16: torch.float16, ir.DataType.BFLOAT16: torch.bfloat16,
    ir.DataType.BOOL: torch.bool, ir.DataType.UINT8: torch.uint8, ir.DataType.INT8: torch.int8,
    ir.DataType.INT16: torch.int16, ir.DataType.INT32: torch.int32, ir.DataType.INT64: torch.int64,
}
_ONNX_DTYPES = {t: d for d, t in _TORCH_DTYPES.items()}

# The kernels' compute type per result dtype: fp16/bf16 are computed in float.
_COMPUTE = {torch.float32: ir.DataType.FLOAT, torch.float64: ir.DataType.DOUBLE,
            torch.float16: ir.DataType.FLOAT, torch.bfloat16: ir.DataType.FLOAT}

# Nodes that are one ONNX operator computing what torch computes (onnxruntime >= 1.19
# propagates NaN through Max/Min, as torch.maximum/minimum do; the ONNX text is silent).
_OPERATORS = {p.node: p.onnx for p in fn.PRIMITIVES if isinstance(p.onnx, str)}
# Nodes lowered as a tree of other primitives (args -> tree), emitted node by node.
_DECOMPOSITIONS = {p.node: p.onnx for p in fn.PRIMITIVES if callable(p.onnx)}

# Operators onnxruntime's CPU provider implements in float but not in double.
_DOUBLE_SPELLINGS: dict[str, Callable] = {"Tan": lambda x: op.Div(op.Sin(x), op.Cos(x))}
_FLOAT_ONLY = frozenset({"Atan", "Erf"})


def _constant(value: float, dtype: ir.DataType):
    return op.Constant(value=ir.tensor(np.array(value, dtype=dtype.numpy())))


class _Emitter:
    """Emits ONNX for one call of one op: a tree node -> an ONNX value, each shared
    subtree once, every number a constant of the compute type."""

    def __init__(self, dtype: ir.DataType, symbols: dict[str, object]):
        self.dtype = dtype
        self.memo: dict = {symbol(k): v for k, v in symbols.items()}

    def const(self, value: float):
        return _constant(value, self.dtype)

    def __call__(self, expr):
        value = self.memo.get(expr)
        if value is None:
            value = self.memo[expr] = self._emit(expr)
        return value

    def _emit(self, expr):
        kind = type(expr)
        if fn.is_number(expr):
            return self.const(float(expr))
        if kind in _OPERATORS:
            return self.operator(_OPERATORS[kind], *map(self, expr.args))
        if kind in _FORMULAS:
            return _FORMULAS[kind](self, *expr.args)
        if kind in _DECOMPOSITIONS:
            return self(_DECOMPOSITIONS[kind](*expr.args))
        raise FusegenError(f"fusegen's ONNX export has no translation for {kind.__name__} in {expr}")

    def operator(self, name: str, *args):
        if self.dtype == ir.DataType.DOUBLE and name in _DOUBLE_SPELLINGS:
            return _DOUBLE_SPELLINGS[name](*args)
        if self.dtype == ir.DataType.DOUBLE and name in _FLOAT_ONLY:
            floats = [op.Cast(a, to=ir.DataType.FLOAT) for a in args]
            return op.Cast(getattr(op, name)(*floats), to=self.dtype)
        return getattr(op, name)(*args)


# -- formulas: nodes that no single ONNX operator computes as torch does --------------------
# Each takes the emitter and the node's tree arguments.

def _not_equal(e: _Emitter, a, b):
    return op.Not(op.Equal(e(a), e(b)))


def _rsqrt(e: _Emitter, x):
    return op.Reciprocal(op.Sqrt(e(x)))


def _sigmoid(e: _Emitter, x):
    return op.Reciprocal(op.Add(e.const(1), op.Exp(op.Neg(e(x)))))


def _sign(e: _Emitter, x):
    x = e(x)
    return op.Where(op.IsNaN(x), e.const(0), op.Sign(x))


def _expm1(e: _Emitter, x):
    """Kahan: with u = exp(x), expm1(x) = (u - 1) / log(u) * x, whose rounding errors in u
    cancel (exact within a few ulps where exp(x) - 1 keeps no digit of a small x); u == 1
    gives x itself, u - 1 == -1 gives -1 and u == inf gives inf."""
    x = e(x)
    u = op.Exp(x)
    um1 = op.Sub(u, e.const(1))
    kahan = op.Mul(op.Div(um1, op.Log(u)), x)
    large = op.Where(op.IsInf(u, detect_negative=0), u, kahan)
    return op.Where(op.Equal(u, e.const(1)), x, op.Where(op.Equal(um1, e.const(-1)), e.const(-1), large))


def _log1p(e: _Emitter, x):
    """Kahan: with u = 1 + x, log1p(x) = log(u) / (u - 1) * x (exact within a few ulps);
    u == 1 gives x itself (-0.0 included) and u == inf gives inf."""
    x = e(x)
    u = op.Add(e.const(1), x)
    kahan = op.Mul(op.Div(op.Log(u), op.Sub(u, e.const(1))), x)
    return op.Where(op.Equal(u, e.const(1)), x, op.Where(op.IsInf(u, detect_negative=0), u, kahan))


# erfc(z) = t * exp(-z*z + P(t)), t = 1 / (1 + z/2), for z >= 0 (Numerical Recipes' erfcc,
# Chebyshev-fitted: relative error below 2.7e-7 in double, checked against torch.special.erfc
# on [0.5, 27]); below 0.5, 1 - erf(z) >= 0.48 loses nothing.
_ERFC_COEFFICIENTS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
                      0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def _erfc(e: _Emitter, x):
    double = ir.DataType.DOUBLE
    x = e(x)
    z = _cast(x, double)  # double: exp(-z*z) keeps its digits at large z
    t = op.Reciprocal(op.Add(_constant(1, double), op.Mul(_constant(0.5, double), z)))
    poly = _constant(_ERFC_COEFFICIENTS[-1], double)
    for c in reversed(_ERFC_COEFFICIENTS[1:-1]):
        poly = op.Add(_constant(c, double), op.Mul(t, poly))
    exponent = op.Add(op.Sub(_constant(_ERFC_COEFFICIENTS[0], double), op.Mul(z, z)), op.Mul(t, poly))
    tail = _cast(op.Mul(t, op.Exp(exponent)), e.dtype)
    near = op.Sub(e.const(1), e.operator("Erf", x))
    return op.Where(op.Less(x, e.const(0.5)), near, tail)


# torch.pow's number exponents that it computes without std::pow (printer.py spells the same).
_POW_SPECIAL: dict[float, Callable] = {
    2.0: lambda x: op.Mul(x, x),
    3.0: lambda x: op.Mul(op.Mul(x, x), x),
    -2.0: lambda x: op.Reciprocal(op.Mul(x, x)),
    0.5: op.Sqrt,
    -0.5: lambda x: op.Reciprocal(op.Sqrt(x)),
    -1.0: op.Reciprocal,
}


def _power(e: _Emitter, base, exponent):
    if fn.is_number(exponent) and float(exponent) in _POW_SPECIAL:
        return _POW_SPECIAL[float(exponent)](e(base))
    return op.Pow(e(base), e(exponent))


def _clamp(e: _Emitter, x, lo, hi):
    """Number bounds: Clip (NaN stays NaN, a tie keeps x, as the kernels' clamp_min/max);
    an absent bound is -inf/inf, not Clip's default (the largest float, which clips inf).
    Tensor or scalar bounds: Max then Min, torch's clamp.Tensor."""
    if fn.clamp_bounds_are_numbers(lo, hi):
        return op.Clip(e(x), e(lo), e(hi))
    out = e(x)
    if fn.has_bound(lo):
        out = op.Max(out, e(lo))
    if fn.has_bound(hi):
        out = op.Min(out, e(hi))
    return out


def _reduce(name: str):
    """A reduction over the last axis that keeps it (keepdim=True), as opset 18 spells it."""
    def formula(e: _Emitter, x):
        axes = op.Constant(value=ir.tensor(np.array([-1], dtype=np.int64)))
        return getattr(op, name)(e(x), axes, keepdims=1)
    return formula


# The primitives whose `onnx` is primitives.ONNX_FORMULA.
_FORMULAS: dict[type, Callable] = {
    fn.RowSum: _reduce("ReduceSum"), fn.RowMean: _reduce("ReduceMean"), fn.RowMax: _reduce("ReduceMax"),
    fn.RowMin: _reduce("ReduceMin"),
    fn.NotEqual: _not_equal, fn.Rsqrt: _rsqrt, fn.Sigmoid: _sigmoid, fn.Sign: _sign,
    fn.Expm1: _expm1, fn.Log1p: _log1p, fn.Erfc: _erfc, fn.Power: _power, fn.Clamp: _clamp,
}


# -- one op's translation function ------------------------------------------------------------

def _cast(value, dtype: ir.DataType):
    return value if value.dtype == dtype else op.Cast(value, to=dtype)


def _result_dtype(name: str, tensors: dict, scalars) -> torch.dtype:
    """The op's own result dtype for these arguments: its Meta impl (the runtime's
    promotion, eager's rules) called on meta tensors of the same dtypes and ranks."""
    metas = []
    for arg, v in tensors.items():
        if v.dtype not in _TORCH_DTYPES:
            raise FusegenError(f"fusegen::{name} (ONNX export): argument '{arg}' is {v.dtype.name}; "
                               f"expected one of {', '.join(d.name for d in _TORCH_DTYPES)}")
        rank = len(v.shape) if v.shape is not None else 1
        metas.append(torch.empty((1,) * rank, dtype=_TORCH_DTYPES[v.dtype], device="meta"))
    out = getattr(torch.ops.fusegen, name)(*metas, *(0.0 for _ in scalars))  # (joined: 1-d at least)
    return (out[0] if isinstance(out, tuple) else out).dtype  # (several outputs: one dtype)


def _untranslatable(name: str, outputs) -> str | None:
    """Why the op has no ONNX translation, or None."""
    used = dag.free_symbols(list(outputs))
    if any(fn.is_random(s) for s in used):
        return (f"fusegen::{name} draws random numbers (rand_like, dropout): its ONNX export is not "
                "supported; export the model in eval mode (dropout off) or without the translation "
                "table (torch's own random ops are then exported)")
    if fn.COLUMN in used:
        return (f"fusegen::{name} gathers along its rows (x.gather(-1, index)): its ONNX export is not "
                "supported; export the model without the translation table (torch's own ops are then "
                "exported), or write the op without the gather")
    return None


def _translation(name: str, inputs, scalars, outputs, joined: bool = False) -> Callable:
    """The onnxscript translation of torch.ops.fusegen.<name>, computing `outputs` (the op's
    trees over symbols named `inputs` and `scalars`; several: a tuple of values). It takes the op's arguments (by position
    or by their schema names): ONNX values for tensors, and for each runtime scalar a Python
    number (torch.export bakes a `float` argument into the graph: it cannot trace a
    data-dependent one there), which becomes a constant."""
    signature = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                   for p in (*inputs, *scalars)])

    refusal = _untranslatable(name, outputs)
    if refusal is not None:
        raise FusegenError(refusal)

    def translate(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        tensors = {p: bound[p] for p in inputs}
        result = _ONNX_DTYPES[_result_dtype(name, tensors, scalars)]
        compute = _COMPUTE[_TORCH_DTYPES[result]]
        # Each input as the runtime reads it: converted to the result dtype, then computed in
        # the compute type (int -> fp16 -> float rounds as the kernel's input does).
        symbols = {p: _cast(_cast(v, result), compute) for p, v in tensors.items()}
        symbols.update((p, _constant(float(bound[p]), compute)) for p in scalars)
        emit = _Emitter(compute, symbols)  # one emitter: what the outputs share is emitted once
        outs = []
        for tree in outputs:
            out = _cast(emit(tree), result)
            # An output that is an input (`x`), or another output, still needs a node of its
            # own: a graph's output is neither its input nor another of its outputs.
            seen = any(out is v for v in tensors.values()) or any(out is o for o in outs)
            outs.append(op.Identity(out) if seen else out)
        if joined:  # torch.cat((out0, out1), -1)
            return op.Concat(*outs, axis=-1)
        return outs[0] if len(outs) == 1 else tuple(outs)

    translate.__signature__ = signature
    translate.__name__ = translate.__qualname__ = f"fusegen_{name}"
    return translate


def onnx_translations(*ops) -> dict:
    """`{torch.ops.fusegen.<name>.default: translation}` for torch.onnx.export's
    `custom_translation_table`, for the given ops (FusedOp, @fused functions,
    torch.ops.fusegen.<name> or its overload, or op names), or, with none, for every op
    fusegen has built or loaded in this process (building the @fused functions that wait
    for their first call: the model may not have run yet) that has one: an op that draws
    random numbers or gathers is refused by name, and left out of the whole table."""
    from fusegen import api
    from fusegen.frontend.decorator import build_pending

    if not ops:
        build_pending()
    names = [_op_name(o) for o in ops] if ops else sorted(api._OPS)
    table = {}
    for name in names:
        fused = api._OPS.get(name)
        if fused is None:
            raise FusegenError(f"onnx_translations: fusegen op '{name}' was not built or loaded by "
                               f"fusegen in this process; expected an op made with fusegen.fuse, "
                               f"fuse_many or @fused (the translation needs its expression)")
        spec = fused.spec
        if not ops and _untranslatable(spec.name, spec.outputs) is not None:
            continue  # (every op of the process: one without a translation exports as torch's ops)
        table[fused.op.default] = _translation(spec.name, spec.inputs, spec.scalars, spec.outputs, spec.joined)
    return table


def _op_name(o) -> str:
    from fusegen.api import FusedOp
    from fusegen.frontend.decorator import FusedFunction

    if isinstance(o, FusedFunction):
        o = o.op
    if isinstance(o, FusedOp):
        return o.name
    if isinstance(o, str):
        return o
    if isinstance(o, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        namespace, _, name = (o._qualified_op_name if isinstance(o, torch._ops.OpOverloadPacket)
                              else o.name()).partition("::")
        if namespace == "fusegen":
            return name
    raise FusegenError(f"onnx_translations: expected fusegen ops (FusedOp, @fused functions, "
                       f"torch.ops.fusegen.<name> or op names), got {o!r}")

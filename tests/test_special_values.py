"""Every function and operator of the language against eager PyTorch at special values.

One grid of special values per dtype (±0, smallest subnormal, smallest normal, ±1, ±2,
±100, very large, ±inf, NaN); one table of (expression, eager PyTorch as the user would
write it) cases. Unary cases run over the grid, binary ones over its cartesian square,
ternary ones over its cube, so every tie (±inf ties and NaN included), every kink (0 for
relu/abs/sign, the constant clamp bounds -1, 1, 2 and 0) and every crossing of tensor
bounds is hit. Forward and every gradient (for grad = 1) are compared in float64 and
float32. Then the cases an independent random-expression check found, reproduced by hand,
each with the value eager PyTorch gives. All ops build into one library (one compile).

How values are compared (`mismatches`, tests/helpers.py):
- NaN must be NaN, ±inf must be the same inf, 0 must be 0: special values are exact.
- The sign of a zero must match eager's where eager's is deterministic. Eager CPU kernels
  have a vectorized path (contiguous tensors) and a scalar path (strided ones), and the two
  can disagree on the sign of a zero; eager is run both ways, and where they disagree the
  sign of that zero is not compared. A gradient eager does not produce at all (`a < b` has
  no graph) is a zero of either sign.
- Where the two eager paths disagree beyond the sign of a zero (NaN on one, a number on the
  other), eager is nondeterministic and the point is skipped.
- Except a subnormal against an eager 0 (eager's log1p(5e-324) is 0): that is rounding at
  the bottom of the range, not a special value.
- Finite nonzero values: relative tolerance (1e-12 in float64, 4 ulp-ish in float32),
  absolute tolerance of the smallest normal number (so subnormal rounding is not a failure).

Nothing here is marked xfail: a failure is a difference from eager PyTorch.
"""

from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from conftest import selected_params
from fusegen.api import Request, fuse_many, generate
from helpers import forward_backward_named, mismatches, same_bits
from fusegen.tools.reference import evaluate_text

INF, NAN = math.inf, math.nan

# -- the grid ----------------------------------------------------------------------------------

GRID = {
    torch.float64: [0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 0.5, -0.5, 1.0, -1.0,
                    2.0, -2.0, 100.0, -100.0, 1e300, -1e300, INF, -INF, NAN],
    torch.float32: [0.0, -0.0, 1e-45, -1e-45, 1.1754944e-38, 0.5, -0.5, 1.0, -1.0,
                    2.0, -2.0, 100.0, -100.0, 3e38, -3e38, INF, -INF, NAN],
}
DTYPES = {"f64": torch.float64, "f32": torch.float32}
RTOL = {torch.float64: 1e-12, torch.float32: 5e-7}


# -- the cases: (id, expression, eager PyTorch of the same expression) ---------------------------

@dataclass(frozen=True)
class Case:
    id: str
    expr: str
    eager: Callable  # parameters named like the expression's inputs

    @property
    def name(self) -> str:
        return "sv_" + self.id

    @property
    def inputs(self) -> list[str]:
        return list(inspect.signature(self.eager).parameters)


def _cmp(f):
    """A comparison is worth 1 or 0 in fusegen's language: eager's bool in the input dtype."""
    return lambda a, b: f(a, b).to(a.dtype)


CASES = [
    # unary functions and operators, over the grid
    Case("abs", "abs(x)", lambda x: torch.abs(x)),
    Case("exp", "exp(x)", lambda x: torch.exp(x)),
    Case("expm1", "expm1(x)", lambda x: torch.expm1(x)),
    Case("log", "log(x)", lambda x: torch.log(x)),
    Case("log1p", "log1p(x)", lambda x: torch.log1p(x)),
    Case("sqrt", "sqrt(x)", lambda x: torch.sqrt(x)),
    Case("rsqrt", "rsqrt(x)", lambda x: torch.rsqrt(x)),
    Case("sin", "sin(x)", lambda x: torch.sin(x)),
    Case("cos", "cos(x)", lambda x: torch.cos(x)),
    Case("tan", "tan(x)", lambda x: torch.tan(x)),
    Case("tanh", "tanh(x)", lambda x: torch.tanh(x)),
    Case("atan", "atan(x)", lambda x: torch.atan(x)),
    Case("sigmoid", "sigmoid(x)", lambda x: torch.sigmoid(x)),
    Case("relu", "relu(x)", lambda x: F.relu(x)),
    Case("erf", "erf(x)", lambda x: torch.erf(x)),
    Case("erfc", "erfc(x)", lambda x: torch.erfc(x)),
    Case("sign", "sign(x)", lambda x: torch.sign(x)),
    Case("neg", "-x", lambda x: -x),
    Case("pow_2", "x**2", lambda x: x ** 2),
    Case("pow_3", "x**3", lambda x: x ** 3),
    Case("pow_0_5", "x**0.5", lambda x: x ** 0.5),
    Case("pow_m1", "x**-1", lambda x: x ** -1),
    Case("pow_m0_5", "x**-0.5", lambda x: x ** -0.5),
    Case("pow_2_5", "x**2.5", lambda x: x ** 2.5),
    Case("clamp_const", "clamp(x, -1.0, 2.0)", lambda x: torch.clamp(x, -1.0, 2.0)),
    Case("clamp_min0", "clamp(x, min=0.0)", lambda x: torch.clamp(x, min=0.0)),
    Case("clamp_max1", "clamp(x, max=1.0)", lambda x: torch.clamp(x, max=1.0)),
    Case("clamp_crossed", "clamp(x, 2.0, -1.0)", lambda x: torch.clamp(x, 2.0, -1.0)),
    # binary, over the grid squared
    Case("add", "a + b", lambda a, b: a + b),
    Case("sub", "a - b", lambda a, b: a - b),
    Case("mul", "a * b", lambda a, b: a * b),
    Case("div", "a / b", lambda a, b: a / b),
    Case("pow_op", "a ** b", lambda a, b: a ** b),
    Case("pow_fn", "pow(a, b)", lambda a, b: torch.pow(a, b)),
    Case("maximum", "maximum(a, b)", lambda a, b: torch.maximum(a, b)),
    Case("minimum", "minimum(a, b)", lambda a, b: torch.minimum(a, b)),
    Case("clamp_min_t", "clamp(a, min=b)", lambda a, b: torch.clamp(a, min=b)),
    Case("clamp_max_t", "clamp(a, max=b)", lambda a, b: torch.clamp(a, max=b)),
    Case("where_gt", "where(a > b, a, b)", lambda a, b: torch.where(a > b, a, b)),
    Case("lt", "a < b", _cmp(torch.lt)),
    Case("le", "a <= b", _cmp(torch.le)),
    Case("gt", "a > b", _cmp(torch.gt)),
    Case("ge", "a >= b", _cmp(torch.ge)),
    Case("eq", "a == b", _cmp(torch.eq)),
    Case("ne", "a != b", _cmp(torch.ne)),
    # ternary, over the grid cubed
    Case("clamp_t", "clamp(a, b, c)", lambda a, b, c: torch.clamp(a, b, c)),
    Case("where_nonzero", "where(a, b, c)", lambda a, b, c: torch.where(a != 0, b, c)),
]


# -- the hand-reproduced cases: eager's values as stated, then fusegen against eager -----------

@dataclass(frozen=True)
class Reproduced:
    id: str
    expr: str
    eager: Callable
    at: dict                # input name -> list of values (one point per position)
    stated: dict            # "forward" or "d/d<name>" -> eager's values at those points
    dtype: torch.dtype = torch.float64
    notes: str = ""

    @property
    def name(self) -> str:
        return "sx_" + self.id


REPRODUCED = [
    Reproduced("abs_sigmoid", "abs(sigmoid(x))", lambda x: torch.abs(torch.sigmoid(x)),
               {"x": [0.5]}, {"d/dx": [0.2350]}),
    Reproduced("abs_pow", "abs(x**y)", lambda x, y: torch.abs(x ** y),
               {"x": [2.0], "y": [3.0]}, {"forward": [8.0], "d/dx": [12.0], "d/dy": [5.545]}),
    Reproduced("min_min_ties", "minimum(minimum(a, b), c)",
               lambda a, b, c: torch.minimum(torch.minimum(a, b), c),
               {"a": [1.0, 1.0], "b": [1.0, 1.0], "c": [1.0, NAN]},
               {"forward": [1.0, NAN], "d/da": [0.25, 0.5], "d/db": [0.25, 0.5], "d/dc": [0.5, 1.0]}),
    Reproduced("max_inf_ties", "maximum(a, b)", lambda a, b: torch.maximum(a, b),
               {"a": [INF, -INF], "b": [INF, -INF]}, {"d/da": [0.5, 0.5], "d/db": [0.5, 0.5]}),
    Reproduced("sin_clamp_log", "sin(clamp(log(x), 0, 1))",
               lambda x: torch.sin(torch.clamp(torch.log(x), 0, 1)),
               {"x": [-1.0]}, {"d/dx": [-0.0]}, notes="a 0/1 mask times NaN must not leak"),
    Reproduced("div_subnormal", "x / y", lambda x, y: x / y,
               {"x": [0.0], "y": [5e-324]}, {"forward": [0.0]}),
    Reproduced("div_f32_tiny", "x / y", lambda x, y: x / y,
               {"x": [1e-39], "y": [1e-39]}, {"forward": [1.0]}, dtype=torch.float32),
    Reproduced("erfc_mul", "erfc(a*b)", lambda a, b: torch.erfc(a * b),
               {"a": [0.0], "b": [-1e300]}, {"d/da": [1.1284e300]}),
    Reproduced("expm1_pow_clamp", "expm1(pow(clamp(w, max=100.0), 4))",
               lambda w: torch.expm1(torch.pow(torch.clamp(w, max=100.0), 4)),
               {"w": [-3.0202, 3.0, 100.0]}, {"d/dw": [-1.503e38, 1.627e37, INF]}, dtype=torch.float32),
    Reproduced("pow_exp", "y ** exp(x)", lambda y, x: y ** torch.exp(x),
               {"y": [0.0], "x": [-1000.0]}, {"forward": [1.0], "d/dy": [0.0], "d/dx": [0.0]}),
    Reproduced("relu_nan", "relu(x)", lambda x: F.relu(x), {"x": [NAN]},
               {"forward": [NAN], "d/dx": [1.0]}),
    Reproduced("rsqrt_neg_zero", "rsqrt(x)", lambda x: torch.rsqrt(x), {"x": [-0.0]},
               {"forward": [-INF], "d/dx": [INF]}),
    Reproduced("mul_zero", "a*0", lambda a: a * 0, {"a": [INF, NAN, 2.0]}, {"forward": [NAN, NAN, 0.0]}),
    Reproduced("max_zero_pow", "maximum(0*x, x)**-1",
               lambda x: torch.maximum(0 * x, x) ** -1, {"x": [-1.0]}, {"forward": [-INF]}),
    Reproduced("log_zoo", "log((a - a) / -3.75)", lambda a: torch.log((a - a) / -3.75),
               {"a": [1.0]}, {"forward": [-INF]}, notes="must be accepted, not refused as zoo"),
]


# -- building: every op above in one library -----------------------------------------------------

@pytest.fixture(scope="module")
def built(request):
    """name -> FusedOp, or name -> the exception fusegen raised making it (that case fails
    with it; the others still build, together, in one compile). Only the cases of the
    tests selected in this run are built."""
    wanted = {c.name for c in selected_params(request, "case")}
    exprs = {c.name: c.expr for c in [*CASES, *REPRODUCED] if c.name in wanted}
    refused = {}
    for name, expr in exprs.items():
        try:
            generate(Request(expr, name))
        except Exception as err:  # noqa: BLE001 - reported by the case that needs it
            refused[name] = err
    todo = [Request(e, n) for n, e in exprs.items() if n not in refused]
    return dict(zip([r.name for r in todo], fuse_many(todo))) | refused


def op_of(built, name):
    op = built[name]
    if isinstance(op, Exception):
        pytest.fail(f"fusegen could not make {name}: {type(op).__name__}: {op}")
    return op


# -- evaluation and comparison -------------------------------------------------------------------

def grid_inputs(names: list[str], dtype) -> tuple[dict[str, torch.Tensor], list[str]]:
    values = GRID[dtype]
    combos = list(itertools.product(values, repeat=len(names)))
    tensors = {k: torch.tensor([c[j] for c in combos], dtype=dtype) for j, k in enumerate(names)}
    points = [", ".join(f"{k}={v!r}" for k, v in zip(names, c)) for c in combos]
    return tensors, points


def compare_all(op, eager, tensors, points, dtype, limit=25) -> list[str]:
    got_out, got_grads = forward_backward_named(op, tensors)
    want_out, want_grads = forward_backward_named(eager, tensors)
    alt_out, alt_grads = forward_backward_named(eager, tensors, strided=True)
    problems = mismatches("forward", got_out, want_out, alt_out, points, dtype, RTOL[dtype])
    for k in tensors:
        problems += mismatches(f"d/d{k}", got_grads[k], want_grads[k], alt_grads[k], points, dtype, RTOL[dtype])
    if len(problems) > limit:
        problems = problems[:limit] + [f"... and {len(problems) - limit} more"]
    return problems


# -- the tests ---------------------------------------------------------------------------------

# The kinks, ties and masks of every family run by default; the whole grid is slow.
QUICK_GRID = {"relu", "abs", "sign", "maximum", "where_gt", "clamp_t", "pow_op", "div", "sigmoid", "log1p"}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c.name in QUICK_GRID else pytest.mark.slow)
                                  for c in CASES], ids=lambda c: c.id)
def test_grid(built, case, dtype):
    op = op_of(built, case.name)
    assert op.spec.inputs == tuple(case.inputs), "the table's lambda must name the inputs in order"
    tensors, points = grid_inputs(case.inputs, dtype)
    problems = compare_all(op, case.eager, tensors, points, dtype)
    assert not problems, f"{case.expr} ({len(points)} points, {dtype}):\n" + "\n".join(problems)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_evaluator_is_eager_on_the_grid(case, dtype):
    """reference.evaluate_text (the --check oracle) computes exactly what the hand-written
    eager expression computes, forward and gradients, on the whole grid."""
    tensors, points = grid_inputs(case.inputs, dtype)
    got_out, got_grads = forward_backward_named(lambda **kw: evaluate_text(case.expr, kw), tensors)
    want_out, want_grads = forward_backward_named(case.eager, tensors)
    assert bool(same_bits(got_out, want_out).all()), case.expr
    for k in tensors:
        g, w = got_grads[k], want_grads[k]
        assert (g is None) == (w is None) and (g is None or bool(same_bits(g, w).all())), f"{case.expr} d/d{k}"


def _stated_ok(got: float, want: float) -> bool:
    if math.isnan(want) or math.isinf(want) or want == 0:
        return (math.isnan(got) and math.isnan(want)) or (got == want and math.copysign(1, got) == math.copysign(1, want))
    return math.isclose(got, want, rel_tol=1e-3)


@pytest.mark.parametrize("case", REPRODUCED, ids=lambda r: r.id)
def test_reproduced(built, case):
    tensors = {k: torch.tensor(v, dtype=case.dtype) for k, v in case.at.items()}
    points = [", ".join(f"{k}={case.at[k][i]!r}" for k in case.at) for i in range(len(next(iter(case.at.values()))))]
    # eager gives what the case states it gives
    want_out, want_grads = forward_backward_named(case.eager, tensors)
    eager_values = {"forward": want_out} | {f"d/d{k}": g for k, g in want_grads.items()}
    for what, stated in case.stated.items():
        got = eager_values[what].tolist()
        assert all(_stated_ok(g, s) for g, s in zip(got, stated)), f"eager {what} is {got}, stated {stated}"
    # fusegen gives what eager gives
    op = op_of(built, case.name)
    assert op.spec.inputs == tuple(case.at), "the table's inputs must be in the op's order"
    problems = compare_all(op, case.eager, tensors, points, case.dtype)
    assert not problems, f"{case.expr} {case.notes}:\n" + "\n".join(problems)

"""Differentiation and the OpSpec: PyTorch's gradient conventions at kinks (fused op vs
eager autograd at the exact kink points), passthrough detection, and cse."""

from __future__ import annotations

import json
import math

import pytest
import sympy
import torch

from corpus import BY_NAME
from fusegen.ir import primitives as fn
from fusegen.ir import names
from fusegen.api import Request, fuse_many
from fusegen.errors import FusegenError, SpecError
from fusegen.frontend.parse import parse
from fusegen.ir.expr import symbol
from fusegen.codegen.printer import print_program
from fusegen.ir.spec import GRAD, default_name, differentiate


def grads_both(name, ops, *columns, dtype=torch.float64):
    """Fused and eager gradients (and outputs) for inputs given as value lists."""
    case, op = BY_NAME[name], ops[name]
    results = []
    for f in (op, case.eager):
        leaves = [torch.tensor(col, dtype=dtype, requires_grad=True) for col in columns]
        out = f(*leaves, *case.scalar_values)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
        results.append((out.detach(), [g if g is not None else torch.zeros_like(l) for g, l in zip(grads, leaves)]))
    return results


def assert_same_as_eager(name, ops, *columns, dtype=torch.float64):
    (out, grads), (want_out, want_grads) = grads_both(name, ops, *columns, dtype=dtype)
    torch.testing.assert_close(out, want_out, equal_nan=True)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-12, atol=0)
    return grads


# -- conventions at kinks --------------------------------------------------------------------

def test_relu_gradient_at_zero_is_zero(corpus_ops):
    gx, gy = assert_same_as_eager("cp_relu_mul", corpus_ops, [0.0, -0.0, 1e-300, -1.0], [1.0, 2.0, 1.0, 1.0])
    assert gx.tolist() == [0.0, 0.0, 1.0, 0.0]


def test_relu_gate_at_zero(corpus_ops):
    """(x+y)*((x+y)>0): the comparison has zero gradient, so d/dx = (x+y > 0)."""
    gx, gy = assert_same_as_eager("cp_relu_gate", corpus_ops, [1.0, -1.0, 2.0], [-1.0, 1.0, 1.0])
    assert gx.tolist() == [0.0, 0.0, 1.0]


def test_abs_gradient_at_zero_is_zero_and_sign_has_none(corpus_ops):
    # abs(x) + sign(y)*x: d/dx = sign(x) + sign(y), d/dy = 0 (sign's gradient), even at y == 0.
    gx, gy = assert_same_as_eager("cp_abs_sign", corpus_ops, [0.0, 0.0, -2.0, 3.0], [0.0, 5.0, 0.0, -1.0])
    assert gx.tolist() == [0.0, 1.0, -1.0, 0.0]
    assert gy.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_maximum_minimum_ties_split_gradient(corpus_ops):
    # maximum(x, y) - 0.5*minimum(x, y): at a tie each side gets half of each.
    gx, gy = assert_same_as_eager("cp_max_min", corpus_ops, [1.0, 0.0, 2.0, -3.0], [1.0, 0.0, 1.0, 4.0])
    assert gx.tolist() == [0.25, 0.25, 1.0, -0.5]
    assert gy.tolist() == [0.25, 0.25, -0.5, 1.0]


def test_maximum_propagates_nan_like_torch(corpus_ops):
    op = corpus_ops["cp_max_min"]
    x = torch.tensor([math.nan, 1.0, math.nan], dtype=torch.float64)
    y = torch.tensor([1.0, math.nan, math.nan], dtype=torch.float64)
    assert torch.isnan(op(x, y)).all()
    assert torch.isnan(BY_NAME["cp_max_min"].eager(x, y)).all()


def test_clamp_passes_gradient_at_its_bounds(corpus_ops):
    # clamp(x, -0.5, 0.5) + clamp(y, min=0): x == lo, x == hi and y == 0 all pass grad.
    gx, gy = assert_same_as_eager("cp_clamp", corpus_ops, [-0.5, 0.5, 0.7, -0.7, 0.1], [0.0, 0.0, -1.0, 1.0, 3.0])
    assert gx.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert gy.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_clamp_with_tensor_bounds(corpus_ops):
    x = [0.0, 1.0, -2.0, 2.0, 0.5, 0.0]
    lo = [0.0, 0.0, -1.0, -1.0, 1.0, 1.0]   # x == lo, inside, below, above, crossed bounds...
    hi = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    gx, glo, ghi = assert_same_as_eager("cp_clamp_tensor", corpus_ops, x, lo, hi)
    assert gx.tolist()[:4] == [1.0, 1.0, 0.0, 0.0]
    assert glo.tolist()[:4] == [0.0, 0.0, 1.0, 0.0]
    assert ghi.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # lo > hi: torch returns hi


def test_where_sends_grad_only_to_chosen_branch(corpus_ops):
    # where(x > y, x*y, x - y); the tie x == y takes the x - y branch.
    gx, gy = assert_same_as_eager("cp_where", corpus_ops, [2.0, 1.0, 1.0], [3.0, 3.0, 1.0])
    assert gx.tolist() == [1.0, 1.0, 1.0]
    assert gy.tolist() == [-1.0, -1.0, -1.0]
    gx, gy = assert_same_as_eager("cp_where", corpus_ops, [3.0], [2.0])
    assert (gx.item(), gy.item()) == (2.0, 3.0)


def test_comparisons_have_zero_gradient(corpus_ops):
    # x*(x<y) + y*(x>=y) + (x<=0.5) - (y==x) + x*(x!=0), at every comparison's edge.
    gx, gy = assert_same_as_eager("cp_compare", corpus_ops, [0.5, 1.0, 0.0, 0.0], [0.5, 1.0, 0.0, 2.0])
    assert gx.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert gy.tolist() == [1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sigmoid_derivative_finite_for_large_inputs(corpus_ops, dtype):
    values = [-1000.0, -100.0, 100.0, 1000.0]
    (gx,) = assert_same_as_eager("cp_silu", corpus_ops, values, dtype=dtype)
    assert torch.isfinite(gx).all()
    torch.testing.assert_close(gx, torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=dtype), atol=1e-30, rtol=0)


def test_pow_gradient_at_zero_base(corpus_ops):
    # pow(x, y) + x**2.5 at x == 0: torch masks d/dy where x == 0 and y >= 0 and d/dx where y == 0.
    gx, gy = assert_same_as_eager("cp_pow", corpus_ops, [0.0, 0.0, 0.0, 2.0], [2.0, 0.0, 1.0, 0.0])
    assert gx.tolist() == [0.0, 0.0, 1.0, 2.5 * 2.0 ** 1.5]
    assert gy.tolist()[:3] == [0.0, 0.0, 0.0]


def test_kink_conventions_hold_in_float32_too(corpus_ops):
    assert_same_as_eager("cp_max_min", corpus_ops, [1.0, 0.0], [1.0, 0.0], dtype=torch.float32)
    assert_same_as_eager("cp_clamp", corpus_ops, [-0.5, 0.5], [0.0, 0.0], dtype=torch.float32)


# -- the OpSpec --------------------------------------------------------------------------------

def test_passthrough_detection_fma():
    spec = differentiate(parse("a*b+c"), name="spec_fma")
    assert [(g.input, g.passthrough) for g in spec.gradients] == [("a", False), ("b", False), ("c", True)]
    a, b = symbol("a"), symbol("b")
    assert [g.expr for g in spec.gradients] == [fn.Times(GRAD, b), fn.Times(GRAD, a), GRAD]
    assert [g.input for g in spec.kernel_gradients] == ["a", "b"]
    assert spec.backward_inputs == ("a", "b")  # c is not read by the backward
    assert [n for n, _ in spec.backward_program.results] == ["grad_a", "grad_b"]


def test_all_passthrough_has_no_backward_kernel():
    spec = differentiate(parse("a+b"), name="spec_add")
    assert all(g.passthrough for g in spec.gradients)
    assert spec.kernel_gradients == () and spec.backward_program.results == ()
    assert spec.backward_inputs == ()


def test_negative_or_scaled_derivative_is_not_passthrough():
    spec = differentiate(parse("a - 2*b"), name="spec_sub")
    assert [g.passthrough for g in spec.gradients] == [True, False]
    # sub's backward negates grad, then mul's multiplies by the other factor, as autograd does
    assert spec.gradients[1].expr == fn.Times(fn.Negative(GRAD), 2)


def test_gradient_symbol_never_equals_a_user_name():
    assert GRAD.name == names.DOUT and GRAD != symbol(names.DOUT)
    spec = differentiate(parse("dout*x"), name="spec_dout")
    assert spec.gradients[1].expr == fn.Times(GRAD, symbol("dout"))


def test_cse_shares_sigmoid_between_forward_and_backward():
    spec = differentiate(parse("x*sigmoid(x)"), name="spec_silu")
    fwd, bwd = spec.forward_program, spec.backward_program
    # The sigmoid is computed once per program, as a temporary, and reused.
    for program in (fwd, bwd):
        sig_temps = [e for _, e in program.temps if type(e).__name__ == "Sigmoid"]
        assert len(sig_temps) == 1, program
    t0 = fwd.temps[0][0]
    assert fwd.temps[0][1] == bwd.temps[0][1]
    result = bwd.results[0][1]
    assert "Sigmoid" not in str(result) and t0 in result.free_symbols
    printed = print_program(bwd, "float")
    code = "\n".join(c for _, _, c in printed.temps) + "\n" + printed.results[0][1]
    assert code.count("fusegen::sigmoid(") == 1
    assert code.count("expf") == 0  # no re-derived exponentials


def test_cse_temporaries_are_numbered_per_program():
    spec = differentiate(parse("exp(x)*sin(y) + exp(x)"), name="spec_cse")
    for program in (spec.forward_program, spec.backward_program):
        assert [s.name for s, _ in program.temps] == [f"t{i}" for i in range(len(program.temps))]
        assert all(s != symbol(s.name) for s, _ in program.temps)  # never a user's `t0`


def test_scalars_are_not_differentiated_and_backward_reads_them():
    spec = differentiate(parse("x*sigmoid(beta*x) + alpha*y", scalars=["beta", "alpha"]), name="spec_sc")
    assert spec.inputs == ("x", "y") and spec.scalars == ("beta", "alpha")
    assert [g.input for g in spec.gradients] == ["x", "y"]
    assert spec.backward_scalars == ("beta", "alpha")
    assert spec.backward_inputs == ("x",)


def test_to_json_and_summary():
    spec = differentiate(parse("a*b+c"), name="spec_json")
    doc = json.loads(spec.to_json("abc123"))
    assert doc["name"] == "spec_json" and doc["expression"] == "a*b+c"
    assert doc["inputs"] == ["a", "b", "c"] and doc["passthrough"] == ["c"]
    assert doc["content_hash"] == "abc123"
    assert doc["gradients"] == {"a": "grad*b", "b": "grad*a", "c": "grad"}
    assert spec.summary() == ["d/da = grad*b", "d/db = grad*a", "d/dc = grad"]


def test_default_name_is_stable_and_content_based():
    p = parse("a*b+c")
    assert default_name(p) == default_name(parse("a*b+c"))
    assert default_name(p).startswith("fused_") and len(default_name(p)) == 14
    assert default_name(p) != default_name(parse("a*b+c", inputs="c,b,a"))
    assert differentiate(p).name == default_name(p)


# `exp` or `t3` are fine op names (README: any non-keyword identifier; the op's C code lives
# in fusegen::op_<name>).
@pytest.mark.parametrize("bad", ["fma_backward", "has space", "__x", "int", "9lives", ""])
def test_bad_op_names(bad):
    with pytest.raises(SpecError) as err:
        differentiate(parse("a*b"), name=bad)
    assert repr(bad) in str(err.value)


# -- the user's form is kept: no algebra changes a value eager gives ----------------------------

@pytest.mark.parametrize("expr, tree", [
    ("a*0", lambda a: fn.Times(a, 0)),
    ("a - a", lambda a: fn.Minus(a, a)),
    ("exp(log(a))", lambda a: fn.Exp(fn.Log(a))),
    ("sqrt(a*a)", lambda a: fn.Sqrt(fn.Times(a, a))),
    ("(a**2)**0.5", lambda a: fn.Power(fn.Power(a, 2), sympy.Float(0.5))),
    ("minimum(minimum(a, 1), a)", lambda a: fn.Minimum(fn.Minimum(a, 1), a)),
    ("a/a", lambda a: fn.Divide(a, a)),
    ("a >= a", lambda a: fn.Where(fn.GreaterEqual(a, a), 1, 0)),
    ("2*3*a", lambda a: fn.Times(6, a)),          # numbers fold as Python folds them
    ("a*2*3", lambda a: fn.Times(fn.Times(a, 2), 3)),  # ... and only those
])
def test_tree_is_the_users_form(expr, tree):
    assert parse(expr).tree == tree(symbol("a"))


@pytest.mark.parametrize("expr", ["log((a - a) / -3.75)", "log(0*a)", "a + 1/(0*a)"])
def test_expressions_sympy_would_make_zoo_are_accepted(expr):
    spec = differentiate(parse(expr), name="spec_zoo")
    assert spec.forward == parse(expr).tree


def test_constant_division_by_zero_is_refused():
    with pytest.raises(FusegenError, match="division by zero"):
        parse("a + 1/0")


# -- known pitfalls: the built op against eager, in float64 ------------------------------------
#
# Each case is (expression, eager PyTorch as the user writes it, inputs, and what to check). One
# library holds them all (one compile). `assert_exact` wants NaN where eager has NaN, the same
# infinities, the sign of every zero, and finite values to 1e-12.

DEFECTS = {
    "d_abs_sigmoid": ("abs(sigmoid(x))", lambda x: torch.abs(torch.sigmoid(x))),
    "d_abs_pow": ("abs(x**y)", lambda x, y: torch.abs(x ** y)),
    "d_min_min": ("minimum(minimum(a, b), c)", lambda a, b, c: torch.minimum(torch.minimum(a, b), c)),
    "d_max": ("maximum(a, b)", lambda a, b: torch.maximum(a, b)),
    "d_sin_clamp_log": ("sin(clamp(log(x), 0, 1))", lambda x: torch.sin(torch.clamp(torch.log(x), 0, 1))),
    "d_div": ("x / y", lambda x, y: x / y),
    "d_erfc_mul": ("erfc(a*b)", lambda a, b: torch.erfc(a * b)),
    "d_expm1_pow": ("expm1(pow(clamp(w, max=100.0), 4))",
                    lambda w: torch.expm1(torch.pow(torch.clamp(w, max=100.0), 4))),
    "d_pow_exp": ("y ** exp(x)", lambda y, x: y ** torch.exp(x)),
    "d_relu": ("relu(x)", lambda x: torch.relu(x)),
    "d_rsqrt": ("rsqrt(x)", lambda x: torch.rsqrt(x)),
    "d_mul_zero": ("a * 0", lambda a: a * 0),
    "d_max_zero_pow": ("maximum(0*x, x)**-1", lambda x: torch.maximum(0 * x, x) ** -1),
    "d_log_zoo": ("log((a - a) / -3.75)", lambda a: torch.log((a - a) / -3.75)),
    "d_exp_log": ("exp(log(x)) + a - a", lambda x, a: torch.exp(torch.log(x)) + a - a),
}


@pytest.fixture(scope="module")
def defect_ops():
    ops = fuse_many([Request(expr, name) for name, (expr, _) in DEFECTS.items()])
    return dict(zip(DEFECTS, ops))


def both(defect_ops, name, *columns, dtype=torch.float64):
    """(out, grads) of the fused op and of eager, for grad = 1."""
    results = []
    for f in (defect_ops[name], DEFECTS[name][1]):
        leaves = [torch.tensor(col, dtype=dtype, requires_grad=True) for col in columns]
        out = f(*leaves)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
        results.append([out.detach()] + [g if g is not None else torch.zeros_like(l) for g, l in zip(grads, leaves)])
    return results


def assert_exact(got, want, rtol=1e-12):
    for g, w in zip(got, want):
        assert torch.equal(torch.isnan(g), torch.isnan(w)), (got, want)
        finite = torch.isfinite(w)
        assert torch.equal(g[~finite & ~torch.isnan(w)], w[~finite & ~torch.isnan(w)]), (got, want)
        torch.testing.assert_close(g[finite], w[finite], rtol=rtol, atol=0)
        zero = (w == 0) & (g == 0)
        assert torch.equal(torch.signbit(g[zero]), torch.signbit(w[zero])), (got, want)


def test_abs_of_a_function_has_the_chain_rule_gradient(defect_ops):
    got, want = both(defect_ops, "d_abs_sigmoid", [0.5, -3.0])
    assert abs(got[1][0].item() - 0.2350) < 1e-4
    assert_exact(got, want)
    got, want = both(defect_ops, "d_abs_pow", [2.0, -2.0, 0.0], [3.0, 3.0, 2.0])
    assert got[1][0].item() == 12.0 and abs(got[2][0].item() - 5.545) < 1e-3
    assert_exact(got, want)


def test_nested_minimum_ties_split_like_eager(defect_ops):
    got, want = both(defect_ops, "d_min_min", [1.0, 1.0], [1.0, 1.0], [1.0, math.nan])
    assert [g.tolist() for g in got[1:]] == [[0.25, 0.5], [0.25, 0.5], [0.5, 1.0]]
    assert_exact(got, want)


def test_maximum_ties_at_infinity_split(defect_ops):
    got, want = both(defect_ops, "d_max", [math.inf, -math.inf, math.nan], [math.inf, -math.inf, 1.0])
    assert got[1].tolist()[:2] == [0.5, 0.5] and got[2].tolist()[:2] == [0.5, 0.5]
    assert_exact(got, want)


def test_masked_gradient_selects_instead_of_multiplying(defect_ops):
    got, want = both(defect_ops, "d_sin_clamp_log", [-1.0, 0.5, 2.0])
    assert got[1][0].item() == 0.0 and math.copysign(1, got[1][0].item()) == -1  # -0.0, not NaN
    assert_exact(got, want)


def test_division_divides(defect_ops):
    got, want = both(defect_ops, "d_div", [0.0, 1.0], [5e-324, 3.0])
    assert got[0][0].item() == 0.0
    assert_exact(got, want)
    got, want = both(defect_ops, "d_div", [1e-39], [1e-39], dtype=torch.float32)
    assert got[0].item() == 1.0
    assert_exact(got[:1], want[:1])


def test_derivative_form_does_not_overflow(defect_ops):
    got, want = both(defect_ops, "d_erfc_mul", [0.0], [-1e300])
    assert abs(got[1].item() / 1.1283791670955126e300 - 1) < 1e-12
    assert_exact(got, want)
    got, want = both(defect_ops, "d_expm1_pow", [-3.0202, 3.0, 100.0], dtype=torch.float32)
    assert torch.isfinite(got[1][:2]).all() and got[1][2].item() == math.inf
    assert_exact(got, want, rtol=1e-5)
    got, want = both(defect_ops, "d_pow_exp", [0.0, 2.0], [-1000.0, 0.5])
    assert got[0][0].item() == 1.0 and got[1][0].item() == 0.0 and got[2][0].item() == 0.0
    assert_exact(got, want)


def test_relu_of_nan_and_rsqrt_of_negative_zero(defect_ops):
    got, want = both(defect_ops, "d_relu", [math.nan, -0.0, 0.0, -1.0, 2.0])
    assert math.isnan(got[0][0].item()) and got[1][0].item() == 1.0
    assert_exact(got, want)
    got, want = both(defect_ops, "d_rsqrt", [-0.0, 0.0, 4.0])
    assert got[1][0].item() == math.inf
    assert_exact(got, want)


def test_no_algebra_on_the_users_expression(defect_ops):
    got, want = both(defect_ops, "d_mul_zero", [math.inf, math.nan, 2.0, -2.0])
    assert math.isnan(got[0][0].item()) and math.isnan(got[0][1].item())
    assert_exact(got, want)
    got, want = both(defect_ops, "d_max_zero_pow", [-1.0, 1.0])
    assert got[0][0].item() == -math.inf
    assert_exact(got, want)
    got, want = both(defect_ops, "d_log_zoo", [1.0, math.inf])
    assert got[0][0].item() == -math.inf
    assert_exact(got, want)
    got, want = both(defect_ops, "d_exp_log", [-1.0, 2.0], [math.inf, 1.0])
    assert math.isnan(got[0][0].item())
    assert_exact(got, want)

"""Differentiation and the OpSpec: PyTorch's gradient conventions at kinks (fused op vs
eager autograd at the exact kink points), passthrough detection, and cse."""

from __future__ import annotations

import json
import math

import pytest
import sympy
import torch

from corpus import BY_NAME
from fusegen.errors import FusegenError, SpecError
from fusegen.parse import parse, symbol
from fusegen.printer import print_program
from fusegen.spec import default_name, differentiate


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
    assert [g.expr for g in spec.gradients] == [symbol("b"), symbol("a"), sympy.Integer(1)]
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
    assert spec.gradients[1].expr == -2


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
    printed = print_program(bwd, "float", scale="grad")
    code = "\n".join(c for _, _, c in printed.temps) + "\n" + printed.results[0][1]
    assert code.count("fusegen::sigmoid(") == 1
    assert code.count("expf") == 0  # no re-derived exponentials


def test_cse_temporaries_are_numbered_per_program():
    spec = differentiate(parse("exp(x)*sin(y) + exp(x)"), name="spec_cse")
    for program in (spec.forward_program, spec.backward_program):
        assert [s.name for s, _ in program.temps] == [f"t{i}" for i in range(len(program.temps))]


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
    assert spec.summary() == ["d/da = grad * (b)", "d/db = grad * (a)", "d/dc = grad"]


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


@pytest.mark.parametrize("expr", ["log(0*x)", "x + 1/(0*x)"])
def test_unprintable_constant_is_a_spec_error(expr):
    with pytest.raises(FusegenError, match="no finite value|outside|zoo"):
        differentiate(parse(expr), name="spec_bad")

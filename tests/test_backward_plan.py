"""What the backward reads and writes (spec._plan): identical gradients computed
and written once, gradients of dout alone as eager ops with no kernel, the forward's output
saved instead of inputs when that moves fewer bytes, and autograd's in-place check on it."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from fusegen.ir import primitives as fn
from fusegen.frontend.parse import parse
from fusegen.ir.expr import symbol
from fusegen.ir.spec import GRAD, differentiate

from helpers import TOL


# -- the spec -----------------------------------------------------------------------------

def test_identical_gradients_share_one_kernel_output():
    spec = differentiate(parse("(x+y)*w"), name="plan_addmul")
    assert [g.output for g in spec.gradients] == [0, 0, 1]
    assert [g.input for g in spec.kernel_gradients] == ["x", "w"]
    assert [n for n, _ in spec.backward_program.results] == ["grad_x", "grad_w"]
    doc = json.loads(spec.to_json("h"))
    assert doc["kernel_outputs"] == {"grad_x": ["x", "y"], "grad_w": ["w"]}


def test_relu_of_a_sum_reads_only_its_output():
    spec = differentiate(parse("relu(x+y)"), name="plan_relu")
    assert spec.saved_output == "result" and spec.backward_inputs == ("result",)
    result = symbol("result")
    assert spec.backward_exprs == (fn.Where(fn.LessEqual(result, 0), 0, GRAD),)
    assert [g.output for g in spec.gradients] == [0, 0]
    saved = json.loads(spec.to_json("h"))["saved"]
    assert saved["tensors"] == ["result"] and saved["instead_of"]["tensors"] == ["x", "y"]
    # dout + result read, one gradient written; the inputs would add one read
    assert saved["bytes_per_element"]["float32"] + 4 == saved["instead_of"]["bytes_per_element"]["float32"]
    # the double backward differentiates the backward as it is: in dout and result
    from fusegen.ir.spec import grad2_spec
    assert grad2_spec(spec).inputs == ("dout", "result", "gg_x")


def test_the_output_is_kept_only_when_it_saves_a_read():
    for text in ("sigmoid(x)", "exp(x)", "x*sigmoid(x)", "a*b+c"):
        spec = differentiate(parse(text), name="plan_same")
        assert spec.saved_output is None, text  # one read either way: the inputs, no in-place rule


def test_a_user_input_named_result_keeps_its_name():
    spec = differentiate(parse("relu(result+y)"), name="plan_clash")
    assert spec.saved_output == "result_" and spec.backward_inputs == ("result_",)


def test_kink_table_rewrites_conditions_on_relus_argument():
    # where(x+y > 0, relu(x+y), 0): its gradient tests x+y > 0, the same test as relu(x+y) > 0
    from fusegen.ir.spec import _in_terms_of_output
    a = fn.Plus(symbol("x"), symbol("y"))
    out = symbol("result")
    got = _in_terms_of_output(fn.Relu(a), [fn.Where(fn.Greater(a, 0), GRAD, 0), fn.Where(fn.GreaterEqual(a, 0), GRAD, 0)], out)
    assert got[0] == fn.Where(fn.Greater(out, 0), GRAD, 0)
    assert got[1] == fn.Where(fn.GreaterEqual(a, 0), GRAD, 0)  # not equivalent at a = -1: kept


def test_gradients_of_dout_alone_need_no_kernel():
    spec = differentiate(parse("a - 2*b + c/4"), name="plan_sub")
    assert spec.kernel_gradients == () and spec.backward_inputs == ()
    assert [g.dout_steps for g in spec.gradients] == [(), (("-", 0.0), ("*", 2.0)), (("/", 4.0),)]
    assert json.loads(spec.to_json("h"))["from_dout"] == {"b": "-grad*2", "c": "grad/4"}


def test_a_gradient_of_dout_alone_is_a_kernel_output_when_the_kernel_runs_anyway():
    spec = differentiate(parse("x*y - z/4"), name="plan_mixed")
    assert [g.output for g in spec.gradients] == [0, 1, 2]
    assert spec.gradients[2].dout_steps == (("-", 0.0), ("/", 4.0))
    assert spec.backward_inputs == ("x", "y")


# -- the built ops -------------------------------------------------------------------------

def _grads(f, tensors, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = f(*leaves)
    return out, torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("shapes", [[(64,), (64,)], [(3, 64), (1, 64)]], ids=["same", "broadcast"])
def test_relu_add_gradients_are_eagers_at_kinks(corpus_ops, shapes):
    op = corpus_ops["cp_relu_add"]
    special = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-300, -1e-300, 1.0], dtype=torch.float64)
    x = torch.randn(shapes[0], dtype=torch.float64)
    x.view(-1)[: special.numel()] = special
    y = torch.zeros(shapes[1], dtype=torch.float64)
    y.view(-1)[: special.numel()] = special.flip(0)
    dout = torch.randn(torch.broadcast_shapes(*shapes), dtype=torch.float64)
    out, got = _grads(op, [x, y], dout)
    want_out, want = _grads(lambda a, b: F.relu(a + b), [x, y], dout)
    torch.testing.assert_close(out, want_out, equal_nan=True, rtol=0, atol=0)
    for g, w, t in zip(got, want, (x, y)):
        assert g.shape == t.shape
        torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["fusedop", "torch.ops"])
def test_saved_output_modified_in_place_raises_like_eager(corpus_ops, path):
    op = corpus_ops["cp_relu_add"]
    f = op if path == "fusedop" else op.op
    x, y = (torch.randn(16, requires_grad=True) for _ in range(2))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        F.relu(x + y).add_(1).sum().backward()  # eager's relu
    out = f(x, y)
    out.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_an_op_that_saves_no_output_allows_it(corpus_ops):
    x, y, w = (torch.randn(16, requires_grad=True) for _ in range(3))
    out = corpus_ops["cp_add_mul"](x, y, w)
    out.add_(1)
    out.sum().backward()
    torch.testing.assert_close(x.grad, w.detach())


def test_relu_add_under_torch_func_saves_the_output_too(corpus_ops):
    op = corpus_ops["cp_relu_add"]
    x, y = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    gx, gy = torch.func.grad(lambda a, b: op(a, b).sum(), argnums=(0, 1))(x, y)
    want = (x + y > 0).double()
    torch.testing.assert_close(gx, want, **TOL[torch.float64])
    torch.testing.assert_close(gy, want, **TOL[torch.float64])
    h = torch.func.hessian(lambda a: op(a, y[:4]).sum())(x[:4].clone())
    torch.testing.assert_close(h, torch.zeros(4, 4, dtype=torch.float64))


def test_deduped_backward_op_returns_one_tensor_per_distinct_gradient(corpus_ops):
    op = corpus_ops["cp_add_mul"]
    x, y, w, dout = (torch.randn(8) for _ in range(4))
    grads = op.backward_op(dout, x, y, w, [True, True])
    assert len(grads) == 2
    torch.testing.assert_close(grads[0], dout * w)
    torch.testing.assert_close(grads[1], dout * (x + y))
    xs = [t.clone().requires_grad_(True) for t in (x, y, w)]
    gx, gy, gw = torch.autograd.grad(op(*xs), xs, dout)
    torch.testing.assert_close(gx, gy, rtol=0, atol=0)


def _backward_ops_run(f):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        f()
    return [e.name for e in prof.events() if e.name.startswith("fusegen::") and e.name.endswith("_backward")]


def test_gradients_of_dout_alone_run_as_eager_ops(corpus_ops):
    op = corpus_ops["cp_sub_scaled"]
    assert op.backward_op is None
    a, b, c = (torch.randn(3, 5, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(op, (a, b, c)) and torch.autograd.gradgradcheck(op, (a, b, c))
    dout = torch.randn(3, 5, dtype=torch.float64)
    ga, gb, gc = torch.autograd.grad(op(a, b, c), (a, b, c), dout)
    assert torch.equal(ga, dout) and torch.equal(gb, -dout * 2) and torch.equal(gc, dout / 4)


def test_only_a_dout_gradient_requested_skips_the_kernel(corpus_ops):
    op = corpus_ops["cp_mul_sub"]
    x, y = torch.randn(64), torch.randn(64)
    z = torch.randn(64, requires_grad=True)
    dout = torch.randn(64)
    ran = _backward_ops_run(lambda: torch.autograd.grad(op(x, y, z), z, dout))
    assert ran == []  # -dout/4 from dout alone: the kernel would read x and y for nothing
    (gz,) = torch.autograd.grad(op(x, y, z), z, dout)
    assert torch.equal(gz, -dout / 4)
    xs = [t.detach().clone().requires_grad_(True) for t in (x, y, z)]
    ran = _backward_ops_run(lambda: torch.autograd.grad(op(*xs), xs, dout))
    assert ran == ["fusegen::cp_mul_sub_backward"]  # one kernel writes all three
    gx, gy, gz = torch.autograd.grad(op(*xs), xs, dout)
    torch.testing.assert_close(gz, -dout / 4, rtol=0, atol=0)

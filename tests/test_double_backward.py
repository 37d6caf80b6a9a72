"""Double backward is fused and never silently wrong: through a FusedOp (any order) and
through torch.ops.fusegen.<name> directly (the shared runtime's C++ autograd kernel: first
and second order fused, third order an error that names the op)."""

from __future__ import annotations

import pytest
import torch

from corpus import BY_NAME


@pytest.mark.parametrize("name", ["cp_silu", "cp_fma", "cp_swish_beta"])
def test_second_derivative_matches_eager(corpus_ops, name):
    op = corpus_ops[name]
    results = []
    for f in (op, BY_NAME[name].eager):
        g = torch.Generator().manual_seed(0)
        tensors = [torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True) for _ in op.spec.inputs]
        scalars = [0.5] * len(op.spec.scalars)
        grads = torch.autograd.grad(f(*tensors, *scalars).sum(), tensors, create_graph=True)
        differentiable = [gr for gr in grads if gr.requires_grad]
        assert differentiable, "a gradient that depends on the inputs must carry a graph"
        results.append(torch.autograd.grad(sum(gr.pow(2).sum() for gr in differentiable), tensors,
                                           allow_unused=True, materialize_grads=True))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["cp_silu", "cp_bias_gelu", "cp_swish_beta", "cp_clamp_tensor"])
def test_gradgradcheck_through_torch_ops(corpus_ops, name):
    """torch.ops.fusegen.<name> called directly: the C++ autograd kernel's double backward
    calls <name>_grad2_backward (broadcast inputs, scalars, several gradients)."""
    case = BY_NAME[name]
    tensors = [t.requires_grad_() for t in case.sample(5, seed=2)]
    op = getattr(torch.ops.fusegen, name)
    assert torch.autograd.gradgradcheck(lambda *t: op(*t, *case.scalar_values), tuple(tensors), eps=1e-6, atol=1e-5)


def test_third_order_through_torch_ops_fails_loudly(corpus_ops):
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    g, = torch.autograd.grad(torch.ops.fusegen.cp_silu(x).sum(), x, create_graph=True)
    gg, = torch.autograd.grad(g.sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="fusegen::cp_silu_grad2: the derivative of its backward"):
        torch.autograd.grad(gg.sum(), x)
    # The FusedOp computes it (eager composite beyond second order).
    g, = torch.autograd.grad(corpus_ops["cp_silu"](x).sum(), x, create_graph=True)
    gg, = torch.autograd.grad(g.sum(), x, create_graph=True)
    ggg, = torch.autograd.grad(gg.sum(), x)
    xe = x.detach().requires_grad_()
    ge, = torch.autograd.grad((xe * torch.sigmoid(xe)).sum(), xe, create_graph=True)
    gge, = torch.autograd.grad(ge.sum(), xe, create_graph=True)
    ggge, = torch.autograd.grad(gge.sum(), xe)
    torch.testing.assert_close(ggg, ggge)


def test_passthrough_gradients_differentiate_exactly(corpus_ops):
    """d/da (a + b) = 1 passes dout through: its second derivative is exact (zero)."""
    a = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(4, dtype=torch.float64, requires_grad=True)
    ga, gb = torch.autograd.grad(corpus_ops["cp_add"](a, b), (a, b), dout, create_graph=True)
    (gg,) = torch.autograd.grad(ga.sum(), dout)
    torch.testing.assert_close(gg, torch.ones_like(dout))

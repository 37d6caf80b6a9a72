"""Double backward is never silently wrong: until second derivatives are fused, asking
autograd to differentiate an op's backward raises an error that names the op, while
create_graph=True first-order gradients stay right."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("name", ["cp_silu", "cp_fma", "cp_swish_beta"])
def test_second_derivative_raises_and_names_the_op(corpus_ops, name):
    op = corpus_ops[name]
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True) for _ in op.spec.inputs]
    scalars = [0.5] * len(op.spec.scalars)
    out = op(*tensors, *scalars)
    grads = torch.autograd.grad(out.sum(), tensors, create_graph=True)
    # First order with create_graph=True is still right.
    from corpus import BY_NAME
    want = torch.autograd.grad(BY_NAME[name].eager(*tensors, *scalars).sum(), tensors)
    for got, w in zip(grads, want):
        torch.testing.assert_close(got.detach(), w)
    differentiable = [gr for gr in grads if gr.requires_grad]
    assert differentiable, "a gradient that depends on the inputs must carry a graph"
    with pytest.raises(NotImplementedError, match=f"fusegen::{name}: the derivative of its backward"):
        torch.autograd.grad(sum(gr.sum() for gr in differentiable), tensors, allow_unused=True)


def test_gradgradcheck_fails_loudly_not_wrongly(corpus_ops):
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="cp_silu"):
        torch.autograd.gradgradcheck(corpus_ops["cp_silu"], (x,))


def test_passthrough_gradients_differentiate_exactly(corpus_ops):
    """d/da (a + b) = 1 passes dout through: its second derivative is exact (zero)."""
    a = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(4, dtype=torch.float64, requires_grad=True)
    ga, gb = torch.autograd.grad(corpus_ops["cp_add"](a, b), (a, b), dout, create_graph=True)
    (gg,) = torch.autograd.grad(ga.sum(), dout)
    torch.testing.assert_close(gg, torch.ones_like(dout))

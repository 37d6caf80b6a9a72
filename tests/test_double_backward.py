"""Double backward is fused and never silently wrong: through a FusedOp and through
torch.ops.fusegen.<name> directly (the shared runtime's C++ autograd kernel), first and
second order fused, any order beyond by the eager composite."""

from __future__ import annotations

import logging

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


@pytest.mark.parametrize("call", ["torch.ops", "FusedOp"])
def test_third_order_matches_eager(corpus_ops, call, caplog):
    """Beyond second order the composite takes over, on both paths, and says so in the log."""
    caplog.set_level(logging.INFO, logger="fusegen")
    from fusegen.pytorch import autograd
    derived = autograd._info("cp_silu_grad2_backward")._derived  # derived on first need
    for key in [k for k in derived if k.startswith("logged")]:
        del derived[key]  # logged once per process: forget it
    f = corpus_ops["cp_silu"] if call == "FusedOp" else torch.ops.fusegen.cp_silu
    results = []
    for fn in (f, lambda t: t * torch.sigmoid(t)):
        x = torch.linspace(-3, 3, 7, dtype=torch.float64, requires_grad=True)
        g, = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
        gg, = torch.autograd.grad(g.sum(), x, create_graph=True)
        ggg, = torch.autograd.grad(gg.sum(), x, create_graph=True)
        results.append((g, gg, ggg, torch.autograd.grad(ggg.sum(), x)[0]))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
    assert any("fusegen::cp_silu_grad2_backward" in r.getMessage() and "not fused" in r.getMessage()
               for r in caplog.records)


def test_passthrough_gradients_differentiate_exactly(corpus_ops):
    """d/da (a + b) = 1 passes dout through: its second derivative is exact (zero)."""
    a = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(4, dtype=torch.float64, requires_grad=True)
    ga, gb = torch.autograd.grad(corpus_ops["cp_add"](a, b), (a, b), dout, create_graph=True)
    (gg,) = torch.autograd.grad(ga.sum(), dout)
    torch.testing.assert_close(gg, torch.ones_like(dout))

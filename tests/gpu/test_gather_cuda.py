"""On a GPU: the cross-entropy of each row (`x.gather(-1, label)`), with and without
ignore_index, through both shapes of the row kernel (a warp per row up to 1024 elements, a
block beyond) and the vocabularies of Llama 2 and 3 (32000, 128256: bfloat16 cannot hold
their indices, the kernel compares them in float), every dtype, against F.cross_entropy in
float64 on the same values, the loss and the logits' gradient; the same bits on two runs;
under CUDA graph capture; an index outside its row is NaN in that row only; the backward
from the saved logsumexp gives the bits of the one that computes it again.

    PYTHONPATH=. python -m pytest -q -m cuda tests/gpu/test_gather_cuda.py
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import fusegen

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CROSS_ENTROPY = "torch.logsumexp(x, -1, keepdim=True) - x.gather(-1, label)"
IGNORING = ("torch.where(label == -100, 0, torch.logsumexp(x, -1, keepdim=True) - "
            "x.gather(-1, torch.clamp(label, min=0)))")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# atol/rtol on the loss (one rounding to the storage type of a value near log(vocab)) and on
# the gradient (softmax terms, a share of its largest magnitude)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
LENGTHS = [7, 1000, 1025, 32000, 128256]
ROWS = 37


@functools.cache
def ops():
    plain, ignoring = fusegen.fuse_many([
        {"expr": CROSS_ENTROPY, "name": "cuda_gather_ce", "inputs": "x,label"},
        {"expr": IGNORING, "name": "cuda_gather_ce_ignore", "inputs": "x,label"}])
    return {"plain": plain, "ignoring": ignoring}


def _case(n, dtype, seed=0, ignore=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(ROWS, n, generator=g, device="cuda") * 2).to(dtype).requires_grad_()
    label = torch.randint(0, n, (ROWS, 1), generator=g, device="cuda")
    if ignore:
        label[::5] = -100
    return x, label


@pytest.mark.parametrize("which", ["plain", "ignoring"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
def test_matches_float64_cross_entropy(which, dtype, n):
    op = ops()[which]
    x, label = _case(n, dtype, ignore=which == "ignoring")
    loss = op(x, label)
    dout = torch.randn(ROWS, 1, device="cuda").to(dtype)
    (grad,) = torch.autograd.grad(loss, x, dout)
    x64 = x.detach().double().requires_grad_()
    want = F.cross_entropy(x64, label[:, 0], reduction="none", ignore_index=-100)[:, None]
    (want_grad,) = torch.autograd.grad(want, x64, dout.double())
    tol = TOL[dtype]
    torch.testing.assert_close(loss.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    torch.testing.assert_close(grad.double(), want_grad, rtol=tol, atol=tol * float(want_grad.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1000, 128256])
def test_two_runs_give_the_same_bits(dtype, n):
    op = ops()["plain"]
    x, label = _case(n, dtype, seed=3)
    first = [op(x, label), *torch.autograd.grad(op(x, label).sum(), x)]
    again = [op(x, label), *torch.autograd.grad(op(x, label).sum(), x)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_an_index_outside_its_row_is_nan_in_that_row_only():
    op = ops()["plain"]
    x, label = _case(1000, torch.float32, seed=4)
    label[2], label[9] = 1000, -1
    loss = op(x, label).detach()
    assert loss[2].isnan() and loss[9].isnan() and loss.isnan().sum() == 2


def test_cuda_graph_capture():
    op = ops()["plain"]
    x, label = _case(32000, torch.bfloat16, seed=5)
    x = x.detach()
    op(x, label)  # builds and loads before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, label)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, op(x, label), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
def test_the_saved_logsumexp_gives_the_bits_of_computing_it_again(dtype, n):
    """The forward saves each row's logsumexp and label count (docs/rows.md): the backward
    autograd calls directly reads them, the one through <name>_backward (create_graph)
    computes them again, with the same bits."""
    op = ops()["plain"]
    assert op.spec.saved_rows and op.spec.saved_backward_rows.levels == 0
    x, label = _case(n, dtype, seed=3)
    g = torch.randn(ROWS, 1, device="cuda").to(dtype)
    (saved,) = torch.autograd.grad(op(x, label), x, g)
    (again,) = torch.autograd.grad(op(x, label), x, g, create_graph=True)
    assert torch.equal(saved, again.detach())

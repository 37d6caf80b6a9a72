"""Every corpus op against its hand-written eager oracle, forward and backward, over
sizes, views, dtypes and broadcasting: values, shapes and dtypes (strides and memory
formats are test_layouts.py's)."""

from __future__ import annotations

import pytest
import torch

from corpus import CORPUS, Case
from helpers import assert_no_worse_than_eager, compare, forward_backward

SIZES = [0, 1, 3, 4096, 4097]
NON_BROADCAST = [c for c in CORPUS if not c.broadcast]

MULTI_INPUT = [c for c in NON_BROADCAST if len(c.domains) >= 2]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("case", CORPUS, ids=repr)
def test_corpus_matches_eager(corpus_ops, case, n, dtype):
    compare(corpus_ops[case.name], case.eager, case.sample(n, dtype, seed=n), dtype, case.scalar_values, what=case.name,
            layout=False)


def _views(case: Case, kind: str, dtype):
    n, m = 37, 5
    if kind == "slice":  # misaligned: the storage offset is one element
        return [t[1:] for t in case.sample(n + 1, dtype)]
    if kind == "transpose":  # 2-D, non-contiguous
        return [t.t() for t in case.sample(0, dtype, shapes=[(n, m)] * len(case.domains))]
    if kind == "expand":  # a stride-0 view of a (1, n) row, against full (m, n) tensors
        ts = case.sample(0, dtype, shapes=[(1, n)] + [(m, n)] * (len(case.domains) - 1))
        return [ts[0].expand(m, n)] + ts[1:]
    raise ValueError(kind)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", ["slice", "transpose", "expand"])
@pytest.mark.parametrize("case", NON_BROADCAST, ids=repr)
def test_views(corpus_ops, case, kind, dtype):
    tensors = _views(case, kind, dtype)
    assert not all(t.is_contiguous() for t in tensors) or kind == "slice"
    compare(corpus_ops[case.name], case.eager, tensors, dtype, case.scalar_values, what=case.name,
            layout=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", [c for c in CORPUS if len(c.domains) >= 2], ids=repr)
def test_broadcast_gradients_sum_back(corpus_ops, case, dtype):
    """A (1, n) row and an (n,) vector against (m, n): the output has the broadcast shape
    and each gradient is summed back to its input's shape, as eager does."""
    n, m = 33, 4
    shapes = [(m, n), (1, n), (n,)][: len(case.domains)][::-1]  # the small ones first, too
    tensors = case.sample(0, dtype, shapes=shapes)
    compare(corpus_ops[case.name], case.eager, tensors, dtype, case.scalar_values, what=case.name,
            layout=False)


def test_broadcast_scalar_shaped_tensor(corpus_ops):
    """A 0-d tensor broadcasts against everything."""
    case = next(c for c in CORPUS if c.name == "cp_fma")
    a, b, c = case.sample(0, torch.float64, shapes=[(), (5, 6), (6,)])
    compare(corpus_ops[case.name], case.eager, [a, b, c], torch.float64, case.scalar_values, what=case.name,
            layout=False)


# -- dtypes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtypes", [
    (torch.float32, torch.float64, torch.float32),
    (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float16, torch.bfloat16, torch.float16),
], ids=["f32+f64", "bf16+f32", "f16+bf16"])
def test_mixed_dtypes_promote_like_eager(corpus_ops, dtypes):
    """Observed and required: the op returns torch.result_type of its inputs (f32 + f64 ->
    f64, bf16 + f16 -> f32), like eager; each gradient comes back in its input's dtype."""
    case = next(c for c in CORPUS if c.name == "cp_fma")
    op = corpus_ops[case.name]
    tensors = [t.to(d) for t, d in zip(case.sample(257, torch.float64), dtypes)]
    got_out, got_grads = forward_backward(op, tensors, [])
    want_out, want_grads = forward_backward(case.eager, tensors, [])
    assert got_out.dtype == want_out.dtype == torch.promote_types(torch.promote_types(*dtypes[:2]), dtypes[2])
    # Eager rounds a*b to the promoted dtype before adding c; fused rounds once at the end.
    tol = dict(rtol=1e-2, atol=1e-2) if got_out.dtype != torch.float64 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_out, want_out, **tol)
    for got, want, t in zip(got_grads, want_grads, tensors):
        assert got.dtype == want.dtype == t.dtype
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", CORPUS, ids=repr)
def test_low_precision_no_worse_than_eager(corpus_ops, case, dtype):
    """Against a float64 reference on the same (rounded) inputs, the fused op's relative
    error is at most 1.5x eager's in the same dtype plus a small floor: it computes in
    float and rounds once, eager rounds after every step."""
    op = corpus_ops[case.name]
    low = case.sample(4099, dtype, seed=3)
    ref = [t.double() for t in low]
    scalars = list(case.scalar_values)
    ref_out, ref_grads = forward_backward(case.eager, ref, scalars, grad_dtype=dtype)
    eager_out, eager_grads = forward_backward(case.eager, low, scalars)
    got_out, got_grads = forward_backward(op, low, scalars)
    assert got_out.dtype == dtype
    pairs = [("forward", got_out, eager_out, ref_out)] + [
        (f"d/d{name}", g, e, r) for name, g, e, r in zip(op.spec.inputs, got_grads, eager_grads, ref_grads)]
    for what, got, eager, ref in pairs:
        assert_no_worse_than_eager(f"{case.name} {what}", got, eager, ref)


# -- only the gradients that are needed -----------------------------------------------------

@pytest.mark.parametrize("case", MULTI_INPUT, ids=repr)
def test_only_needed_gradients(corpus_ops, case):
    op = corpus_ops[case.name]
    tensors = case.sample(65, torch.float64)
    for k in range(len(tensors)):
        requires = [j == k for j in range(len(tensors))]
        leaves = [t.clone().requires_grad_(r) for t, r in zip(tensors, requires)]
        out = op(*leaves, *case.scalar_values)
        out.backward(torch.ones_like(out))
        eager_leaf = tensors[k].clone().requires_grad_(True)
        args = [eager_leaf if j == k else t for j, t in enumerate(tensors)]
        (want,) = torch.autograd.grad(case.eager(*args, *case.scalar_values), eager_leaf,
                                      torch.ones_like(out))
        for j, leaf in enumerate(leaves):
            if j == k:
                torch.testing.assert_close(leaf.grad, want, rtol=1e-10, atol=1e-12)
            else:
                assert leaf.grad is None, f"{case.name}: {op.spec.inputs[j]} got a gradient it did not ask for"


def test_no_input_requires_grad_gives_plain_tensor(corpus_ops):
    op = corpus_ops["cp_silu"]
    x = torch.randn(10, dtype=torch.float64)
    out = op(x)
    assert not out.requires_grad and out.grad_fn is None
    torch.testing.assert_close(out, x * torch.sigmoid(x))


def test_passthrough_gradient_of_fma_is_grad_itself(corpus_ops):
    """d/dc (a*b+c) = 1: grad flows through (no kernel), still summed to c's shape."""
    op = corpus_ops["cp_fma"]
    a, b = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    c = torch.randn(5, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(4, 5, dtype=torch.float64)
    (gc,) = torch.autograd.grad(op(a, b, c), c, grad)
    torch.testing.assert_close(gc, grad.sum(0), rtol=0, atol=1e-14)


def test_scalar_values_change_result(corpus_ops):
    op = corpus_ops["cp_swish_beta"]
    x, y = torch.randn(100, dtype=torch.float64), torch.randn(100, dtype=torch.float64)
    for beta, alpha in [(1.0, 0.0), (-2.5, 3.0), (0.0, 1.0)]:
        torch.testing.assert_close(op(x, y, beta, alpha), x * torch.sigmoid(beta * x) + alpha * y)
        torch.testing.assert_close(op(x, y, alpha=alpha, beta=beta), x * torch.sigmoid(beta * x) + alpha * y)

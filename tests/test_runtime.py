"""The shared runtime's host fp16/bf16 conversions (fusegen-runtime.h) round exactly as
c10::Half and c10::BFloat16 do: an op computes in float and stores, so `a + b` in fp16 or
bf16 must equal eager's `(a.float() + b.float()).to(dtype)` bit for bit, ties to even,
subnormals, overflow to inf and NaN included. And how the runtime's backward reaches its
kernel: directly, or through the dispatcher where a mode could see the call."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_bf16_rounding_matches_c10(corpus_ops, dtype):
    g = torch.Generator().manual_seed(5)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 6e-8, 3e-5,
                            65504.0, 65519.0, 65520.0, 70000.0, 3e38, -1e-45, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11])
    # Random float32 values: their sums land between representable fp16/bf16 values.
    a = torch.cat([torch.randn(1 << 16, generator=g) * 100, special]).to(dtype)
    b = torch.cat([torch.randn(1 << 16, generator=g) * 1e-3, torch.zeros_like(special)]).to(dtype)
    # a + b in float, then one rounding: compare with a float32 `a + b` rounded by c10.
    got = corpus_ops["cp_add"](a, b)
    want = (a.float() + b.float()).to(dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_every_dtype_pair_promotes_like_eager(corpus_ops):
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    for da in dtypes:
        for db in dtypes:
            a, b = torch.randn(5, dtype=da), torch.randn(5, dtype=db)
            out = corpus_ops["cp_add"](a, b)
            assert out.dtype == torch.result_type(a, b), (da, db)


def _fma_leaves():
    return [torch.randn(64, 8, requires_grad=True) for _ in range(3)]


def _check_fma_grads(grads, leaves):
    a, b, c = (t.detach() for t in leaves)
    for got, want in zip(grads, [b, a, torch.ones_like(c)]):
        torch.testing.assert_close(got, want)


def test_backward_under_a_dispatch_mode_goes_through_the_dispatcher(corpus_ops):
    """The backward runs its kernel directly only where nothing could see the difference:
    under a TorchDispatchMode (FakeTensorMode, a user's mode) it calls
    fusegen::<name>_backward as an op, which the mode sees, with the same gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    leaves = _fma_leaves()
    out = corpus_ops["cp_fma"].op(*leaves)
    with Seen():
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert "fusegen.cp_fma_backward.default" in seen, seen
    _check_fma_grads(grads, leaves)


def test_direct_backward_keeps_the_profiler_event(corpus_ops):
    """Without a mode the backward runs its kernel directly; the profiler still names the op."""
    leaves = _fma_leaves()
    out = corpus_ops["cp_fma"].op(*leaves)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert "fusegen::cp_fma_backward" in {e.name for e in prof.events()}
    _check_fma_grads(grads, leaves)

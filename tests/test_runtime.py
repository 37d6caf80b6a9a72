"""The shared runtime's host fp16/bf16 conversions (fusegen-half.h) round exactly as
c10::Half and c10::BFloat16 do: an op computes in float and stores, so `a + b` in fp16 or
bf16 must equal eager's `(a.float() + b.float()).to(dtype)` bit for bit, ties to even,
subnormals, overflow to inf and NaN included, in every layout the CPU loop converts. That a
large call runs on torch's threads. And how the runtime's backward reaches its kernel:
directly, or through the dispatcher where a mode could see the call."""

from __future__ import annotations

import os
import threading
import time

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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_fp16_bf16_value_converts_as_c10_in_every_layout(corpus_ops, dtype):
    """Every bit pattern of the dtype through `a + 0`: the vectorized block conversions
    (F16C/AVX2 where the CPU has them) give c10's scalar results, in a contiguous run whose
    length leaves a scalar tail, a strided one (gathered and converted a block at a time),
    a broadcast one and a transposed one; a NaN is stored as the scalar conversion stores it
    (fp16: 0x7E00 with its sign, bf16: 0x7FC0), whatever its payload."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    a = torch.cat([every, every[:7]])  # 65543 values: the last block ends in a tail of 7
    zero = torch.zeros((), dtype=dtype)
    layouts = {
        "contiguous": (a, torch.zeros_like(a)),
        "strided": (torch.stack([a, a], 1)[:, 0], torch.zeros_like(a)),
        "broadcast": (a, zero.expand(a.shape)),
        "transposed": (every.view(256, 256).t(), torch.zeros(256, 256, dtype=dtype)),
    }
    canonical = {torch.float16: {0x7E00, -0x200}, torch.bfloat16: {0x7FC0}}[dtype]  # -0x200: 0xFE00
    for layout, (x, y) in layouts.items():
        got = corpus_ops["cp_add"](x, y)
        want = (x.float() + y.float()).to(dtype)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), layout
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), layout
        assert set(got[nan].view(torch.int16).tolist()) <= canonical, layout


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="needs Linux, 2 CPUs")
def test_a_large_contiguous_call_runs_on_every_thread(corpus_ops):
    """A contiguous call of many elements is split over torch's intra-op threads, as
    eager's ops split it: some thread besides the caller's spends CPU time in the calls."""
    def ticks():
        out = {}
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[task] = int(fields[11]) + int(fields[12])  # utime + stime
        return out

    x = torch.randn(1 << 22)
    op = corpus_ops["cp_silu"]
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        op(x)
        me = str(threading.get_native_id())
        before, start = ticks(), time.monotonic()
        while time.monotonic() - start < 20:
            for _ in range(10):
                op(x)
            others = {t: v - before.get(t, 0) for t, v in ticks().items() if t != me}
            if max(others.values(), default=0) >= 5:
                break
        assert max(others.values(), default=0) >= 5, others
    finally:
        torch.set_num_threads(saved)


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

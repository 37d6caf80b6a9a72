"""fusegen's own times on `fusegen bench layouts`' cases (no peers: a few seconds), for
comparing builds of the vector and accumulating kernels' launch shapes: run once per
value of NVCC_APPEND_FLAGS, each with a FUSEGEN_CACHE_DIR of its own (the flags are part
of the cache key; a cache of its own keeps each variant's build cold). Checks values against eager first, and lists each forward's and
backward's kernels with their GPU time, from the profiler.

    NVCC_APPEND_FLAGS=-DFUSEGEN_VECTOR_UNROLL=1 FUSEGEN_CACHE_DIR=/tmp/fg-u1 \
        PYTHONPATH=. python3 tests/gpu/vector_probe.py
"""
import os

import torch

from fusegen.api import fuse_many
from fusegen.bench.core import timed_ms
from fusegen.bench.layouts import _layout_cases, _fwd_bwd

N = int(os.environ.get("FUSEGEN_PROBE_N", 1 << 26))
print("flags:", os.environ.get("NVCC_APPEND_FLAGS", "(defaults)"))
ops = dict(zip(["scale_bias", "fma"], fuse_many([dict(expr="x*scale+bias", name="bench_scale_bias"),
                                                 dict(expr="a*b+c", name="bench_fma")])))
for dtype in (torch.float32, torch.bfloat16):
    for case, (key, make, eager) in _layout_cases(N, "cuda", dtype).items():
        xs = make()
        xg = [x.detach().requires_grad_(True) for x in xs]
        g = torch.randn_like(eager(*xs))
        op = ops[key].op
        got = torch.autograd.grad(op(*xg), xg, g)
        want = torch.autograd.grad(eager(*xg), xg, g)
        tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(op(*xs), eager(*xs), **tol)
        for a, b in zip(got, want):  # the gradients of broadcast inputs are sums: relative to their size
            torch.testing.assert_close(a / b.abs().max(), b / b.abs().max(), **tol)
        fwd = timed_ms(lambda: op(*xs), 15, "cuda")
        fb = timed_ms(_fwd_bwd(op, xg, g), 15, "cuda")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            _fwd_bwd(op, xg, g)()
            torch.cuda.synchronize()
        kernels = [f"{e.name.split('<')[0].split('::')[-1]} {e.time_range.elapsed_us():.0f}"
                   for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"{case:36s} {str(dtype)[6:]:9s} fwd {fwd:.3f} fwd+bwd {fb:.3f} ms | {', '.join(kernels)}", flush=True)

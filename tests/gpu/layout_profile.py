"""Where the time of `fusegen bench layouts`' forward+backward goes: the CUDA kernels of one
training step (forward, torch.autograd.grad) of fusegen and torch.compile for the
per-channel and transposed cases, from torch.profiler, total µs per kernel name.

    PYTHONPATH=. python3 tests/gpu/layout_profile.py
"""
import torch

from fusegen.bench.layouts import _layout_cases
from fusegen.api import fuse_many

N = 1 << 26
ops = dict(zip(["scale_bias", "fma"], fuse_many([dict(expr="x*scale+bias", name="bench_scale_bias"),
                                                 dict(expr="a*b+c", name="bench_fma")])))
for dtype in (torch.float32, torch.bfloat16):
    for case, (key, make, eager) in _layout_cases(N, "cuda", dtype).items():
        if "sliced" in case:
            continue
        xs = [x.detach().requires_grad_(True) for x in make()]
        g = torch.randn_like(eager(*xs))
        for impl, fn in {"fusegen": ops[key].op, "compile": torch.compile(eager, dynamic=False)}.items():
            step = lambda: torch.autograd.grad(fn(*xs), xs, g)  # noqa: E731
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            totals = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us() / 5
            print(f"\n{case}, {str(dtype)[6:]}, {impl}: {sum(totals.values()):.1f} us of kernels per step")
            for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:8]:
                print(f"  {us:8.1f} us  {name[:150]}")

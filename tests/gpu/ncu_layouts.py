"""The kernels of `fusegen bench layouts`' cases that are slower than torch.compile's, one
launch each, for Nsight Compute: everything is built and warmed up first, and only the
calls between torch.cuda.profiler.start() and stop() are profiled.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
        python3 tests/gpu/ncu_layouts.py [case substring ...]

Each case runs fusegen's forward, fusegen's forward+backward and torch.compile's forward,
in bf16 (the dtype of the rows behind compile) unless FUSEGEN_NCU_DTYPE names another.
"""
import os
import sys

import torch

from fusegen.api import fuse_many
from fusegen.bench_layouts import _layout_cases

N = 1 << 26
dtype = getattr(torch, os.environ.get("FUSEGEN_NCU_DTYPE", "bfloat16"))
wanted = sys.argv[1:]
ops = dict(zip(["scale_bias", "fma"], fuse_many([dict(expr="x*scale+bias", name="bench_scale_bias"),
                                                 dict(expr="a*b+c", name="bench_fma")])))
steps = []
for case, (key, make, eager) in _layout_cases(N, "cuda", dtype).items():
    if wanted and not any(w in case for w in wanted):
        continue
    xs = [x.detach().requires_grad_(True) for x in make()]
    g = torch.randn_like(eager(*xs))
    compiled = torch.compile(eager, dynamic=False)
    steps += [(case, "fusegen fwd", lambda op=ops[key].op, xs=xs: op(*xs)),
              (case, "fusegen fwd+bwd", lambda op=ops[key].op, xs=xs, g=g: torch.autograd.grad(op(*xs), xs, g)),
              (case, "compile fwd", lambda f=compiled, xs=xs: f(*xs))]
for _ in range(3):
    for _, _, step in steps:
        step()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for case, what, step in steps:
    print(f"profiling: {case}, {what}", flush=True)
    step()
    torch.cuda.synchronize()
torch.cuda.profiler.stop()

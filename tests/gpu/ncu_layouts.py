"""The kernels of `fusegen bench layouts`' cases, one launch each, for Nsight Compute:
everything is built and warmed up first, and only the calls between
torch.cuda.profiler.start() and stop() are profiled.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
        python3 tests/gpu/ncu_layouts.py [--dtypes bfloat16] [--steps fwd,fwd+bwd,compile] [case substring ...]

Each case runs, per dtype, the steps asked for: fusegen's forward (`fwd`), fusegen's
forward+backward (`fwd+bwd`) and torch.compile's forward (`compile`). The tiled kernel's
fp32 against bf16 (docs/figures/h200/ncu_tiles.log): `--dtypes float32,bfloat16
--steps fwd transposed`.
"""
import argparse

import torch

from fusegen.api import fuse_many
from fusegen.bench.layouts import _layout_cases

parser = argparse.ArgumentParser()
parser.add_argument("cases", nargs="*", help="substrings of the case names (all cases if none)")
parser.add_argument("--dtypes", default="bfloat16", help="the dtypes of the rows behind compile, by default")
parser.add_argument("--steps", default="fwd,fwd+bwd,compile")
args = parser.parse_args()
steps_wanted = args.steps.split(",")
ops = dict(zip(["scale_bias", "fma"], fuse_many([dict(expr="x*scale+bias", name="bench_scale_bias"),
                                                 dict(expr="a*b+c", name="bench_fma")])))
steps = []
for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
    for case, (key, make, eager) in _layout_cases(1 << 26, "cuda", dtype).items():
        if args.cases and not any(w in case for w in args.cases):
            continue
        xs = [x.detach().requires_grad_(True) for x in make()]
        g = torch.randn_like(eager(*xs))
        op = ops[key].op
        calls = {"fwd": lambda op=op, xs=xs: op(*xs),
                 "fwd+bwd": lambda op=op, xs=xs, g=g: torch.autograd.grad(op(*xs), xs, g)}
        if "compile" in steps_wanted:
            calls["compile"] = lambda f=torch.compile(eager, dynamic=False), xs=xs: f(*xs)
        steps += [(f"{case}, {str(dtype)[6:]}", what, calls[what]) for what in steps_wanted]
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

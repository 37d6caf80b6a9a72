"""The kernels of `fusegen bench dropout`'s step, one launch each, for Nsight Compute:
bias-dropout-add and the same op without the draws, forward and backward, built and warmed
up first; only the calls between torch.cuda.profiler.start() and stop() are profiled.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
        python3 tests/gpu/ncu_dropout.py [--shape 16384x4096] [--dtypes bfloat16,float32]
"""
import argparse

import torch

from fusegen.bench.dropout import _implementations, _step

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="16384x4096")
parser.add_argument("--dtypes", default="bfloat16,float32")
parser.add_argument("--p", type=float, default=0.1)
args = parser.parse_args()
tokens, hidden = (int(d) for d in args.shape.split("x"))
impls = _implementations(args.p)
steps = []
for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    for name in ("fusegen", "fusegen, no draws"):
        steps.append((f"{name}, {str(dtype)[6:]}", lambda f=_step(impls[name]), t=(x, b, r, g): f(*t)))
for _ in range(3):
    for _, step in steps:
        step()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for what, step in steps:
    print(f"profiling: {what}", flush=True)
    step()
    torch.cuda.synchronize()
torch.cuda.profiler.stop()

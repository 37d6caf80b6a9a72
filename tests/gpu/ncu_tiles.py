"""The tiled kernel's forward on `fusegen bench layouts`' transposed case, fp32 and bf16,
one launch each, for Nsight Compute (built and warmed up first; only the calls between
torch.cuda.profiler.start() and stop() are profiled):

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section InstructionStats python3 tests/gpu/ncu_tiles.py
"""
import torch

from fusegen.api import fuse_many
from fusegen.bench_layouts import _layout_cases

(fma,) = fuse_many([dict(expr="a*b+c", name="bench_fma")])
calls = []
for dtype in (torch.float32, torch.bfloat16):
    _, make, _ = _layout_cases(1 << 26, "cuda", dtype)["a*b+c, a transposed"]
    xs = make()
    calls.append((dtype, xs))
    fma.op(*xs)
torch.cuda.synchronize()
torch.cuda.profiler.start()
for dtype, xs in calls:
    print("profiling", dtype, flush=True)
    fma.op(*xs)
    torch.cuda.synchronize()
torch.cuda.profiler.stop()

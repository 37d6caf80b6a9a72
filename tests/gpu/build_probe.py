"""Where a cold op build's time goes (run on the GPU machine from the repo root, after the
shared runtime is in $FUSEGEN_CACHE_DIR): for each variant, a fresh op (new name, so a cold
build) built in this process, timed by stage (generate: parse, sympy, render; build: ninja;
load), then every ninja edge of its library from .ninja_log (start and end, ms).
Variants alternate, twice each: `split` (each .cu as up to six nvcc units: forward or
backward, fp32/fp64 or fp16/bf16 or fp16 and bf16 apart, the default with cores to spare) and `whole` (one nvcc unit per .cu).

    PYTHONPATH=. python3 tests/gpu/build_probe.py
"""
import time

import torch

from fusegen.build import builder as build
from fusegen.api import Request, _build_and_load, generate

EXPR = "x*sigmoid(x)*alpha + y"
SPLIT, DTYPES, HALVES = build.SPLIT_MACROS, build.DTYPE_MACROS, build.HALF_MACROS
NONE = (("FUSEGEN_NO_SPLIT", "FUSEGEN_NO_SPLIT"),) * 3  # macros no .cu names: no split
build.runtime_library()
for rep in range(2):
    for variant in ("split", "whole"):
        build.SPLIT_MACROS = SPLIT if variant == "split" else ("FUSEGEN_NO_SPLIT", "FUSEGEN_NO_SPLIT")
        build.DTYPE_MACROS = DTYPES if variant == "split" else NONE[:2]
        build.HALF_MACROS = HALVES if variant == "split" else NONE
        name = f"probe_{variant}_{rep}_{time.time_ns() % 10**9}"
        t0 = time.perf_counter()
        g = generate(Request(EXPR, name, None, ("alpha",)))
        t1 = time.perf_counter()
        (op,) = _build_and_load([g])
        t2 = time.perf_counter()
        x = torch.randn(4096, device="cuda", requires_grad=True)
        op(x, x, alpha=0.5).sum().backward()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        print(f"{variant:5} rep {rep}: generate {t1 - t0:.2f} s, build+load {t2 - t1:.2f} s, first call {t3 - t2:.3f} s")
        log = (op.library.path.parent / ".ninja_log").read_text().splitlines()[1:]
        for line in sorted(log, key=lambda l: int(l.split()[0])):
            start, end, _, target, _ = line.split("\t")
            print(f"    {int(start) / 1e3:6.2f} -> {int(end) / 1e3:6.2f} s  {target}")

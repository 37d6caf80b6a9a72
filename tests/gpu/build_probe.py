"""Where a build's time goes (run on the GPU machine from the repo root): the shared
runtime's build in an empty cache (or the one in $FUSEGEN_CACHE_DIR), then a few cold ops
(a new name each, so each is a cold build) built in this process, timed by stage
(generate: parse, sympy, render; build: ninja and link; load), then their first forward and
backward calls; for the runtime and each op, every ninja edge from .ninja_log (start and
end, ms). The route is the default (NVRTC) unless FUSEGEN_CUDA_COMPILER=nvcc.

    PYTHONPATH=. python3 tests/gpu/build_probe.py [REPEATS]
"""
import sys
import time

import torch

from fusegen.api import Request, _build_and_load, generate
from fusegen.build import builder as build

EXPR = "x*sigmoid(x)*alpha + y"


def ninja_edges(folder):
    log = (folder / ".ninja_log").read_text().splitlines()[1:]
    for line in sorted(log, key=lambda l: int(l.split()[0])):
        start, end, _, target, _ = line.split("\t")
        print(f"    {int(start) / 1e3:6.2f} -> {int(end) / 1e3:6.2f} s  {target}")


device = "cuda" if torch.cuda.is_available() else "cpu"
t0 = time.perf_counter()
runtime = build.runtime_library()
print(f"runtime: {time.perf_counter() - t0:.2f} s (cached {runtime.cached})")
if not runtime.cached:
    ninja_edges(runtime.path.parent)
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    name = f"probe_{rep}_{time.time_ns() % 10**9}"
    t0 = time.perf_counter()
    g = generate(Request(EXPR, name, None, ("alpha",)))
    t1 = time.perf_counter()
    (op,) = _build_and_load([g])
    t2 = time.perf_counter()
    x = torch.randn(4096, device=device, requires_grad=True)
    out = op(x, x, alpha=0.5)
    torch.cuda.synchronize() if device == "cuda" else None
    t3 = time.perf_counter()
    out.sum().backward()
    torch.cuda.synchronize() if device == "cuda" else None
    t4 = time.perf_counter()
    print(f"op {rep}: generate {t1 - t0:.3f} s, build+load {t2 - t1:.3f} s, first forward {t3 - t2:.3f} s, "
          f"first backward {t4 - t3:.3f} s")
    ninja_edges(op.library.path.parent)

"""Where a cached load's time goes in a new process, as `fusegen bench build` measures it
(torch imported and the CUDA context made before the clock; Python's bytecode cache on):
builds the op once, then in fresh processes times `fusegen.fuse` of it and prints a
cProfile of one, by own time.  python3 tests/gpu/load_probe.py [EXPR NAME SCALAR...]"""
import os
import subprocess
import sys

args = sys.argv[1:] or ["x*sigmoid(x)*alpha + y", "probe_load", "alpha"]
CODE = r"""
import cProfile, pstats, sys, time
import torch
if torch.cuda.is_available():
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
expr, name, *scalars = sys.argv[1:]
prof = cProfile.Profile() if os.environ.get("PROBE_PROFILE") else None
t0 = time.perf_counter()
if prof: prof.enable()
import fusegen
op = fusegen.fuse(expr, name=name, scalars=scalars)
if prof: prof.disable()
print(f"load {1e3 * (time.perf_counter() - t0):.1f} ms, cached {op.library.cached}")
if prof: pstats.Stats(prof).sort_stats("tottime").print_stats(25)
"""
env = dict(os.environ)
env.pop("PYTHONDONTWRITEBYTECODE", None)
for run in range(6):
    if run == 5:
        env["PROBE_PROFILE"] = "1"
    subprocess.run([sys.executable, "-c", "import os\n" + CODE, *args], env=env, check=True)

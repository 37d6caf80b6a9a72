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

# The two libraries' own share of a load: each dlopen'ed alone in a fresh process (the
# runtime first, as the op's DT_NEEDED pulls it in), with their sizes and dynamic
# relocations (each symbol relocation is a lookup through every library torch loaded).
DLOPEN = r"""
import ctypes, subprocess, sys, time
import torch
if torch.cuda.is_available():
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()
import fusegen
from fusegen.build import index
for path in sys.argv[1:]:
    t0 = time.perf_counter()
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    ms = 1e3 * (time.perf_counter() - t0)
    relocs = subprocess.run(["readelf", "-r", "-W", path], capture_output=True, text=True).stdout
    symbolic = sum(1 for l in relocs.splitlines() if "R_X86_64_GLOB_DAT" in l or "R_X86_64_64" in l
                   or "R_X86_64_JUMP_SLO" in l)
    relative = relocs.count("R_X86_64_RELATIVE")
    print(f"dlopen {ms:.1f} ms  {path.rsplit('/', 1)[-1]}: {__import__('os').path.getsize(path) >> 10} KiB, "
          f"{symbolic} symbol relocations, {relative} relative")
"""
find = ("import sys, fusegen; op = fusegen.fuse(sys.argv[1], name=sys.argv[2], scalars=sys.argv[3:]); "
        "print(op.library.runtime); print(op.library.path)")
paths = subprocess.run([sys.executable, "-c", find, *args], env=env, check=True, capture_output=True,
                       text=True).stdout.split()
subprocess.run([sys.executable, "-c", DLOPEN, *paths], env=env, check=True)

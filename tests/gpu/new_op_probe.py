"""Where a new op's time goes in a new process, as `fusegen bench build` measures it (torch
imported and the CUDA context made before the clock; the runtime already built): each
stage in order (import fusegen, sympy, the templates, the rest of the pipeline, the host
build and its ninja edges, load and registration, the first forward and backward), then
the op's descriptor unit compiled again by hand with other flags, and a few headers alone,
so that the host compiler's share is seen on this machine.

    PYTHONPATH=. python3 tests/gpu/new_op_probe.py [RUNS]
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import functools, json, os, subprocess, sys, time
import torch
dev = "cuda" if torch.cuda.is_available() else "cpu"
if dev == "cuda":
    torch.zeros(1, device=dev); torch.cuda.synchronize()
marks = []
T0 = time.perf_counter()
def mark(what):
    marks.append((what, time.perf_counter() - T0))
import fusegen, fusegen.api as api
from fusegen.build import builder
mark("import fusegen")
import fusegen.codegen.printer
mark("import sympy (printer)")
from fusegen.codegen import render
env = render._environment()
for template, _ in render.TEMPLATES.values():
    env.get_template(template)
mark("templates compiled")
def timed(module, attr):
    f = getattr(module, attr)
    @functools.wraps(f)
    def g(*a, **k):
        r = f(*a, **k); mark(attr); return r
    setattr(module, attr, g)
for module, attr in [(api, "generate"), (builder, "_host_load"), (api._build, "load"),
                     (api._autograd, "register")]:
    timed(module, attr)
op = fusegen.fuse("x*sigmoid(x)*alpha + y", name="probe_new", scalars=["alpha"])
mark("fuse returned")
x, y = (torch.randn(4096, device=dev, requires_grad=True) for _ in range(2))
out = op(x, y, alpha=0.5)
torch.cuda.synchronize() if dev == "cuda" else None
mark("first forward")
out.sum().backward()
torch.cuda.synchronize() if dev == "cuda" else None
mark("first backward")
print("MARKS " + json.dumps(marks))
print("FOLDER " + str(op.library.path.parent))
"""


def compile_times(folder: Path):
    """The unit's compile by hand: the flags of its ninja file, then other levels, then headers."""
    ninja = (folder / "build.ninja").read_text()
    flags = next(line.split(" = ", 1)[1] for line in ninja.splitlines() if line.startswith("cflags"))
    unit = next(p.name for p in folder.glob("unit*.cpp"))
    work = Path(tempfile.mkdtemp())
    shutil.copytree(folder, work / "u", dirs_exist_ok=True)
    heads = {"empty": "", "cmath": "#include <cmath>\n",
             "fusegen-runtime.h": '#include "fusegen-runtime.h"\n'}
    for name, text in heads.items():
        (work / "u" / f"head_{name}.cpp").write_text(text)
    cases = [("unit, its flags", flags, unit)]
    for level in ("-O0", "-O1"):
        cases.append((f"unit, {level}", flags.replace("-O3", level).replace("-O2", level), unit))
    cases += [(f"header {n}", flags, f"head_{n}.cpp") for n in heads]
    for what, f, source in cases:
        best = min(_time(["c++", *f.split(), "-c", source, "-o", "/dev/null"], work / "u") for _ in range(3))
        print(f"  {what:28s} {best * 1e3:6.0f} ms   ({f})")
    shutil.rmtree(work, ignore_errors=True)


def _time(cmd, cwd):
    import time
    t = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True)
    return time.perf_counter() - t


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    base = Path(tempfile.mkdtemp(prefix="probe-base-"))
    env = dict(os.environ, FUSEGEN_CACHE_DIR=str(base / "cache"), FUSEGEN_QUIET="1",
               FUSEGEN_RUNTIME_DIR=str(base / "none"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-c", "from fusegen.build import builder; builder.runtime_library()"],
                   env=env, check=True)
    runtime = next((base / "cache").glob("runtime-*"))
    folder = None
    for run in range(runs):
        cache = base / f"c{run}"
        cache.mkdir(mode=0o700)
        shutil.copytree(runtime, cache / runtime.name)
        proc = subprocess.run([sys.executable, "-c", CHILD], env=dict(env, FUSEGEN_CACHE_DIR=str(cache)),
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stdout + proc.stderr)
        import json
        lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line[:5] in ("MARKS", "FOLDE"))
        previous = 0.0
        print(f"run {run}:")
        for what, at in json.loads(lines["MARKS"]):
            print(f"  {what:24s} +{(at - previous) * 1e3:6.0f} ms   at {at * 1e3:6.0f} ms")
            previous = at
        folder = Path(lines["FOLDER"])
        log = folder / ".ninja_log"
        if log.exists():
            for line in log.read_text().splitlines()[1:]:
                start, end, _, target, _ = line.split("\t")
                print(f"    ninja {target}: {int(start)} -> {int(end)} ms")
    compile_times(folder)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

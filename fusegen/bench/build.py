"""Build-latency benchmark: `fusegen bench build [--runs N] [--first-runs N] [--json out.json]`.

Four figures, each measured in fresh processes (torch imported before the clock starts, as a
user's program has it), with the median and the spread (min..max) of the runs:

1. a new op to its first result: `import fusegen`, `fusegen.fuse(...)` of an op the cache
   does not hold (the cache holds what any op leaves in it: the shared runtime and the
   compiled templates), then its first forward and backward call (synchronized on a GPU);
2. the first op ever: the same in an empty cache, so the shared runtime (once per
   torch/CUDA/compiler version) is built as well; and with the runtime `fusegen setup`
   built at install time (its time is a figure of its own), where the op alone is built;
3. a cached load in a new process: `import fusegen` and `fusegen.fuse(...)` of the op of 1;
4. torch.compile's first forward+backward call of the same expression, with fresh Inductor
   and Triton caches.

Each is printed with its target and whether it is met: a new op within 1.0 s of its first
result on a GPU (0.15 x torch.compile's first call on a CPU), the first op ever no slower
than torch.compile's first call, a cached load within 20 ms. The load average before and
after the runs says how busy the machine was (a shared machine's figures vary with it).
`--only` picks steps (new,first,setup,load,compile,batch; setup: `fusegen setup`, then the
first op ever with its runtime; batch: the 7 seed ops in one library).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from fusegen.build import cache as _cache
from fusegen.files import write_text

COLD_EXPR = "x*sigmoid(x)*alpha + y"
COLD_EAGER = "lambda x, y: x * torch.sigmoid(x) * 0.5 + y"  # COLD_EXPR with alpha = 0.5
SEEDS = {
    "fma": "a*b+c",
    "addmul": "(x+y)*w",
    "add": "a+b",
    "masked_add": "(x+y)*((x+y)>0)",
    "mul_add_mul": "(a*b)+(a*c)",
    "silu": "x*sigmoid(x)",
    "gelu_tanh": "0.5*x*(1+tanh(0.7978845608*(x+0.044715*x*x*x)))",
}

LOAD_RUNS = 7
STEPS = ("new", "first", "setup", "load", "compile", "batch")
DEFAULT_STEPS = ("new", "first", "setup", "load", "compile")

# Targets: seconds, or a factor of torch.compile's first call.
NEW_OP_CUDA_S = 1.0
NEW_OP_CPU_OF_COMPILE = 0.15
CACHED_LOAD_S = 0.020

# Each step prints one JSON line. CPU seconds: this process plus its finished children.
PRELUDE = textwrap.dedent("""
    import json, os, resource, sys, time
    def cpu():
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
    import torch
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("FUSEGEN_CPU_ONLY") != "1" else "cpu"
    def sync():
        if dev == "cuda": torch.cuda.synchronize()
    if dev == "cuda": torch.zeros(1, device=dev); sync()  # the CUDA context: not the build's
    t0, c0 = time.perf_counter(), cpu()
""")

CODE = {
    # 1 and 2: a new op to its first results.
    "op": """
        import fusegen
        op = fusegen.fuse(EXPR, name="bench_cold", scalars=["alpha"])
        built = time.perf_counter() - t0
        x, y = (torch.randn(4096, device=dev, requires_grad=True) for _ in range(2))
        out = op(x, y, alpha=0.5); sync()
        forward = time.perf_counter() - t0
        out.sum().backward(); sync()
        out = {"wall_s": time.perf_counter() - t0, "cpu_s": cpu() - c0, "fuse_s": built,
               "first_forward_s": forward, "cached": op.library.cached}
    """,
    "load": """
        import fusegen
        t1 = time.perf_counter()
        op = fusegen.fuse(EXPR, name="bench_cold", scalars=["alpha"])
        t2 = time.perf_counter()
        out = {"import_s": t1 - t0, "fuse_s": t2 - t1, "wall_s": t2 - t0, "cpu_s": cpu() - c0,
               "cached": op.library.cached}
    """,
    "compile": """
        fn = torch.compile(EAGER, fullgraph=True)
        x, y = (torch.randn(4096, device=dev, requires_grad=True) for _ in range(2))
        fn(x, y).sum().backward(); sync()
        out = {"wall_s": time.perf_counter() - t0, "cpu_s": cpu() - c0}
    """,
    "batch": """
        import fusegen
        ops = fusegen.fuse_many([{"expr": e, "name": "bench_" + n} for n, e in SEEDS.items()])
        out = {"wall_s": time.perf_counter() - t0, "cpu_s": cpu() - c0, "cached": ops[0].library.cached}
    """,
}


def run_step(code: str, cache: str, inductor: str, runtime_dir: str = "") -> dict:
    source = PRELUDE + f"EXPR = {COLD_EXPR!r}\nSEEDS = {SEEDS!r}\nEAGER = {COLD_EAGER}\n" \
        + textwrap.dedent(CODE[code]) + "\nprint('RESULT ' + json.dumps(out))\n"
    env = dict(os.environ, FUSEGEN_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=inductor,
               TRITON_CACHE_DIR=os.path.join(inductor, "triton"), FUSEGEN_QUIET="1",
               FUSEGEN_RUNTIME_DIR=runtime_dir or os.path.join(cache, "no-installed-runtime"))
    # Python's own bytecode cache on, as on a user's machine (some sandboxes turn it off, and
    # then every process recompiles fusegen's sources: 35 ms of a 60 ms cached load).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"step {code} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(line[len("RESULT "):])


def summary(runs: list[dict], key: str = "wall_s") -> dict:
    values = sorted(r[key] for r in runs)
    return {"median_s": statistics.median(values), "min_s": values[0], "max_s": values[-1],
            "runs": len(values), "values_s": values}


def _seeded_cache(work: Path, runtime: Path | None) -> str:
    """A new cache folder (0700): empty, or, given the runtime's entry, a cache as a user's
    is after a first op: fusegen's (its marker), the runtime and the compiled templates."""
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    if runtime is not None:
        shutil.copytree(runtime, cache / runtime.name)
        templates = runtime.parent / _cache.TEMPLATES
        if templates.is_dir():
            shutil.copytree(templates, cache / _cache.TEMPLATES)
        _cache.mark_root(cache)
    return str(cache)


def _runtime_entry(cache: str) -> Path | None:
    return next(iter(sorted(Path(cache).glob("runtime-*"))), None)


def _device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() and os.environ.get("FUSEGEN_CPU_ONLY") != "1" else "cpu"


def targets(results: dict, device: str) -> list[tuple[str, dict | None, str, float | None]]:
    """(figure, its summary, the target in words, the target in seconds or None)."""
    compile_s = results.get("compile", {}).get("median_s")
    if device == "cuda":
        new_target, new_words = NEW_OP_CUDA_S, f"<= {NEW_OP_CUDA_S:.2f} s"
    else:
        new_target = NEW_OP_CPU_OF_COMPILE * compile_s if compile_s else None
        new_words = f"<= {NEW_OP_CPU_OF_COMPILE} x compile" + (f" = {new_target:.2f} s" if new_target else "")
    return [
        ("new op -> first fwd+bwd result", results.get("new"), new_words, new_target),
        ("first op ever (runtime built too)", results.get("first"), "<= compile"
         + (f" = {compile_s:.2f} s" if compile_s else ""), compile_s),
        ("fusegen setup (runtime, at install)", results.get("setup"), "(once per install)", None),
        ("first op ever after fusegen setup", results.get("installed"), "<= compile"
         + (f" = {compile_s:.2f} s" if compile_s else ""), compile_s),
        ("cached load (new process)", results.get("load"), f"<= {CACHED_LOAD_S * 1e3:.0f} ms", CACHED_LOAD_S),
        ("torch.compile first fwd+bwd call", results.get("compile"), "(reference)", None),
    ]


def _seconds(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def report(results: dict, device: str, load_before: tuple, load_after: tuple) -> list[str]:
    from fusegen.build.toolchain import cuda_compiler
    kernels = f", CUDA kernels by {cuda_compiler()}" if device == "cuda" else ""
    lines = [f"build latency on {device} ({os.cpu_count()} cores{kernels}); load average "
             f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (a busy machine's figures are slower "
             "and spread more)",
             f"{'figure':36s} {'median':>9s} {'spread (min..max)':>21s} {'runs':>4s}  {'target':28s} met"]
    for figure, s, words, target in targets(results, device):
        if s is None:
            continue
        met = "-" if target is None else ("yes" if s["median_s"] <= target else "NO")
        spread = f"{_seconds(s['min_s'])}..{_seconds(s['max_s'])}"
        lines.append(f"{figure:36s} {_seconds(s['median_s']):>9s} {spread:>21s} {s['runs']:>4d}  {words:28s} {met}")
    if "new" in results:
        lines.append(f"  new op: fuse {_seconds(results['new']['fuse_median_s'])}, first forward result "
                     f"{_seconds(results['new']['first_forward_median_s'])} (medians)")
    if "load" in results:
        lines.append(f"  cached load: import fusegen {_seconds(results['load']['import_median_s'])} + fuse "
                     f"{_seconds(results['load']['fuse_median_s'])} (medians)")
    if "batch" in results:
        lines.append(f"7 seed ops in one library: {_seconds(results['batch']['median_s'])}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(prog="fusegen bench build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--runs", type=int, default=3, help="runs of the new op and of torch.compile (default 3)")
    p.add_argument("--first-runs", type=int, default=1,
                   help="runs of the first op ever (each builds the runtime: default 1)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile's first call")
    p.add_argument("--only", help=f"comma-separated steps ({','.join(STEPS)}); default "
                   f"{','.join(DEFAULT_STEPS)}")
    args = p.parse_args(argv)
    steps = [s for s in (args.only.split(",") if args.only else DEFAULT_STEPS) if s in STEPS]
    if args.no_compile:
        steps = [s for s in steps if s != "compile"]
    device = _device()
    work = Path(tempfile.mkdtemp(prefix="fusegen-bench-build-"))
    inductor = lambda: tempfile.mkdtemp(prefix="inductor-", dir=work)  # noqa: E731 (fresh per run)
    load_before = os.getloadavg()
    results: dict = {}
    try:
        # The runtime every later step's cache starts from, built in the first step's cache
        # (the first op ever) or, without that step, once here.
        first_caches = [_seeded_cache(work, None) for _ in range(max(1, args.first_runs))]
        if "first" in steps:
            runs = [run_step("op", c, inductor()) for c in first_caches]
            results["first"] = summary(runs) | {"detail": runs}
        else:
            run_step("load", first_caches[0], inductor())  # builds the runtime (and the op)
        runtime = _runtime_entry(first_caches[0])
        cache = None
        if "new" in steps or "load" in steps:
            runs = []
            for _ in range(max(1, args.runs) if "new" in steps else 1):
                cache = _seeded_cache(work, runtime)
                runs.append(run_step("op", cache, inductor()))
            if "new" in steps:
                results["new"] = summary(runs) | {"detail": runs, "fuse_median_s": summary(runs, "fuse_s")["median_s"],
                                                  "first_forward_median_s": summary(runs, "first_forward_s")["median_s"]}
        if "load" in steps:
            runs = [run_step("load", cache, inductor()) for _ in range(LOAD_RUNS)]
            results["load"] = summary(runs) | {"import_median_s": summary(runs, "import_s")["median_s"],
                                               "fuse_median_s": summary(runs, "fuse_s")["median_s"],
                                               "cached": all(r["cached"] for r in runs)}
        if "setup" in steps:
            installed = str(work / "installed")
            env = dict(os.environ, FUSEGEN_RUNTIME_DIR=installed, FUSEGEN_CACHE_DIR=_seeded_cache(work, None))
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "fusegen", "setup"], capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise SystemExit(f"fusegen setup failed:\n{proc.stdout}\n{proc.stderr}")
            results["setup"] = summary([{"wall_s": time.perf_counter() - start}])
            runs = [run_step("op", _seeded_cache(work, None), inductor(), installed) for _ in range(max(1, args.runs))]
            results["installed"] = summary(runs) | {"detail": runs}
        if "compile" in steps:
            runs = [run_step("compile", _seeded_cache(work, None), inductor()) for _ in range(max(1, args.runs))]
            results["compile"] = summary(runs) | {"detail": runs}
        if "batch" in steps:
            results["batch"] = summary([run_step("batch", _seeded_cache(work, runtime), inductor())])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    for line in report(results, device, load_before, load_after):
        print(line)
    results["meta"] = {"device": device, "cores": os.cpu_count(), "load_before": load_before,
                       "load_after": load_after}
    if args.json:
        write_text(args.json, json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    main()

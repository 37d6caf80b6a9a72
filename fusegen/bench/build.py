"""Build-latency benchmark: `fusegen bench build [--json out.json]`.

Every step runs in a fresh process (torch imported before the clock starts) against a
fresh cache folder, and reports wall seconds and CPU seconds (the process and the compilers
it ran):

1. the shared runtime's one-time build (once per torch/CUDA/compiler version);
2. a cold build of one new op (the cache holds only the runtime), then its first call;
3. a batch build of the 7 seed ops in one library (`fusegen.fuse_many`);
4. a cached load in a new process: `import fusegen` and `fusegen.fuse(...)` of the op of 2
   (the median of LOAD_RUNS processes);
5. torch.compile's first forward+backward call of the same expressions, fresh inductor cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

from fusegen.files import write_text

COLD_EXPR = "x*sigmoid(x)*alpha + y"
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

# Each step prints one JSON line. CPU seconds: this process plus its finished children.
PRELUDE = textwrap.dedent("""
    import json, os, resource, sys, time
    def cpu():
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
    import torch
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("FUSEGEN_CPU_ONLY") != "1" else "cpu"
    t0, c0 = time.perf_counter(), cpu()
""")

STEPS = {
    "runtime": """
        from fusegen.build import builder as build
        lib = build.runtime_library()
        out = {"wall_s": time.perf_counter() - t0, "cpu_s": cpu() - c0, "cached": lib.cached}
    """,
    "cold": """
        import fusegen
        op = fusegen.fuse(EXPR, name="bench_cold", scalars=["alpha"])
        out = {"wall_s": time.perf_counter() - t0, "cpu_s": cpu() - c0, "cached": op.library.cached}
        x, y = (torch.randn(4096, device=dev, requires_grad=True) for _ in range(2))
        t1 = time.perf_counter(); op(x, y, alpha=0.5).sum().backward()
        if dev == "cuda": torch.cuda.synchronize()
        out["first_call_s"] = time.perf_counter() - t1
    """,
    "batch": """
        import fusegen
        ops = fusegen.fuse_many([{"expr": e, "name": "bench_" + n} for n, e in SEEDS.items()])
        out = {"wall_s": time.perf_counter() - t0, "cpu_s": cpu() - c0, "cached": ops[0].library.cached}
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
        F = {  # the same expressions in eager PyTorch (as COLD_EXPR and SEEDS spell them)
            "cold": lambda x, y: x * torch.sigmoid(x) * 0.5 + y,
            "fma": lambda a, b, c: a * b + c,
            "addmul": lambda x, y, w: (x + y) * w,
            "add": lambda a, b: a + b,
            "masked_add": lambda x, y: (x + y) * ((x + y) > 0),
            "mul_add_mul": lambda a, b, c: (a * b) + (a * c),
            "silu": lambda x: x * torch.sigmoid(x),
            "gelu_tanh": lambda x: 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x))),
        }
        out = {}
        for n, f in F.items():
            fn = torch.compile(f, fullgraph=True)
            ts = [torch.randn(4096, device=dev, requires_grad=True) for _ in range(f.__code__.co_argcount)]
            t1 = time.perf_counter(); fn(*ts).sum().backward()
            if dev == "cuda": torch.cuda.synchronize()
            out[n] = time.perf_counter() - t1
        out = {"first_call_s": out, "wall_s": time.perf_counter() - t0, "cpu_s": cpu() - c0}
    """,
}


def run_step(step: str, cache: str, inductor: str) -> dict:
    code = PRELUDE + f"EXPR = {COLD_EXPR!r}\nSEEDS = {SEEDS!r}\n" + textwrap.dedent(STEPS[step]) \
        + "\nprint('RESULT ' + json.dumps(out))\n"
    env = dict(os.environ, FUSEGEN_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=inductor)
    # Python's own bytecode cache on, as on a user's machine (some sandboxes turn it off, and
    # then every process recompiles fusegen's sources: 35 ms of a 60 ms cached load).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"step {step} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(line[len("RESULT "):])


def main(argv=None):
    p = argparse.ArgumentParser(prog="fusegen bench build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile's first-call times")
    p.add_argument("--only", help="comma-separated steps to run (runtime,cold,batch,load,compile)")
    args = p.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="fusegen-bench-cache-")
    inductor = tempfile.mkdtemp(prefix="fusegen-bench-inductor-")
    results = {}
    steps = ["runtime", "cold", "batch", "load"] + ([] if args.no_compile else ["compile"])
    if args.only:
        steps = [s for s in steps if s in args.only.split(",")]
    for step in steps:
        if step == "load":  # milliseconds: the median of several processes
            runs = sorted((run_step(step, cache, inductor) for _ in range(LOAD_RUNS)), key=lambda r: r["wall_s"])
            results[step] = runs[LOAD_RUNS // 2]
        else:
            results[step] = run_step(step, cache, inductor)
        r = results[step]
        print(f"{step:8s} wall {r['wall_s']:7.2f} s   cpu {r['cpu_s']:7.2f} s   "
              + "  ".join(f"{k} {v}" for k, v in r.items() if k not in ("wall_s", "cpu_s")), flush=True)
    print()
    if set(results) < {"runtime", "cold", "batch", "load", "compile"}:
        return
    print(f"shared runtime, once per torch version: {results['runtime']['wall_s']:.1f} s "
          f"({results['runtime']['cpu_s']:.1f} s CPU)")
    print(f"new op, cold build:                     {results['cold']['wall_s']:.2f} s "
          f"({results['cold']['cpu_s']:.2f} s CPU), first fwd+bwd call {results['cold']['first_call_s'] * 1e3:.1f} ms")
    print(f"7 seed ops, one library:                {results['batch']['wall_s']:.2f} s "
          f"({results['batch']['cpu_s']:.2f} s CPU)")
    print(f"cached load, new process:               import fusegen {results['load']['import_s'] * 1e3:.0f} ms"
          f" + fuse {results['load']['fuse_s'] * 1e3:.0f} ms = {results['load']['wall_s'] * 1e3:.0f} ms")
    if "compile" in results:
        first = results["compile"]["first_call_s"]
        print(f"torch.compile first fwd+bwd call:       cold op {first['cold']:.2f} s; seeds "
              + ", ".join(f"{k} {v:.2f}" for k, v in first.items() if k != "cold")
              + f" s (all {sum(first.values()):.1f} s)")
    if args.json:
        write_text(args.json, json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

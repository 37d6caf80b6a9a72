"""Benchmarks of the CPU kernels, and real layouts (broadcast, channels_last,
transposed, sliced) on the GPU or the CPU. The SwiGLU halves and the FFN block are
bench_ffn.py's (`fusegen bench ffn`).

    fusegen bench cpu [--n 16777216] [--reps 15] [--dtypes float32,float16,bfloat16]
                            [--sizes 2^10,2^16,2^20,2^24] [--threads 1,2] [--json out.json]
    fusegen bench layouts [--n 67108864] [--dtypes float32,bfloat16] [--json out.json]

`cpu`: fusegen against eager, torch.compile (inductor's C++ backend) and numexpr (where
installed), fp32, forward and forward+backward, medians of wall time; in fp16 and bf16,
fusegen against eager (`x*sigmoid(x)` against F.silu) at each size and thread count, with
interleaved repeats. `layouts`: eager and torch.compile on the layouts real models pass.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

from fusegen.bench.core import SEEDS, parse_sizes, timed_ms
from fusegen.bench.peers import optional_module
from fusegen.bench.report import table
from fusegen.files import write_text

GELU = SEEDS["gelu_tanh"]

# name -> (expression, eager function, numexpr expression)
CPU_CASES = {
    "a*b+c": ("a*b+c", lambda a, b, c: a * b + c, "a*b+c"),
    "x*sigmoid(x)": ("x*sigmoid(x)", lambda x: x * torch.sigmoid(x), "x/(1+exp(-x))"),
    "gelu (tanh form)": (GELU, lambda x: 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x))),
                         "0.5*x*(1+tanh(0.7978845608*(x+0.044715*x*x*x)))"),
}


# fp16/bf16 cases: name -> (expression, eager function): the eager op a user would call.
HALF_CASES = {
    "x*sigmoid(x)": ("x*sigmoid(x)", F.silu),
    "a*b+c": ("a*b+c", lambda a, b, c: a * b + c),
}
HALF_SIZES = "2^10,2^16,2^20,2^24"


def _fwd_bwd(f, xs, g):
    return lambda: torch.autograd.grad(f(*xs), [x for x in xs if x.requires_grad], g)


def run_cpu(n: int, reps: int, out_json: str | None, dtypes=(torch.float32,), half_sizes=(), threads=(1, 2)):
    results = run_cpu_fp32(n, reps) if torch.float32 in dtypes else []
    half = [d for d in dtypes if d in (torch.float16, torch.bfloat16)]
    half_rows = run_cpu_half(half_sizes or parse_sizes(HALF_SIZES), threads, half, reps) if half else []
    if out_json:
        write_text(out_json, json.dumps({"n": n, "threads": torch.get_num_threads(), "rows": results,
                                         "half_rows": half_rows}, indent=1))
    return results + half_rows


def run_cpu_fp32(n: int, reps: int):
    from fusegen.api import fuse_many

    ops = dict(zip(CPU_CASES, fuse_many([dict(expr=e, name=f"bench_cpu_{i}") for i, (e, _, _) in
                                         enumerate(CPU_CASES.values())])))
    numexpr = optional_module("numexpr")
    print(f"cpu, {torch.get_num_threads()} threads, torch {torch.__version__}, n = {n}, fp32, median ms of {reps}")
    results = []
    for key, (_, eager, ne_expr) in CPU_CASES.items():
        k = len(ops[key].spec.inputs)
        xs = [torch.randn(n) for _ in range(k)]
        xg = [x.clone().requires_grad_(True) for x in xs]
        g = torch.randn(n)
        impls = {"fusegen": ops[key].op, "eager": eager, "compile": torch.compile(eager, dynamic=False)}
        row = {"expr": key}
        for impl, fn in impls.items():
            row[f"{impl} fwd"] = timed_ms(lambda: fn(*xs), reps, "cpu")
            row[f"{impl} fwd+bwd"] = timed_ms(_fwd_bwd(fn, xg, g), reps, "cpu")
        if numexpr is not None:
            arrays = dict(zip(ops[key].spec.inputs, [x.numpy() for x in xs]))
            row["numexpr fwd"] = timed_ms(lambda: numexpr.evaluate(ne_expr, local_dict=arrays), reps, "cpu")
        results.append(row)
    impls = ["fusegen", "eager", "compile"] + (["numexpr"] if numexpr is not None else [])
    for kind in ("fwd", "fwd+bwd"):
        cols = [i for i in impls if f"{i} {kind}" in results[0]]
        table(f"{kind}, ms", ["expression"] + cols,
               [[r["expr"]] + [f'{r[f"{i} {kind}"]:.1f}' for i in cols] for r in results])
    return results


def interleaved_ms(fns: dict, reps: int, warm: int = 3, sample_s: float = 2e-3, min_total_s: float = 0.1) -> dict:
    """Milliseconds of one call of each function, the functions taking turns within every
    repeat, so that a change of the machine's load hits them all alike: {key: [one sample
    per repeat]}. A sample is as many back-to-back calls as fill about `sample_s` (a call of
    a few µs is timed over hundreds), the turn order is reversed every other repeat (a pair
    of neighbours stays neighbours, and neither always runs first), and short calls get more
    repeats than `reps`: at least `min_total_s` of samples per function. The garbage
    collector is off while timing (timeit's habit): a collection landing in one function's
    sample would decide a ratio at n = 1024."""
    calls = {}
    for key, fn in fns.items():
        for _ in range(warm):
            fn()
        t = time.perf_counter()
        fn()
        per_call = time.perf_counter() - t
        if per_call < 1e-3:  # short: one call's time is mostly the timer's and the cache's
            t = time.perf_counter()
            for _ in range(10):
                fn()
            per_call = (time.perf_counter() - t) / 10
        per_call = max(per_call, 1e-7)
        calls[key] = max(1, min(5000, round(sample_s / per_call)))
    samples = {key: [] for key in fns}
    order = list(fns)
    repeats = reps
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        i = 0
        while i < repeats:
            for key in (order if i % 2 == 0 else order[::-1]):
                fn, count = fns[key], calls[key]
                t = time.perf_counter()
                for _ in range(count):
                    fn()
                samples[key].append((time.perf_counter() - t) * 1e3 / count)
            i += 1
            if i == reps:  # more repeats for short calls, from what the first ones took
                per_repeat = (time.perf_counter() - start) / reps
                repeats = max(reps, min(10 * reps, math.ceil(min_total_s * len(order) / max(per_repeat, 1e-9))))
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def run_cpu_half(sizes, threads, dtypes, reps: int):
    """fusegen over eager in fp16/bf16 at each size and thread count, forward and
    forward+backward: rows of median ms and the median of the repeats' ratios (each
    repeat's fusegen time over the eager time measured next to it, which a machine whose
    load changes disturbs less than a ratio of medians)."""
    from fusegen.api import fuse_many

    ops = dict(zip(HALF_CASES, fuse_many([dict(expr=e, name=f"bench_cpu_half_{i}") for i, (e, _) in
                                          enumerate(HALF_CASES.values())])))
    saved = torch.get_num_threads()
    rows = []
    try:
        for dtype in dtypes:
            for key, (_, eager) in HALF_CASES.items():
                for n in sizes:
                    k = len(ops[key].spec.inputs)
                    xs = [torch.randn(n, dtype=dtype) for _ in range(k)]
                    xg = [x.clone().requires_grad_(True) for x in xs]
                    g = torch.randn(n, dtype=dtype)
                    # The FusedOp, as a user calls it. Each fusegen function next to its
                    # eager one: interleaved_ms keeps neighbours neighbours.
                    fns = {}
                    for kind in ("fwd", "fwd+bwd"):
                        for impl, fn in (("fusegen", ops[key]), ("eager", eager)):
                            fns[f"{impl} {kind}"] = (lambda fn=fn: fn(*xs)) if kind == "fwd" else _fwd_bwd(fn, xg, g)
                    for t in threads:
                        torch.set_num_threads(t)
                        ms = interleaved_ms(fns, reps)
                        row = {"expr": key, "dtype": str(dtype)[6:], "n": n, "threads": t,
                               "repeats": len(ms["fusegen fwd"])}
                        row.update({name: statistics.median(v) for name, v in ms.items()})
                        for kind in ("fwd", "fwd+bwd"):
                            row[f"ratio {kind}"] = statistics.median(
                                f / e for f, e in zip(ms[f"fusegen {kind}"], ms[f"eager {kind}"]))
                        rows.append(row)
    finally:
        torch.set_num_threads(saved)
    table(f"fp16/bf16: fusegen's median ms of {reps} or more interleaved repeats (more for short calls), and the "
          "median of its ratios to eager (x*sigmoid(x) against F.silu)",
          ["expression", "dtype", "n", "threads", "fwd", "fwd / eager", "fwd+bwd", "fwd+bwd / eager"],
          [[r["expr"], r["dtype"], f'2^{r["n"].bit_length() - 1}' if r["n"] & (r["n"] - 1) == 0 else str(r["n"]),
            str(r["threads"])] + [x for kind in ("fwd", "fwd+bwd") for x in (
                f'{r[f"fusegen {kind}"]:.4f}', f'{r[f"ratio {kind}"]:.2f}')]
           for r in rows])
    return rows


def _layout_cases(n: int, device: str, dtype):
    """name -> (FusedOp key, tensors builder, eager function). n elements in the big tensor."""
    c = 64
    hw = max(n // (c * 8), 1)
    h = int(hw ** 0.5)
    shape = (8, c, h, max(hw // h, 1))

    def nchw():
        return [torch.randn(shape, device=device, dtype=dtype), torch.randn(1, c, 1, 1, device=device, dtype=dtype),
                torch.randn(1, c, 1, 1, device=device, dtype=dtype)]

    def nhwc():
        x, s, b = nchw()
        return [x.to(memory_format=torch.channels_last), s, b]

    rows = max(n // 4096, 1)

    def transposed():
        return [torch.randn(4096, rows, device=device, dtype=dtype).t(), torch.randn(rows, 4096, device=device, dtype=dtype),
                torch.randn(rows, 4096, device=device, dtype=dtype)]

    def sliced():
        return [torch.randn(2 * n, device=device, dtype=dtype)[::2], torch.randn(n, device=device, dtype=dtype),
                torch.randn(n, device=device, dtype=dtype)]

    scale_bias = lambda x, s, b: x * s + b  # noqa: E731
    fma = lambda a, b, c: a * b + c  # noqa: E731
    return {
        "x*scale+bias, NCHW, per-channel": ("scale_bias", nchw, scale_bias),
        "x*scale+bias, channels_last": ("scale_bias", nhwc, scale_bias),
        "a*b+c, a transposed": ("fma", transposed, fma),
        "a*b+c, a sliced (stride 2)": ("fma", sliced, fma),
    }


def run_layouts(n: int, dtypes, reps: int, out_json: str | None):
    from fusegen.api import fuse_many

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ops = dict(zip(["scale_bias", "fma"], fuse_many([
        dict(expr="x*scale+bias", name="bench_scale_bias"), dict(expr="a*b+c", name="bench_fma")])))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, n about {n}, median ms of {reps}")
    results = []
    for dtype in dtypes:
        for case, (key, make, eager) in _layout_cases(n, device, dtype).items():
            xs = make()
            xg = [x.detach().requires_grad_(True) for x in xs]
            g = torch.randn_like(eager(*xs))
            impls = {"fusegen": ops[key].op, "eager": eager, "compile": torch.compile(eager, dynamic=False)}
            row = {"case": case, "dtype": str(dtype)[6:]}
            for impl, fn in impls.items():
                row[f"{impl} fwd"] = timed_ms(lambda: fn(*xs), reps, device)
                row[f"{impl} fwd+bwd"] = timed_ms(_fwd_bwd(fn, xg, g), reps, device)
            results.append(row)
    impls = ["fusegen", "eager", "compile"]
    for kind in ("fwd", "fwd+bwd"):
        table(f"{kind}, ms", ["case", "dtype"] + impls,
               [[r["case"], r["dtype"]] + [f'{r[f"{i} {kind}"]:.3f}' if f"{i} {kind}" in r else "-" for i in impls]
                for r in results])
    if out_json:
        write_text(out_json, json.dumps({"device": name, "n": n, "rows": results}, indent=1))
    return results


def main(argv):
    mode, rest = argv[0], argv[1:]
    p = argparse.ArgumentParser(prog=f"fusegen bench {mode}")
    p.add_argument("--n", type=int, default=1 << 24 if mode == "cpu" else 1 << 26)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--dtypes", default="float32,float16,bfloat16" if mode == "cpu" else "float32,bfloat16")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help=f"cpu: fp16/bf16 element counts (default {HALF_SIZES})")
    p.add_argument("--threads", default="1,2", help="cpu: fp16/bf16 thread counts (default 1,2)")
    p.add_argument("--json")
    args = p.parse_args(rest)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    if mode == "cpu":
        return run_cpu(args.n, args.reps, args.json, dtypes, args.sizes or (), [int(t) for t in args.threads.split(",")])
    return run_layouts(args.n, dtypes, args.reps, args.json)

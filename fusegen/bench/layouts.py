"""Benchmarks of issue 8: the CPU kernels, and real layouts (broadcast, channels_last,
transposed, sliced) on the GPU or the CPU. The SwiGLU halves and the FFN block are
bench_ffn.py's (`fusegen bench ffn`).

    fusegen bench cpu [--n 16777216] [--reps 15] [--json out.json]
    fusegen bench layouts [--n 67108864] [--dtypes float32,bfloat16] [--json out.json]

`cpu`: fusegen against eager, torch.compile (inductor's C++ backend) and numexpr (where
installed), fp32, forward and forward+backward, medians of wall time. `layouts`: eager and
torch.compile on the layouts real models pass.
"""

from __future__ import annotations

import argparse
import json

import torch

from fusegen.bench.core import SEEDS, timed_ms
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


def _fwd_bwd(f, xs, g):
    return lambda: torch.autograd.grad(f(*xs), [x for x in xs if x.requires_grad], g)


def run_cpu(n: int, reps: int, out_json: str | None):
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
    if out_json:
        write_text(out_json, json.dumps({"n": n, "threads": torch.get_num_threads(), "rows": results}, indent=1))
    return results


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
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--json")
    args = p.parse_args(rest)
    if mode == "cpu":
        return run_cpu(args.n, args.reps, args.json)
    return run_layouts(args.n, [getattr(torch, d) for d in args.dtypes.split(",")], args.reps, args.json)

"""Bias-dropout-add, forward+backward: `fusegen bench dropout`.

    fusegen bench dropout [--shapes 16384x4096,...] [--dtypes bf16,fp32]
                          [--p 0.1] [--reps 20] [--json out.json]

The op is Megatron's `dropout(x + bias, p) + residual` on (tokens, hidden) activations with a
bias of shape (hidden,), at Llama's widths (4096 in 7-8B, 8192 in 70B) and GPT-3's (12288),
and two smaller ones; one step is the forward and the gradients of x, bias and residual
(torch.autograd.grad with a given output gradient). Against eager (`F.dropout`, which saves
a bool mask) and torch.compile of the same function (its first calls, which compile, are
the warm-up). fusegen saves no mask: its backward regenerates the forward's numbers.
Two references for fusegen itself: the same op without the draws (`(x + bias) * (1 - p) +
residual`: the same tensors moved, so the gap is what drawing costs), and fusegen under
`torch.use_deterministic_algorithms(True)`, where ATen sums bias's gradient instead of the
backward kernel. Medians of CUDA events (perf_counter on a CPU) with the spread of the
samples, and the share of a device copy's rate for the bytes the fused step must move (x,
residual and the output in the forward; the output gradient in and x's gradient out in the
backward, bias's summed from it in the same kernel).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from fusegen.bench.core import DTYPES, _sample_ms, _sync, device_info, dtype_name, spread_pct
from fusegen.files import write_text

BDA = "torch.nn.functional.dropout(x + bias, p) + residual"
NO_DRAWS = "(x + bias) * (1 - p) + residual"
ATEN_SUM = "fusegen, ATen sum"  # fusegen's step under deterministic mode: ATen sums bias's gradient
IMPLS = ("eager", "compile", "fusegen", "fusegen, no draws", ATEN_SUM)
SHAPES = "16384x4096,8192x8192,4096x12288,8192x4096,8192x2048,4096x1024"


def eager_bda(x, bias, residual, p: float):
    return F.dropout(x + bias, p) + residual


def _implementations(p: float) -> dict:
    import fusegen

    op = fusegen.fuse(BDA, name="bench_bias_dropout_add", scalars=["p"], compile="opaque")
    no_draws = fusegen.fuse(NO_DRAWS, name="bench_bias_scale_add", scalars=["p"])
    compiled = torch.compile(eager_bda)
    return {"eager": lambda x, b, r: eager_bda(x, b, r, p),
            "compile": lambda x, b, r: compiled(x, b, r, p),
            "fusegen": lambda x, b, r: op(x, b, r, p),
            "fusegen, no draws": lambda x, b, r: no_draws(x, b, r, p),
            ATEN_SUM: lambda x, b, r: op(x, b, r, p)}


def _step(f, deterministic: bool = False):
    def step(x, b, r, g):
        y = f(x, b, r)
        return torch.autograd.grad(y, (x, b, r), g)

    def aten_sum(x, b, r, g):
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            return step(x, b, r, g)
        finally:
            torch.use_deterministic_algorithms(before)
    return aten_sum if deterministic else step


def _copy_ms(n_bytes: int, device: str, reps: int) -> float:
    src = torch.empty(n_bytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return statistics.median(_sample_ms(lambda: dst.copy_(src), [()] * 10, device) for _ in range(reps))


def run(shapes, dtypes, p: float, reps: int, device: str) -> dict:
    rows = []
    impls = _implementations(p)
    for shape in shapes:
        tokens, hidden = shape
        for dtype in dtypes:
            x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
            b = torch.randn(hidden, dtype=dtype, device=device, requires_grad=True)
            r = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
            g = torch.randn(tokens, hidden, dtype=dtype, device=device)
            moved = 5 * x.numel() * x.element_size()  # fwd: x, residual, out; bwd: dout, dx
            copy = _copy_ms(moved, device, reps)
            row = {"shape": f"{tokens}x{hidden}", "dtype": dtype_name(dtype), "copy_ms": copy}
            for name, f in impls.items():
                step = _step(f, deterministic=name == ATEN_SUM)
                for _ in range(3):
                    step(x, b, r, g)
                _sync(device)
                times = [_sample_ms(step, [(x, b, r, g)] * 5, device) for _ in range(reps)]
                row[name] = {"ms": statistics.median(times), "spread_pct": spread_pct(times),
                             "copy_pct": 100 * copy / statistics.median(times)}
            row["fusegen/eager"] = row["fusegen"]["ms"] / row["eager"]["ms"]
            row["fusegen/compile"] = row["fusegen"]["ms"] / row["compile"]["ms"]
            rows.append(row)
    return {"device": device_info(device), "p": p, "rows": rows}


def report(result) -> str:
    lines = [f"bias-dropout-add fwd+bwd, p = {result['p']}, on {result['device'].get('name', 'cpu')}: "
             "median ms (spread %, % of the copy rate)",
             f"{'shape':>11} {'dtype':>9} " + " ".join(f"{k:>20}" for k in IMPLS) + f" {'/eager':>7} {'/compile':>9}"]
    for row in result["rows"]:
        cells = [f"{row[k]['ms']:.3f} ({row[k]['spread_pct']:.0f}%, {row[k]['copy_pct']:.0f}%)" for k in IMPLS]
        lines.append(f"{row['shape']:>11} {row['dtype']:>9} " + " ".join(f"{c:>20}" for c in cells)
                     + f" {row['fusegen/eager']:>7.2f} {row['fusegen/compile']:>9.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fusegen bench dropout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=SHAPES, help=f"tokens x hidden, comma-separated (default {SHAPES})")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    result = run(shapes, dtypes, args.p, args.reps, args.device)
    print(report(result))
    if args.json:
        write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0

"""Rotary position embedding (RoPE) on q and k, forward+backward: `fusegen bench rope`.

    fusegen bench rope [--batch 4] [--heads 32] [--seq 2048] [--head-dim 128]
                       [--dtypes bf16,fp32] [--reps 20] [--json out.json]

The op is one expression of several outputs joined by a final `torch.cat` (README,
"Several outputs"): `torch.cat((x1*c - x2*s, x2*c + x1*s), -1)` on `x1, x2 = q.chunk(2, -1)`,
with the cos/sin halves of one position table (seq, head_dim / 2) broadcast over batch and
heads. One step is q's and k's rotation and the gradient of both (torch.autograd.grad with
given output gradients). Against:

- eager: Hugging Face Llama's `apply_rotary_pos_emb`, `q*cos + rotate_half(q)*sin` with the
  full-width (seq, head_dim) tables;
- compile: torch.compile of that function (its first call, which compiles, is a warm-up);
- liger: Liger Kernel's `liger_rotary_pos_emb` where it is installed (CUDA only).

Medians of CUDA events (perf_counter on a CPU) with the spread of the samples, and the
share of a device copy's rate for the bytes a step must move (q and k read and written,
their gradients read and written: 8 passes over q's size in all).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from fusegen.bench.core import DTYPES, _sample_ms, _sync, device_info, dtype_name, spread_pct
from fusegen.bench.peers import failure, optional_module
from fusegen.files import write_text

ROPE = "torch.cat((x1*c - x2*s, x2*c + x1*s), -1)"


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def eager_rope(q, k, cos, sin):
    """Hugging Face Llama's apply_rotary_pos_emb (cos, sin: (seq, head_dim))."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _tables(seq: int, dim: int, dtype, device: str):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)  # (seq, dim / 2)


def _implementations(dtype, device: str) -> dict:
    import fusegen

    op = fusegen.fuse(ROPE, name="bench_rope", inputs="x1,x2,c,s")

    def fused(q, k, c, s, cos, sin):
        return op(*q.chunk(2, -1), c, s), op(*k.chunk(2, -1), c, s)

    def eager(q, k, c, s, cos, sin):
        return eager_rope(q, k, cos, sin)

    impls = {"fusegen": fused, "eager": eager, "compile": torch.compile(eager)}
    liger = optional_module("liger_kernel.transformers.rope") if device == "cuda" else None
    if liger is not None:
        def liger_rope(q, k, c, s, cos, sin):
            return liger.liger_rotary_pos_emb(q, k, cos[None], sin[None])
        impls["liger"] = liger_rope
    return impls


def _step(f, q, k, tables, douts):
    leaves = [q.detach().requires_grad_(), k.detach().requires_grad_()]
    out = f(*leaves, *tables)
    return torch.autograd.grad(out, leaves, douts)


def run(batch: int, heads: int, seq: int, dim: int, dtypes, reps: int, device: str) -> list[dict]:
    rows = []
    for dtype in dtypes:
        g = torch.Generator(device=device).manual_seed(0)
        shape = (batch, heads, seq, dim)
        q, k, dq, dk = (torch.randn(shape, device=device, generator=g).to(dtype) for _ in range(4))
        c, s = _tables(seq, dim, dtype, device)
        cos, sin = torch.cat((c, c), -1), torch.cat((s, s), -1)
        tables = (c, s, cos, sin)
        want = eager_rope(*(t.double() for t in (q, k, cos, sin)))
        moved = 8 * q.numel() * q.element_size()
        copy_src, copy_dst = torch.empty(moved // 2, dtype=torch.uint8, device=device), \
            torch.empty(moved // 2, dtype=torch.uint8, device=device)
        copy = [_sample_ms(lambda: copy_dst.copy_(copy_src), [()] * 10, device) for _ in range(reps)]
        copy_ms = statistics.median(copy)
        for name, f in _implementations(dtype, device).items():
            row = {"impl": name, "dtype": dtype_name(dtype), "shape": list(shape)}
            try:
                got = f(q, k, *tables)
                error = max(float((a.double() - w).abs().max()) for a, w in zip(got, want))
                for _ in range(3):
                    _step(f, q, k, tables, (dq, dk))
                _sync(device)
                times = [_sample_ms(lambda: _step(f, q, k, tables, (dq, dk)), [()] * 10, device)
                         for _ in range(reps)]
            except Exception as err:  # a peer that cannot run here: reported, not fatal
                rows.append({**row, "error": failure(err)})
                continue
            median = statistics.median(times)
            rows.append({**row, "ms": median, "min": min(times), "max": max(times),
                         "spread_pct": spread_pct(times), "copy_pct": 100 * copy_ms / median,
                         "max_abs_error": error})
        rows.append({"impl": "copy", "dtype": dtype_name(dtype), "ms": copy_ms, "min": min(copy),
                     "max": max(copy), "bytes": moved})
    return rows


def report(rows) -> list[str]:
    lines = [f"{'impl':<9} {'dtype':<6} {'ms':>8} {'min..max':>17} {'vs eager':>9} {'copy %':>7} {'max err':>9}"]
    eager = {r["dtype"]: r["ms"] for r in rows if r["impl"] == "eager" and "ms" in r}
    for r in rows:
        if r["impl"] == "copy":
            continue
        if "error" in r:
            lines.append(f"{r['impl']:<9} {r['dtype']:<6} {r['error']}")
            continue
        ratio = r["ms"] / eager[r["dtype"]] if r["dtype"] in eager else float("nan")
        lines.append(f"{r['impl']:<9} {r['dtype']:<6} {r['ms']:8.3f} {r['min']:8.3f}..{r['max']:<8.3f} "
                     f"{ratio:8.2f}x {r['copy_pct']:6.0f}% {r['max_abs_error']:9.2e}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fusegen bench rope", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", help="write the rows and the device to this file")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    rows = run(args.batch, args.heads, args.seq, args.head_dim, dtypes, args.reps, device)
    info = device_info(device)
    print(f"RoPE fwd+bwd on q and k {(args.batch, args.heads, args.seq, args.head_dim)}, {info.get('name', device)}")
    print("\n".join(report(rows)))
    if args.json:
        write_text(args.json, json.dumps({"device": info, "rows": rows}, indent=2) + "\n")
    return 0

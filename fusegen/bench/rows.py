"""Row ops (norms, softmax and cross-entropy over the last dimension), forward+backward:
`fusegen bench rows`.

    fusegen bench rows [--ops rmsnorm,layernorm,softmax,resnorm,crossentropy] [--rows 4096,16384]
                       [--hidden 2048,4096,8192] [--dtypes bf16,fp32] [--impls fusegen,eager,compile,liger]
                       [--reps 20] [--quick] [--device auto|cuda|cpu] [--json out.json]

Each op is one fusegen expression with row reductions (`.mean(-1, keepdim=True)`,
`torch.amax`, `.sum`), x of shape (rows, hidden), the weights of shape (hidden,):

- rmsnorm: `x * rsqrt(mean(x*x) + eps) * w`;
- layernorm: `(x - mean(x)) * rsqrt(mean((x - mean(x))**2) + eps) * w + b`;
- softmax: `exp(x - amax(x)) / sum(exp(x - amax(x)))`;
- resnorm: the residual add and RMSNorm of a decoder layer, two outputs `(x + r, rmsnorm(x + r))`;
- crossentropy: each row's loss `logsumexp(x) - x.gather(-1, label)` with an int64 label of
  shape (rows, 1), its mean over the rows outside, as a training step takes it; x holds
  logits over a vocabulary (the rows' length: 32000 and 128256 unless --hidden says).

One step is the forward and the gradient of every input, the weights included
(torch.autograd.grad with given output gradients; the cross-entropy's is the mean's, one
number). Against:

- eager: F.rms_norm, F.layer_norm, F.softmax, F.cross_entropy, and for resnorm
  `h = x + r; (h, F.rms_norm(h))`;
- compile: torch.compile of the eager function (its first call, which compiles, is a
  warm-up), one graph per op, dtype and hidden size with the row count dynamic
  (`dynamic=False` and torch._dynamo.mark_dynamic on the rows): a model's hidden size is
  fixed while its token count varies, and the defaults (2 row counts x 3 hidden sizes x 2
  dtypes x 4 ops) then compile 24 graphs instead of 48: the whole default run, compiles
  included, took under two minutes on an H200;
- liger: Liger Kernel's LigerRMSNormFunction (casting_mode "llama", in_place=False, so that
  the given output gradient stays as it was), LigerLayerNormFunction, LigerSoftmaxFunction,
  LigerFusedAddRMSNormFunction and LigerCrossEntropyFunction (reduction "mean"; it writes
  the gradient into the logits during the forward, so its later calls run on those values)
  from liger_kernel.ops.<module> (a release without one is reported as a skip), CUDA only;
  Liger returns resnorm's outputs as (normed, sum), reordered here.

Medians of CUDA events (perf_counter on a CPU) with their spread; each sample runs the step
over a rotation of input sets holding more than twice the L2 cache (at least 10 calls on
CUDA), so that no set is read from L2 left by the call before. Beside each time, the share
of a device copy's rate (core.py's copy, rotated the same way) for the bytes an ideal fused
forward and backward must move, in passes over a (rows, hidden) tensor:

    op         forward                        backward                                   passes
    rmsnorm    read x, write y                read x, dy, write dx                          5
    layernorm  read x, write y                read x, dy, write dx                          5
    softmax    read x, write y                read y, dy, write dx                          5
    resnorm    read x, r, write h, y          read h, dh, dy, write dx (= dr, one tensor)   8
    crossentropy  read x                      read x, write dx                              3

The per-row statistics, the weights and their gradients are O(rows + hidden) and left out.
The error column is the largest difference from eager in float64 on the same values, over
every output and gradient, each relative to the largest magnitude of its reference.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

import torch
import torch.nn.functional as F

from fusegen.bench.core import (DTYPES, _Copies, _sample_ms, _sync, device_info, dtype_name, l2_bytes,
                                name_list, rotation, spread_pct)
from fusegen.bench.peers import configure_compile, failure, optional_module
from fusegen.bench.report import table, with_spread
from fusegen.files import write_text

EPS = 1e-6
IMPLS = ("fusegen", "eager", "compile", "liger")
CALLS = 10  # calls per sample on CUDA at least: the GPU's time, not one call's host time
# --quick: one small shape (and on the CPU fp32 only and fewer samples), for a smoke run
QUICK_SHAPE = {"cuda": (4096, 2048), "cpu": (64, 256)}
QUICK_REPS = {"cuda": 10, "cpu": 3}
# seconds of timed copies per byte count: the reference of "% of copy", steady within a few %
COPY_SECONDS = {"cuda": 0.05, "cpu": 0.01}


def eager_rmsnorm(x, w):
    return F.rms_norm(x, x.shape[-1:], w, EPS)


def eager_layernorm(x, w, b):
    return F.layer_norm(x, x.shape[-1:], w, b, EPS)


def eager_softmax(x):
    return F.softmax(x, -1)


def eager_resnorm(x, r, w):
    h = x + r
    return h, F.rms_norm(h, h.shape[-1:], w, EPS)


def eager_crossentropy(x, label):
    return F.cross_entropy(x, label.view(-1))


@dataclass(frozen=True)
class RowOp:
    """One benchmarked op: its fusegen expression and inputs (`rowwise`: those of shape
    (rows, hidden); `labels`: int64 of shape (rows, 1), no gradient; the rest (hidden,)),
    the eager function (a def of its own: torch.compile keys its graphs on the code object),
    Liger Kernel's Function, the passes over a (rows, hidden) tensor an ideal fused step
    moves (the module's docstring); `loss`: the step takes the mean of the op's one value
    per row; `lengths`: the row lengths of a default run, instead of the hidden sizes."""

    text: str
    inputs: tuple[str, ...]
    rowwise: tuple[str, ...]
    scalars: tuple[str, ...]
    outputs: int
    eager: Callable
    liger: tuple[str, str]
    passes: int
    labels: tuple[str, ...] = ()
    loss: bool = False
    lengths: tuple[int, ...] = ()


OPS = {
    "rmsnorm": RowOp("x * torch.rsqrt((x*x).mean(-1, keepdim=True) + eps) * w", ("x", "w"), ("x",), ("eps",),
                     1, eager_rmsnorm, ("liger_kernel.ops.rms_norm", "LigerRMSNormFunction"), 5),
    "layernorm": RowOp("(x - x.mean(-1, keepdim=True)) * torch.rsqrt(((x - x.mean(-1, keepdim=True))**2)"
                       ".mean(-1, keepdim=True) + eps) * w + b", ("x", "w", "b"), ("x",), ("eps",), 1,
                       eager_layernorm, ("liger_kernel.ops.layer_norm", "LigerLayerNormFunction"), 5),
    "softmax": RowOp("torch.exp(x - torch.amax(x, -1, keepdim=True)) / "
                     "torch.exp(x - torch.amax(x, -1, keepdim=True)).sum(-1, keepdim=True)",
                     ("x",), ("x",), (), 1, eager_softmax,
                     ("liger_kernel.ops.softmax", "LigerSoftmaxFunction"), 5),
    "resnorm": RowOp("(x + r, (x + r) * torch.rsqrt(((x + r)*(x + r)).mean(-1, keepdim=True) + eps) * w)",
                     ("x", "r", "w"), ("x", "r"), ("eps",), 2, eager_resnorm,
                     ("liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction"), 8),
    "crossentropy": RowOp("torch.logsumexp(x, -1, keepdim=True) - x.gather(-1, label)", ("x", "label"), ("x",),
                          (), 1, eager_crossentropy, ("liger_kernel.ops.cross_entropy", "LigerCrossEntropyFunction"),
                          3, labels=("label",), loss=True, lengths=(32000, 128256)),
}


def build_ops(names) -> dict:
    """op name -> FusedOp, every op in one library (one compiler run)."""
    import fusegen

    requests = [{"expr": OPS[n].text, "name": f"bench_rows_{n}", "inputs": list(OPS[n].inputs),
                 "scalars": list(OPS[n].scalars)} for n in names]
    return dict(zip(names, fusegen.fuse_many(requests)))


def _fusegen_call(op, spec: RowOp):
    if spec.loss:
        return lambda *tensors: op(*tensors).mean()
    if spec.scalars:  # eps positional: keyword arguments take the FusedOp's slower binding path
        return lambda *tensors: op(*tensors, EPS)
    return op


def _liger_call(name: str, device: str):
    """(Liger Kernel's step function for the op, None), or (None, why it is absent)."""
    if device != "cuda":
        return None, "needs CUDA (Triton kernels)"
    module_name, attr = OPS[name].liger
    if optional_module("liger_kernel") is None:
        return None, "liger_kernel is not installed (pip install liger-kernel)"
    module = optional_module(module_name)
    function = getattr(module, attr, None)
    if function is None:
        return None, f"liger_kernel {_version('liger-kernel')} has no {module_name}.{attr}"
    if name == "rmsnorm":
        return (lambda x, w: function.apply(x, w, EPS, 0.0, "llama", False)), None
    if name == "layernorm":
        return (lambda x, w, b: function.apply(x, w, b, EPS)), None
    if name == "softmax":
        return function.apply, None
    if name == "crossentropy":
        def crossentropy(x, label):  # (x, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction)
            out = function.apply(x, label.view(-1), None, -100, 0.0, 0.0, "mean")
            return out[0] if isinstance(out, tuple) else out  # (loss, z_loss, ...) in later releases
        return crossentropy, None

    def resnorm(x, r, w):  # Liger returns (normed, sum); the expression (sum, normed)
        y, h = function.apply(x, r, w, EPS, 0.0, "llama", False)
        return h, y
    return resnorm, None


def implementations(name: str, op, device: str, wanted) -> tuple[dict, dict]:
    """impl -> forward function of the op's inputs, and impl -> why it is missing."""
    spec = OPS[name]
    impls, skipped = {}, {}
    if "fusegen" in wanted:
        impls["fusegen"] = _fusegen_call(op, spec)
    if "eager" in wanted:
        impls["eager"] = spec.eager
    if "compile" in wanted:
        impls["compile"] = torch.compile(spec.eager, dynamic=False)
    if "liger" in wanted:
        liger, why = _liger_call(name, device)
        if liger is None:
            skipped["liger"] = why
        else:
            impls["liger"] = liger
    return impls, skipped


def _inputs(spec: RowOp, rows: int, hidden: int, count: int, dtype, device: str, seed: int):
    """`count` sets of (the op's inputs, output gradients), the weights the same tensors in
    every set; each input a leaf that requires grad, made once (torch.autograd.grad leaves
    no .grad behind, so a set is reused from call to call)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=g, device=device) * scale + shift).to(dtype)

    weights = {"w": randn(hidden, scale=0.1, shift=1.0), "b": randn(hidden, scale=0.1)}
    weights = {k: v.requires_grad_() for k, v in weights.items() if k in spec.inputs}
    sets = []
    for _ in range(count):
        rowwise = {k: randn(rows, hidden).requires_grad_() for k in spec.rowwise}
        rowwise |= {k: torch.randint(0, hidden, (rows, 1), generator=g, device=device) for k in spec.labels}
        for t in rowwise.values():
            if rows > 1:  # compile: one graph for every row count (the docstring); dynamo specializes 1
                torch._dynamo.mark_dynamic(t, 0)
        leaves = [rowwise[k] if k in rowwise else weights[k] for k in spec.inputs]
        douts = [randn(*(() if spec.loss else (rows, hidden))) for _ in range(spec.outputs)]
        sets.append((leaves, douts))
    return sets


def _step(forward):
    """forward+backward of one set: the outputs and the gradient of every input."""
    def step(leaves, douts):
        out = forward(*leaves)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        return outs, torch.autograd.grad(outs, [t for t in leaves if t.requires_grad], douts)
    return step


def _error(got, want) -> float:
    """The largest |got - want| over the tensors, each relative to its reference's largest magnitude."""
    worst = 0.0
    for a, w in zip(got, want):
        scale = float(w.abs().max()) if w.numel() else 0.0
        diff = float((a.detach().double() - w).abs().max()) if w.numel() else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def _reference(spec: RowOp, leaves, douts):
    x64 = [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in leaves]
    outs, grads = _step(spec.eager)(x64, [d.double() for d in douts])
    return [o.detach() for o in outs] + list(grads)


def _release(device: str):
    if device == "cuda":
        torch.cuda.empty_cache()


def measure(step, sets, reps: int, device: str) -> list[float]:
    """`reps` samples of ms per call, each over the rotation of sets (repeated to CALLS calls
    on CUDA), after a warm-up of three calls."""
    timed = [sets[i % len(sets)] for i in range(max(len(sets), CALLS if device == "cuda" else 1))]
    for i in range(3):
        step(*sets[i % len(sets)])
    _sync(device)
    return [_sample_ms(step, timed, device) for _ in range(reps)]


def run(names, shapes, dtypes, wanted, reps: int, device: str, out_json: str | None = None,
        progress=print) -> dict:
    """Every measurement; the result dict (written to out_json after each op and dtype, so
    that a run cut short keeps what it measured). `shapes`: (rows, hidden) for every op, or
    per op name."""
    import fusegen

    by_op = shapes if isinstance(shapes, dict) else {n: shapes for n in names}
    shapes = list(dict.fromkeys(s for n in names for s in by_op[n]))

    if "compile" in wanted:
        configure_compile(True, len(dtypes) * len({h for _, h in shapes}))
    l2 = l2_bytes(device)
    copies = _Copies(device, l2, COPY_SECONDS[device])
    result = {
        "fusegen_bench_rows": 1,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_info(device), "fusegen": fusegen.__version__,
        "liger_kernel": _version("liger-kernel"),
        "settings": {"ops": list(names), "shapes": [list(s) for s in shapes],
                     "dtypes": list(map(dtype_name, dtypes)), "impls": list(wanted), "reps": reps, "eps": EPS,
                     "l2_bytes": l2, "calls_per_sample_min": CALLS if device == "cuda" else 1,
                     "compile": "dynamic=False, rows marked dynamic: a graph per op, dtype and hidden size"},
        "passes": {n: OPS[n].passes for n in names},
        "rows": [], "skipped": [], "copy": [], "summary": [],
    }
    start = time.perf_counter()
    ops = build_ops(names) if "fusegen" in wanted else {}
    result["build_s"] = time.perf_counter() - start
    progress(f"fusegen bench rows: {len(names)} op(s) built or loaded in {result['build_s']:.1f} s")
    for name in names:
        spec = OPS[name]
        for dtype in dtypes:
            where = {"op": name, "dtype": dtype_name(dtype)}
            impls, missing = implementations(name, ops.get(name), device, wanted)
            result["skipped"] += [{**where, "impl": k, "reason": v} for k, v in missing.items()]
            failed: set = set()  # an impl that raised is not tried at the other shapes
            # the largest rows first: compile's graph for a hidden size is made at its first call
            for rows, hidden in sorted(by_op[name], key=lambda s: (s[1], -s[0])):
                _shape(result, spec, impls, failed, {**where, "rows": rows, "hidden": hidden}, dtype, reps,
                       device, l2, copies, progress)
                _release(device)
            result["copy"] = [{"bytes": b, "ms": ms, "spread_pct": copies.spread[b]}
                              for b, ms in sorted(copies.ms.items())]
            result["summary"] = summarize(result["rows"])
            result["seconds"] = time.perf_counter() - start
            if out_json:
                write_text(out_json, json.dumps(result, indent=1) + "\n")
    return result


def _shape(result, spec, impls, failed, key, dtype, reps, device, l2, copies, progress):
    """Every implementation at one shape, appended to result's rows (or skipped)."""
    rows, hidden = key["rows"], key["hidden"]
    es = torch.empty((), dtype=dtype).element_size()
    per_set = (len(spec.rowwise) + spec.outputs) * rows * hidden * es
    nbytes = spec.passes * rows * hidden * es
    try:
        sets = _inputs(spec, rows, hidden, rotation(per_set, l2), dtype, device, seed=rows * 7 + hidden)
        want = _reference(spec, *sets[0])
        copy_ms = copies.time(nbytes)
    except torch.cuda.OutOfMemoryError as err:
        result["skipped"].append({**key, "impl": "*", "reason": failure(err)})
        return
    line = []
    for impl, forward in impls.items():
        if impl in failed:
            continue
        step = _step(forward)
        try:
            outs, grads = step(*sets[0])  # compile's first call: the compile, outside the timing
            error = _error(list(outs) + list(grads), want)
            del outs, grads
            times = measure(step, sets, reps, device)
        except Exception as err:  # a peer that cannot run here (a Triton error, OOM): reported, not fatal
            result["skipped"].append({**key, "impl": impl, "reason": failure(err)})
            if not isinstance(err, torch.cuda.OutOfMemoryError):
                failed.add(impl)
            _release(device)
            continue
        ms = statistics.median(times)
        result["rows"].append({**key, "impl": impl, "ms": ms, "min": min(times), "max": max(times),
                               "spread_pct": spread_pct(times), "samples": len(times),
                               "calls_per_sample": max(len(sets), CALLS if device == "cuda" else 1),
                               "bytes": nbytes, "gbs": nbytes / ms / 1e6 if ms > 0 else None,
                               "pct_copy": 100 * copy_ms / ms if ms > 0 else None, "error": error})
        line.append(f"{impl} {ms:.3f} ms")
    progress(f"  {key['op']} {key['dtype']} {rows}x{hidden}: " + ", ".join(line or ["nothing ran"]))


def summarize(rows) -> list[dict]:
    """Per op, dtype and shape: fusegen's time and its ratio to each peer's (below 1: fusegen
    is faster)."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        groups.setdefault((r["op"], r["dtype"], r["rows"], r["hidden"]), {})[r["impl"]] = r["ms"]
    out = []
    for (op, dtype, rows_, hidden), times in groups.items():
        if "fusegen" not in times:
            continue
        ratios = {k: times["fusegen"] / v for k, v in times.items() if k != "fusegen" and v > 0}
        out.append({"op": op, "dtype": dtype, "rows": rows_, "hidden": hidden, "fusegen_ms": times["fusegen"],
                    "fusegen_over": ratios})
    return out


def report(result) -> None:
    """The markdown table of a result, and the skips with their reasons."""
    device = result["device"]
    print(f"\nfusegen bench rows on {device.get('name', device['kind'])} ({device['kind']}), torch "
          f"{device['torch']}, Liger Kernel {result['liger_kernel'] or 'not installed'}; median ms of "
          f"{result['settings']['reps']} samples, fwd+bwd")
    rows = result["rows"]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    cells = {(r["op"], r["dtype"], r["rows"], r["hidden"], r["impl"]): r for r in rows}
    peers = [i for i in impls if i != "fusegen"]
    lines = []
    for key in dict.fromkeys((r["op"], r["dtype"], r["rows"], r["hidden"]) for r in rows):
        ours = cells.get(key + ("fusegen",))
        line = [key[0], key[1], f"{key[2]}x{key[3]}"]
        for impl in impls:
            r = cells.get(key + (impl,))
            line.append(f"{with_spread(r['ms'], r['spread_pct'])} ({r['pct_copy']:.0f}%)" if r else "-")
        for peer in peers:
            r = cells.get(key + (peer,))
            line.append(f"{ours['ms'] / r['ms']:.2f}" if ours and r and r["ms"] > 0 else "-")
        line.append(f"{ours['error']:.1e}" if ours else "-")
        lines.append(line)
    table("ms ±spread (% of copy rate for the ideal bytes); fusegen / peer below 1: fusegen is faster; "
          "fusegen's error against float64 eager",
          ["op", "dtype", "rows x hidden"] + impls + [f"fusegen / {p}" for p in peers] + ["error"], lines)
    reasons: dict[tuple, list] = {}
    for s in result["skipped"]:
        reasons.setdefault((s["impl"], s["reason"]), []).append(f"{s['op']} {s['dtype']}")
    for (impl, reason), where in reasons.items():
        print(f"skipped  {impl} ({', '.join(dict.fromkeys(where))}): {reason}")


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 4096,16384, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return list(dict.fromkeys(sizes))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fusegen bench rows", description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=name_list("op", OPS), default=",".join(OPS),
                   help=f"of {','.join(OPS)} (default: all)")
    p.add_argument("--rows", type=_sizes, default=None, help="row counts (default 4096,16384)")
    p.add_argument("--hidden", type=_sizes, default=None, help="row lengths (default 2048,4096,8192)")
    p.add_argument("--dtypes", type=name_list("dtype", DTYPES), default=None,
                   help="default bf16,fp32 (fp32 with --quick on the CPU)")
    p.add_argument("--impls", type=name_list("implementation", IMPLS), default=",".join(IMPLS),
                   help=f"of {','.join(IMPLS)} (default: all; those that cannot run here are reported)")
    p.add_argument("--reps", type=int, default=None, help="timed samples per measurement (default 20)")
    p.add_argument("--quick", action="store_true",
                   help=f"one shape ({'x'.join(map(str, QUICK_SHAPE['cuda']))} on CUDA, "
                        f"{'x'.join(map(str, QUICK_SHAPE['cpu']))} and fp32 only on the CPU) and fewer "
                        "samples, unless --rows, --hidden, --dtypes or --reps say otherwise")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--json", metavar="PATH", help="write every measurement to this file")
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device")
    quick_rows, quick_hidden = QUICK_SHAPE[device]
    row_counts = args.rows or ([quick_rows] if args.quick else [4096, 16384])
    hidden = args.hidden or ([quick_hidden] if args.quick else [2048, 4096, 8192])
    dtypes = args.dtypes or (["fp32"] if args.quick and device == "cpu" else ["bf16", "fp32"])
    reps = args.reps or (QUICK_REPS[device] if args.quick else 20)
    shapes = {n: [(r, h) for h in (hidden if args.hidden or args.quick else OPS[n].lengths or hidden)
                  for r in row_counts] for n in args.ops}
    result = run(args.ops, shapes, list(dict.fromkeys(DTYPES[d] for d in dtypes)), args.impls, reps, device,
                 args.json, progress=lambda line: print(line, flush=True))
    report(result)
    if args.json:
        write_text(args.json, json.dumps(result, indent=1) + "\n")
        print(f"json     {args.json}")
    return 0

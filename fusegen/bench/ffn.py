"""User-level benchmarks: a transformer FFN block's training step with a fused
activation, and the gated activations alone against Liger Kernel.

    fusegen bench ffn [--tokens 8192] [--dim 1024] [--hidden 4096] [--dtypes fp32,bf16] [--json out.json]
                      [--impls fusegen,eager,functional,compile,liger] [--directions fwd+bwd] [--reps 20]

`block`: x (tokens, dim) -> Linear(dim, hidden, or 2*hidden for the gated ones) ->
activation -> Linear(hidden, dim); one step is the forward and the backward of every
weight and of x (torch.autograd.grad with a given output gradient, no optimizer). GELU
(tanh form) on the hidden tensor; SwiGLU `a*sigmoid(a)*b` and GeGLU `gelu_tanh(a)*b` on
`a, b = u.chunk(2, -1)`, the strided halves of the first Linear's output, as LLMs write it.

`activation`: the gated activation alone, forward+backward (with `--directions
fwd,fwd+bwd` the forward too), on (tokens, hidden) halves, with `a`, `b` as separate
tensors and as `u.chunk(2, -1)` of one (the gradient then flows into `u`).

Implementations: fusegen (the activation fused; the Linears are PyTorch's), eager (the
activation written with torch ops as the expression reads), functional (PyTorch's own
activation kernels: F.gelu(approximate="tanh"), F.silu(a) * b, a stronger baseline than
eager), torch.compile of the eager block or chunk + activation, and Liger Kernel's LigerSiLUMulFunction / LigerGELUMulFunction where it is
installed (CUDA only). Medians of CUDA events after warm-up (perf_counter on the CPU).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json

import torch
import torch.nn.functional as F

from fusegen.bench.core import DIRECTIONS, DTYPES, SEEDS, device_info, dtype_name, timed_ms
from fusegen.bench.peers import configure_compile, failure, optional_module
from fusegen.files import write_text

GELU = SEEDS["gelu_tanh"]
# activation -> (fusegen expression, eager as the expression reads, functional, gated)
ACTIVATIONS = {
    "gelu": (GELU, lambda h: 0.5 * h * (1 + torch.tanh(0.7978845608 * (h + 0.044715 * h * h * h))),
             lambda h: F.gelu(h, approximate="tanh"), False),
    "swiglu": ("a*sigmoid(a)*b", lambda a, b: a * torch.sigmoid(a) * b, lambda a, b: F.silu(a) * b, True),
    "geglu": ("0.5*a*(1+tanh(0.7978845608*(a+0.044715*a*a*a)))*b",
              lambda a, b: 0.5 * a * (1 + torch.tanh(0.7978845608 * (a + 0.044715 * a * a * a))) * b,
              lambda a, b: F.gelu(a, approximate="tanh") * b, True),
}
LIGER = {"swiglu": ("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"),
         "geglu": ("liger_kernel.ops.geglu", "LigerGELUMulFunction")}
IMPLS = ("fusegen", "eager", "functional", "compile", "liger")
BLOCKS = ("gelu", "swiglu")
GATED = ("swiglu", "geglu")
LAYOUTS = ("separate", "chunk")


def _liger(name: str, device: str):
    """Liger Kernel's autograd Function for a gated activation, or the reason it is absent."""
    if device != "cuda":
        return None, "needs CUDA"
    module, attr = LIGER[name]
    found = optional_module(module)
    if found is None or not hasattr(found, attr):
        return None, "liger_kernel is not installed (pip install liger-kernel)"
    return getattr(found, attr).apply, None


def activations(ops, name: str, device: str, wanted):
    """impl -> the activation as a function of the hidden tensor (ungated) or of (a, b),
    and impl -> why it is missing. torch.compile is not among them: it compiles the whole
    block or step around the eager activation (`around`), as a user would."""
    _, eager, functional, _ = ACTIVATIONS[name]
    chosen = {"fusegen": ops[name], "eager": eager, "functional": functional}
    liger, why = _liger(name, device) if name in LIGER else (None, None)  # Liger has no plain GELU
    if liger is not None:
        chosen["liger"] = liger
    skipped = {"liger": why} if why and "liger" in wanted else {}
    return {k: v for k, v in chosen.items() if k in wanted}, skipped


def block(act, gated: bool):
    """The FFN block around an activation: Linear, activation (of the chunk halves when
    gated), Linear."""
    def forward(x, w1, b1, w2, b2):
        u = F.linear(x, w1, b1)
        return F.linear(act(*u.chunk(2, -1)) if gated else act(u), w2, b2)
    return forward


def _weights(tokens, dim, hidden, gated, dtype, device):
    up = 2 * hidden if gated else hidden
    x = torch.randn(tokens, dim, dtype=dtype, device=device)
    params = [torch.randn(up, dim, dtype=dtype, device=device) * dim ** -0.5, torch.zeros(up, dtype=dtype, device=device),
              torch.randn(dim, hidden, dtype=dtype, device=device) * hidden ** -0.5,
              torch.zeros(dim, dtype=dtype, device=device)]
    return [t.requires_grad_() for t in [x] + params]


def _split_then(act, split):
    return lambda *leaves: act(*split(*leaves))


def _step(forward, tensors, g):
    return lambda: torch.autograd.grad(forward(*tensors), tensors, g)


def _halves(tokens, hidden, layout, dtype, device):
    """(the leaves the gradient is taken of, a function giving (a, b) from them)."""
    if layout == "separate":
        leaves = [torch.randn(tokens, hidden, dtype=dtype, device=device).requires_grad_() for _ in range(2)]
        return leaves, lambda a, b: (a, b)
    u = torch.randn(tokens, 2 * hidden, dtype=dtype, device=device).requires_grad_()
    return [u], lambda u: u.chunk(2, -1)


def run(tokens, dim, hidden, dtypes, wanted, directions, reps, device, out_json):
    from fusegen.api import fuse_many

    print(f"fusegen bench ffn on {device}: tokens {tokens}, dim {dim}, hidden {hidden}, "
          f"{', '.join(map(dtype_name, dtypes))}", flush=True)
    names = list(ACTIVATIONS)
    ops = dict(zip(names, fuse_many([ACTIVATIONS[n][0] for n in names])))
    configure_compile(False, 1)
    result = {"device": device_info(device), "tokens": tokens, "dim": dim, "hidden": hidden,
              "float32_matmul_precision": torch.get_float32_matmul_precision(),
              "liger_kernel": _version("liger-kernel"), "reps": reps, "rows": [], "skipped": []}
    rows, skipped = result["rows"], result["skipped"]
    for dtype in dtypes:
        where = {"dtype": dtype_name(dtype)}
        for name in BLOCKS:
            gated = ACTIVATIONS[name][3]
            tensors = _weights(tokens, dim, hidden, gated, dtype, device)
            g = torch.randn(tokens, dim, dtype=dtype, device=device)
            acts, missing = activations(ops, name, device, wanted)
            skipped += [{**where, "case": f"block {name}", "impl": k, "reason": v} for k, v in missing.items()]
            impls = {k: block(a, gated) for k, a in acts.items()}
            if "compile" in wanted:  # the whole block compiled
                impls["compile"] = torch.compile(block(ACTIVATIONS[name][1], gated))
            for impl, forward in impls.items():
                _measure(rows, skipped, {**where, "case": f"block {name}", "direction": "fwd+bwd", "impl": impl},
                         _step(forward, tensors, g), reps, device)
            del tensors, g
        for name in GATED:
            acts, missing = activations(ops, name, device, wanted)
            skipped += [{**where, "case": f"{name} alone", "impl": k, "reason": v} for k, v in missing.items()]
            for layout in LAYOUTS:
                leaves, split = _halves(tokens, hidden, layout, dtype, device)
                g = torch.randn(tokens, hidden, dtype=dtype, device=device)
                impls = {impl: _split_then(act, split) for impl, act in acts.items()}
                if "compile" in wanted:  # the chunk too: inductor may fuse it with the activation
                    impls["compile"] = torch.compile(_split_then(ACTIVATIONS[name][1], split))
                for impl, forward in impls.items():
                    case = {**where, "case": f"{name} alone", "layout": layout, "impl": impl}
                    detached = [t.detach() for t in leaves]
                    calls = {"fwd": lambda: forward(*detached), "fwd+bwd": _step(forward, leaves, g)}
                    for direction in directions:
                        _measure(rows, skipped, {**case, "direction": direction}, calls[direction], reps, device)
                del leaves, g
        if device == "cuda":
            torch.cuda.empty_cache()
        if out_json:  # after each dtype: a run cut short keeps what it measured
            write_text(out_json, json.dumps(result, indent=1))
    _report(rows, skipped, result)
    return result


def _measure(rows, skipped, key, fn, reps, device):
    try:
        ms = timed_ms(fn, reps, device)
    except Exception as err:  # a peer failing (OOM, a Triton or compile error): reported, the run goes on
        skipped.append({**key, "reason": failure(err)})
        return
    rows.append({**key, "ms": ms})


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _report(rows, skipped, result):
    from fusegen.bench.report import table

    device = result["device"]
    print(f"{device['name']} ({device['kind']}), torch {device['torch']}, Liger Kernel "
          f"{result['liger_kernel'] or 'not installed'}; tokens {result['tokens']}, dim {result['dim']}, hidden "
          f"{result['hidden']}; fp32 matmul precision {result['float32_matmul_precision']}; median ms of {result['reps']}")
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    keys = list(dict.fromkeys((r["case"], r.get("layout", "-"), r["dtype"], r["direction"]) for r in rows))
    cell = {(r["case"], r.get("layout", "-"), r["dtype"], r["direction"], r["impl"]): r["ms"] for r in rows}

    def line(key):
        times = {i: cell[key + (i,)] for i in impls if key + (i,) in cell}
        peers = {i: t for i, t in times.items() if i != "fusegen"}
        best = min(peers, key=peers.get) if peers else None
        ratio = f"{times['fusegen'] / peers[best]:.2f} ({best})" if best and "fusegen" in times else "-"
        speedup = f"{times['eager'] / times['fusegen']:.2f}x" if {"eager", "fusegen"} <= set(times) else "-"
        return list(key) + [f"{times[i]:.3f}" if i in times else "-" for i in impls] + [ratio, speedup]

    table("ms per call; fusegen / the best peer; eager / fusegen",
           ["case", "layout", "dtype", "direction"] + impls + ["fusegen / best peer", "speedup over eager"],
           [line(k) for k in keys])
    reasons: dict[tuple, list] = {}
    for s in skipped:
        reasons.setdefault((s["impl"], s["reason"]), []).append(f"{s['case']} {s['dtype']}")
    for (impl, reason), where in reasons.items():
        print(f"skipped  {impl} ({', '.join(dict.fromkeys(where))}): {reason}")


def main(argv) -> int:
    from fusegen.bench.core import name_list

    p = argparse.ArgumentParser(prog="fusegen bench ffn", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtypes", type=name_list("dtype", DTYPES), default="fp32,bf16")
    p.add_argument("--impls", type=name_list("implementation", IMPLS), default=",".join(IMPLS))
    p.add_argument("--directions", type=name_list("direction", DIRECTIONS), default="fwd+bwd",
                   help="of the activations alone: fwd+bwd (default), fwd or both (the block is always fwd+bwd)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtypes = list(dict.fromkeys(DTYPES[d] for d in args.dtypes))
    run(args.tokens, args.dim, args.hidden, dtypes, args.impls, args.directions, args.reps, device, args.json)
    return 0

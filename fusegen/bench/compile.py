"""Benchmark of fusion across a fused op under torch.compile (decompose.py).

    python -m fusegen.bench.compile                       # GPU if present: tokens 8192, 1024 -> 4096
    python -m fusegen.bench.compile --device cpu          # smoke run at small sizes
    python -m fusegen.bench.compile --json out.json       # also write every row

The block is `linear -> fused activation -> residual add` (`act(x @ W.T + b) + r`; SwiGLU:
the linear's output split into gate and up halves, `silu(gate) * up`), in four forms: the
fused op called eagerly (no compile, for scale), and torch.compile(fullgraph=True) of the
block with the op opaque, with the op decomposed, and of the plain PyTorch expression.
Per activation and dtype (fp32, bf16): the forward (of the training graph: inputs and
weights require grad) and the forward+backward (gradients of x, W, b and r), as medians of
CUDA events (perf_counter on the CPU); the fusegen ops that ran in one compiled step
(profiler; 0 is what decompose must give); and the largest difference from the compiled
PyTorch expression (over the output and the gradients, each relative to its largest value). One op per activation (its mode set before each compile), one compile
per form, activation and dtype (12 in all).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from fusegen.bench.core import timed_ms
from fusegen.files import write_text

GELU = "0.5*x*(1+tanh(0.7978845608*(x+0.044715*x*x*x)))"


def _gelu(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def _swiglu(gate, up):
    return gate * torch.sigmoid(gate) * up


# name -> (expression, eager expression, linear output width per hidden unit)
ACTIVATIONS = {"gelu_tanh": (GELU, _gelu, 1), "swiglu": ("gate*sigmoid(gate)*up", _swiglu, 2)}
# form -> (the activation: the fused op or the PyTorch expression, the op's mode, compiled)
FORMS = {"fused op, eager": ("op", None, False), "compile: opaque op": ("op", "opaque", True),
         "compile: decomposed op": ("op", "decompose", True),
         "compile: PyTorch expression": ("expression", None, True)}


def _block(act, halves: int):
    if halves == 1:
        return lambda x, w, b, r: act(F.linear(x, w, b)) + r
    return lambda x, w, b, r: act(*F.linear(x, w, b).chunk(2, dim=-1)) + r


def _inputs(tokens, width, hidden, halves, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(tokens, width), (halves * hidden, width), (halves * hidden,), (tokens, hidden)]
    scale = [1.0, width ** -0.5, 1.0, 1.0]  # pre-activations of order 1
    return [(torch.randn(s, generator=g, device=device, dtype=torch.float32) * k).to(dtype).requires_grad_(True)
            for s, k in zip(shapes, scale)]


def _fusegen_ops_in(step) -> int:
    """The fusegen ops one call of `step` runs (the profiler's op events named fusegen::...;
    CPU activity only: the ops, not the kernels they launch)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return sum(e.name.startswith("fusegen::") for e in prof.events())


def run(device: str, tokens: int, width: int, hidden: int, acts, dtypes, reps: int, out_json: str | None):
    import fusegen

    ops = dict(zip(acts, fusegen.fuse_many([dict(expr=ACTIVATIONS[a][0], name=f"bench_compile_{a}") for a in acts])))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}; "
          f"block: act(linear(x)) + r, tokens {tokens}, width {width} -> {hidden}")
    rows = []
    started = time.perf_counter()
    for a in acts:
        expr, eager, halves = ACTIVATIONS[a]
        for dtype in dtypes:
            xs = _inputs(tokens, width, hidden, halves, dtype, device)
            results = {}
            for form, (which, mode, compiled) in FORMS.items():
                block = _block(ops[a] if which == "op" else eager, halves)
                if mode is not None:
                    fusegen.fuse(expr, name=ops[a].name, compile=mode)  # the built op: sets its mode
                if compiled:
                    torch._dynamo.reset()  # one code object, many closures, and the mode: trace anew
                    block = torch.compile(block, fullgraph=True, dynamic=False)
                t = time.perf_counter()
                out = block(*xs)
                grads = torch.autograd.grad(out, xs, torch.ones_like(out))
                if device == "cuda":
                    torch.cuda.synchronize()
                first_s = time.perf_counter() - t  # the compile, for a compiled form

                def step(block=block):
                    out = block(*xs)
                    return torch.autograd.grad(out, xs, torch.ones_like(out))

                results[form] = dict(
                    forward_ms=timed_ms(lambda block=block: block(*xs), reps, device, warm=5),
                    forward_backward_ms=timed_ms(step, reps, device, warm=5),
                    fusegen_ops=_fusegen_ops_in(step), first_call_s=first_s, out=[out, *grads])
            want = results["compile: PyTorch expression"]["out"]
            base = results["compile: PyTorch expression"]
            print(f"\n{a}, {str(dtype).removeprefix('torch.')}")
            print("| form | forward ms | forward+backward ms | speed vs compiled PyTorch (fwd, fwd+bwd) "
                  "| fusegen ops in a step | max diff / max | first call s |")
            print("|---|---|---|---|---|---|---|")
            for form, r in results.items():
                diff = max(((o.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30)).item()
                           for o, w in zip(r.pop("out"), want))
                print(f"| {form} | {r['forward_ms']:.3f} | {r['forward_backward_ms']:.3f} | "
                      f"{base['forward_ms'] / r['forward_ms']:.2f}x, {base['forward_backward_ms'] / r['forward_backward_ms']:.2f}x | "
                      f"{r['fusegen_ops']} | {diff:.2e} | {r['first_call_s']:.1f} |")
                rows.append(dict(activation=a, dtype=str(dtype), form=form, max_rel_diff=diff, **r))
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if out_json:
        meta = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    tokens=tokens, width=width, hidden=hidden, reps=reps)
        write_text(out_json, json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fusegen.bench.compile", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, help="rows of x (default 8192 on the GPU, 256 on the CPU)")
    p.add_argument("--width", type=int, help="the linear's input width (default 1024; CPU 64)")
    p.add_argument("--hidden", type=int, help="the activation's width (default 4096; CPU 256)")
    p.add_argument("--acts", default=",".join(ACTIVATIONS), help="comma-separated: " + ", ".join(ACTIVATIONS))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    acts = args.acts.split(",")
    unknown = [a for a in acts if a not in ACTIVATIONS]
    if unknown:
        p.error(f"--acts: unknown {unknown}; expected some of {list(ACTIVATIONS)}")
    dtypes = [getattr(torch, d, None) for d in args.dtypes.split(",")]
    if not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
        p.error(f"--dtypes: expected floating dtypes such as float32,bfloat16, got {args.dtypes!r}")
    run(args.device, args.tokens or (8192 if gpu else 256), args.width or (1024 if gpu else 64),
        args.hidden or (4096 if gpu else 256), acts, dtypes, args.reps, args.json)


if __name__ == "__main__":
    main()

"""Benchmarks: fusegen against eager PyTorch, torch.compile and jiterator.

    python -m fusegen.bench                    # the mission's expressions, GPU if present
    python -m fusegen.bench --json out.json    # also write every row
    python -m fusegen.bench build              # build latency (fusegen/bench_build.py)
    python -m fusegen.bench cpu                # CPU kernels vs eager, compile, numexpr (bench_layouts.py)
    python -m fusegen.bench layouts            # broadcast/strided/channels_last/SwiGLU (bench_layouts.py)
    python -m fusegen.bench gp                 # a gradient-penalty training step vs eager

Same method as shared/anchors/anchor_bench.py: 1-D tensors, CUDA-event medians, % of
the measured device-to-device copy rate, host microseconds per call at n = 4096. Also
used by `fusegen --bench` for a single op.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from .files import write_text

# name -> (expression, eager function, tensors moved by ideal fused fwd, by fwd+bwd)
MISSION = {
    "fma": ("a*b+c", lambda a, b, c: a * b + c, 4, 9),
    "addmul": ("(x+y)*w", lambda x, y, w: (x + y) * w, 4, 11),
    "relu_add": ("relu(x+y)", lambda x, y: torch.relu(x + y), 3, 7),
    "silu": ("x*sigmoid(x)", lambda x: x * torch.sigmoid(x), 2, 5),
    "gelu_tanh": ("0.5*x*(1+tanh(0.7978845608*(x+0.044715*x*x*x)))",
                  lambda x: 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x))), 2, 5),
}
JITERATOR = {
    "fma": "template <typename T> T fma(T a, T b, T c) { return a * b + c; }",
    "addmul": "template <typename T> T addmul(T x, T y, T w) { return (x + y) * w; }",
    "relu_add": "template <typename T> T relu_add(T x, T y) { T z = x + y; return z > T(0) ? z : T(0); }",
    "silu": "template <typename T> T silu(T x) { return x / (T(1) + exp(-x)); }",
    "gelu_tanh": "template <typename T> T gelu_tanh(T x) { return T(0.5) * x * (T(1) + "
                 "tanh(T(0.7978845608) * (x + T(0.044715) * x * x * x))); }",
}


def timed_ms(fn, reps: int, device: str, warm: int = 5) -> float:
    """Median milliseconds of one call: CUDA events on the GPU, perf_counter on the CPU."""
    for _ in range(warm):
        fn()
    if device != "cuda":
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us(fn, device: str, calls: int = 2000) -> float:
    """Wall microseconds per call of back-to-back calls: dispatch and launch overhead."""
    for _ in range(20):
        fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t) / calls * 1e6


def copy_gbs(device: str) -> float:
    n = 1 << 28 if device == "cuda" else 1 << 24
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), 20, device)
    return 2 * n * 4 / ms / 1e6


def fwd_bwd(f, xs, g):
    return lambda: torch.autograd.grad(f(*xs), xs, g)


def bench_op(op, n: int | None = None) -> list[str]:
    """Fused vs eager for one FusedOp, forward and forward+backward (for `fusegen --bench`)."""
    from .reference import evaluate_text

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = n or (1 << 24 if device == "cuda" else 1 << 20)
    spec = op.spec
    xs = [torch.rand(n, device=device) + 0.1 for _ in spec.inputs]
    scalars = [0.5] * len(spec.scalars)

    def eager(*ts):
        return evaluate_text(spec.text, dict(zip(spec.inputs + spec.scalars, list(ts) + scalars)))

    def fused(*ts):
        return op.op(*ts, *scalars)

    xg = [x.clone().requires_grad_(True) for x in xs]
    g = torch.randn(n, device=device)
    lines = []
    for label, f in (("fusegen", fused), ("eager", eager)):
        fwd = timed_ms(lambda: f(*xs), 20, device)
        fb = timed_ms(fwd_bwd(f, xg, g), 20, device)
        lines.append(f"{label:8s} {device} n={n}: forward {fwd:.3f} ms, forward+backward {fb:.3f} ms (median)")
    return lines


def run(sizes, dtypes, with_compile: bool, out_json: str | None):
    import fusegen
    from fusegen.api import Request, fuse_many

    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device {name}; torch {torch.__version__}; cuda {torch.version.cuda}; fusegen {fusegen.__version__}")
    t = time.perf_counter()
    ops = dict(zip(MISSION, fuse_many([Request(e, name=f"bench_{k}") for k, (e, *_) in MISSION.items()])))
    print(f"built/loaded {len(ops)} ops in {time.perf_counter() - t:.1f} s")
    copy = copy_gbs(device)
    print(f"copy rate {copy:.0f} GB/s (bytes read + written)")
    rows = []

    def record(**row):
        rows.append(row)

    for key, (expr, f, fwd_tensors, fb_tensors) in MISSION.items():
        k = len(ops[key].spec.inputs)
        fused = ops[key].op
        jit = torch.cuda.jiterator._create_jit_fn(JITERATOR[key]) if device == "cuda" else None
        for dtype in dtypes:
            es = torch.tensor([], dtype=dtype).element_size()
            for n in sizes:
                xs = [torch.randn(n, device=device, dtype=dtype) for _ in range(k)]
                xg = [x.clone().requires_grad_(True) for x in xs]
                g = torch.randn(n, device=device, dtype=dtype)
                reps = 50 if n <= (1 << 24) else 15
                impls = {"fusegen": fused, "eager": f}
                if with_compile:
                    impls["compile"] = torch.compile(f, dynamic=False)
                for impl, fn in impls.items():
                    ms = timed_ms(lambda: fn(*xs), reps, device)
                    record(kind="fwd", expr=key, dtype=str(dtype)[6:], n=n, impl=impl, ms=ms,
                           pct_copy=100 * fwd_tensors * n * es / ms / 1e6 / copy)
                    ms = timed_ms(fwd_bwd(fn, xg, g), reps, device)
                    record(kind="fwd+bwd", expr=key, dtype=str(dtype)[6:], n=n, impl=impl, ms=ms,
                           pct_copy=100 * fb_tensors * n * es / ms / 1e6 / copy)
                if jit is not None and dtype == torch.float32:
                    ms = timed_ms(lambda: jit(*xs), reps, device)
                    record(kind="fwd", expr=key, dtype="float32", n=n, impl="jiterator", ms=ms,
                           pct_copy=100 * fwd_tensors * n * es / ms / 1e6 / copy)
                if n == 4096 and dtype == torch.float32:
                    host = {f"{i} fwd": host_us(lambda: fn(*xs), device) for i, fn in impls.items()}
                    host.update({f"{i} fwd+bwd": host_us(fwd_bwd(fn, xg, g), device, 500) for i, fn in impls.items()})
                    if jit is not None:
                        host["jiterator fwd"] = host_us(lambda: jit(*xs), device)
                    for impl, us in host.items():
                        record(kind="host_us", expr=key, dtype="float32", n=n, impl=impl, us=us)
    if out_json:
        write_text(out_json, json.dumps({"device": name, "copy_gbs": copy, "rows": rows}, indent=1))
    _print_summary(rows, max(sizes))
    return rows


def _print_summary(rows, n_big):
    print(f"\nn = {n_big}: median ms (% of copy rate)")
    keys = sorted({(r["kind"], r["expr"], r["dtype"]) for r in rows if r.get("n") == n_big and "ms" in r},
                  key=lambda k: (k[2], k[0], list(MISSION).index(k[1])))
    for kind, expr, dtype in keys:
        cells = [f'{r["impl"]} {r["ms"]:.3f} ({r["pct_copy"]:.0f}%)' for r in rows
                 if (r["kind"], r["expr"], r["dtype"], r.get("n")) == (kind, expr, dtype, n_big) and "ms" in r]
        print(f"{kind:8s} {expr:10s} {dtype:9s} " + " | ".join(cells))
    host = [r for r in rows if r["kind"] == "host_us"]
    if host:
        print("\nhost us/call at n=4096, fp32")
        for expr in MISSION:
            cells = [f'{r["impl"]} {r["us"]:.1f}' for r in host if r["expr"] == expr]
            print(f"{expr:10s} " + " | ".join(cells))


# -- a gradient-penalty training step (double backward through fused activations) ------------

GP_ACTIVATIONS = {"silu": "x*sigmoid(x)", "gelu_tanh": MISSION["gelu_tanh"][0]}


class GradientPenaltyMLP:
    """A small MLP (Linear, silu, Linear, gelu-tanh, Linear) trained with its mean output
    plus a gradient penalty (WGAN-GP / R1 style: (|d out / d x| - 1)^2), whose backward is
    a double backward through both activations. `silu`, `gelu`: the activations (FusedOps
    or eager functions). One `step(x)` is forward, input-gradient with create_graph,
    penalty, backward again and an SGD step."""

    def __init__(self, silu, gelu, width=16, features=8, device="cpu", dtype=torch.float64, seed=0):
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(features, width), torch.nn.Linear(width, width), torch.nn.Linear(width, 1)]
        self.params = [p.to(device=device, dtype=dtype).detach().requires_grad_()
                       for layer in layers for p in layer.parameters()]
        self.silu, self.gelu = silu, gelu
        self.opt = torch.optim.SGD(self.params, lr=0.05)

    def step(self, x):
        x = x.detach().requires_grad_()
        w1, b1, w2, b2, w3, b3 = self.params
        h = self.gelu(self.silu(x @ w1.T + b1) @ w2.T + b2)
        out = h @ w3.T + b3
        (dx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = out.mean() + 10.0 * ((dx.norm(dim=1) - 1) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.detach()


def run_gp(batch: int, width: int, dtypes, out_json: str | None):
    """Median ms of one gradient-penalty step, fusegen activations against eager."""
    import fusegen

    device = "cuda" if torch.cuda.is_available() else "cpu"
    silu = fusegen.fuse(GP_ACTIVATIONS["silu"], name="bench_gp_silu")
    gelu = fusegen.fuse(GP_ACTIVATIONS["gelu_tanh"], name="bench_gp_gelu_tanh")
    eager = (MISSION["silu"][1], MISSION["gelu_tanh"][1])
    rows = []
    for dtype in dtypes:
        x = torch.randn(batch, 64, device=device, dtype=dtype)
        models = {impl: GradientPenaltyMLP(s, g, width=width, features=64, device=device, dtype=dtype)
                  for impl, (s, g) in (("fusegen", (silu, gelu)), ("eager", eager))}
        medians = {impl: [] for impl in models}
        for _ in range(3):  # interleaved rounds: a machine whose load changes hits both alike
            for impl, model in models.items():
                medians[impl].append(timed_ms(lambda: model.step(x), 10, device))
        for impl, ms_list in medians.items():
            ms = min(ms_list)
            rows.append({"kind": "gp_step", "impl": impl, "dtype": str(dtype)[6:], "batch": batch,
                         "width": width, "ms": ms})
            print(f"gp step {impl:8s} {str(dtype)[6:]:9s} batch {batch} width {width}: {ms:.3f} ms "
                  "(best of 3 interleaved medians)")
    if out_json:
        write_text(out_json, json.dumps({"device": device, "rows": rows}, indent=1))
    return rows


def main(argv=None):
    import sys
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build"]:  # build latency: fusegen/bench_build.py
        from . import bench_build
        return bench_build.main(argv[1:])
    if argv[:1] in (["cpu"], ["layouts"]):
        from . import bench_layouts
        return bench_layouts.main(argv)
    if argv[:1] == ["gp"]:  # gradient-penalty training step
        p = argparse.ArgumentParser(description="a gradient-penalty training step, fusegen vs eager")
        p.add_argument("--batch", type=int, default=4096)
        p.add_argument("--width", type=int, default=4096)
        p.add_argument("--dtypes", default="float32")
        p.add_argument("--json", help="write all rows to this file")
        args = p.parse_args(argv[1:])
        return run_gp(args.batch, args.width, [getattr(torch, d) for d in args.dtypes.split(",")], args.json)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4096,1048576,134217728",
                   help="comma-separated element counts (default: 2^12, 2^20, 2^27)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--json", help="write all rows to this file")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    run(sizes, dtypes, not args.no_compile, args.json)


if __name__ == "__main__":
    main()

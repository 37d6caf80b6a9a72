"""`fusegen bench optim`: one optimizer step over the parameters of a 1.1B-parameter Llama
(TinyLlama's shapes: 201 tensors), fusegen's optimizers against PyTorch's best.

    fusegen bench optim [--quick] [--setups bf16,fp32] [--optimizers adamw,lion,adan]
                        [--impls fusegen,torch-fused,torch-foreach,foreach,compile] [--json out.json]

Setups: `bf16` (bf16 params and grads, fp32 optimizer state: what mixed-precision training
keeps) and `fp32` (everything fp32). Implementations:

- fusegen: fusegen.optim.AdamW / Lion / Adan (one fused step op per dtype group);
- torch-fused, torch-foreach: torch.optim.AdamW(fused=True) and (foreach=True), AdamW only;
  they keep the state in the params' dtype (bf16 in the bf16 setup: fewer bytes moved);
- foreach: the update written with torch._foreach_* ops (fp32 state; in the bf16 setup the
  grads and params go through fp32 copies, as such an implementation must);
- compile: torch.compile of the same update as a loop of tensor ops, every hyper-parameter
  a 0-d device tensor; `recompiles` counts the graphs dynamo compiled while the LR changed
  three times after warm-up (torch._dynamo's counters).

Each row: the median ms of one step (CUDA events, steps back to back) with its spread, the
bytes an ideal implementation of that state layout moves (each param, grad and state tensor
read once, each updated one written once) and that as a % of a device-to-device copy rate
measured in the same run. `--quick`: a 2-layer model of the same structure, 39M params.
Without CUDA the bench runs a smaller 2-layer list (2.4M params) on the CPU (perf_counter
timing), which shows the CPU kernels, not GPU figures. The full run compiles a 201-tensor
step per optimizer and setup for the `compile` rows (minutes each): `--setups bf16` and
`--setups fp32` split it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from fusegen.bench.core import _Copies, device_info, dtype_name, name_list, rotating_times, spread_pct
from fusegen.bench.peers import configure_compile, failure
from fusegen.files import write_text

# TinyLlama-1.1B: vocab 32000, dim 2048, MLP 5632, 22 layers, 4 KV heads of 64.
LLAMA = dict(vocab=32000, dim=2048, hidden=5632, layers=22, kv=256)
# --quick: 2 layers, 39M params (0.9 GB moved per AdamW step, well beyond L2); on the CPU 2.4M.
QUICK = dict(vocab=8000, dim=1024, hidden=2816, layers=2, kv=256)
CPU_QUICK = dict(vocab=2000, dim=256, hidden=704, layers=2, kv=64)
SETUPS = {"bf16": torch.bfloat16, "fp32": torch.float32}
OPTIMIZERS = ("adamw", "lion", "adan")
IMPLS = ("fusegen", "fusegen-narrow", "torch-fused", "torch-foreach", "foreach", "compile")
TORCH_ONLY = {"torch-fused": "adamw", "torch-foreach": "adamw"}  # impl -> the optimizer it exists for
HYPER = {"adamw": dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
         "lion": dict(lr=1e-5, betas=(0.9, 0.99), weight_decay=1.0),
         "adan": dict(lr=1e-4, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.02, no_prox=False)}
STATES = {"adamw": 2, "lion": 1, "adan": 4}  # state tensors per param
LR_CHANGES = (3e-5, 2e-5, 1e-5)
COPY_CAP = 1 << 31  # the copy rate is measured on at most 2 GiB: bandwidth is flat beyond


def llama_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a Llama: embedding and output head, per layer the
    attention's q, k, v, o, the MLP's gate, up, down and two RMSNorm weights, a final norm."""
    d, h, kv = config["dim"], config["hidden"], config["kv"]
    shapes = [("embed", (config["vocab"], d))]
    for i in range(config["layers"]):
        shapes += [(f"l{i}.q", (d, d)), (f"l{i}.k", (kv, d)), (f"l{i}.v", (kv, d)), (f"l{i}.o", (d, d)),
                   (f"l{i}.gate", (h, d)), (f"l{i}.up", (h, d)), (f"l{i}.down", (d, h)),
                   (f"l{i}.attn_norm", (d,)), (f"l{i}.mlp_norm", (d,))]
    return shapes + [("norm", (d,)), ("head", (config["vocab"], d))]


def make_params(shapes, dtype, device):
    """Leaf params and their grads (small random values: every step changes every param)."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for _, shape in shapes:
        p = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)
        p.requires_grad_()
        p.grad = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 1e-3).to(dtype)
        params.append(p)
    return params


def moved_bytes(params, states: int, state_dtype) -> int:
    """An ideal step: param read and written, grad read, each state read and written."""
    es_state = torch.empty((), dtype=state_dtype).element_size()
    return sum(p.numel() * (3 * p.element_size() + 2 * states * es_state) for p in params)


# -- the foreach implementations --------------------------------------------------------------

class ForeachStep:
    """An optimizer step written with torch._foreach_* ops, fp32 state; `lr` can be changed."""

    def __init__(self, name: str, params, hyper: dict):
        self.name, self.params, self.hyper, self.t = name, params, dict(hyper), 0
        self.state = [[torch.zeros_like(p, dtype=torch.float32) for p in params] for _ in range(STATES[name])]
        if name == "adan":
            self.state[3] = [p.grad.float() for p in params]
        self.mixed = any(p.dtype != torch.float32 for p in params)

    @torch.no_grad()
    def step(self):
        self.t += 1
        ps = [p.float() for p in self.params] if self.mixed else list(self.params)
        gs = [p.grad.float() for p in self.params] if self.mixed else [p.grad for p in self.params]
        getattr(self, "_" + self.name)(ps, gs, self.t, **self.hyper)
        if self.mixed:
            torch._foreach_copy_(list(self.params), ps)

    def _adamw(self, ps, gs, t, lr, betas, eps, weight_decay):
        (b1, b2), (ms, vs) = betas, self.state
        torch._foreach_mul_(ps, 1 - lr * weight_decay)
        torch._foreach_lerp_(ms, gs, 1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, (1 - b2 ** t) ** 0.5)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(ps, ms, denom, value=-lr / (1 - b1 ** t))

    def _lion(self, ps, gs, t, lr, betas, weight_decay):
        (b1, b2), (ms,) = betas, self.state
        c = torch._foreach_lerp(ms, gs, 1 - b1)
        torch._foreach_sign_(c)
        torch._foreach_add_(c, ps, alpha=weight_decay)
        torch._foreach_add_(ps, c, alpha=-lr)
        torch._foreach_lerp_(ms, gs, 1 - b2)

    def _adan(self, ps, gs, t, lr, betas, eps, weight_decay, no_prox):
        (b1, b2, b3), (ms, ds, ns, gps) = betas, self.state
        diff = torch._foreach_sub(gs, gps)
        torch._foreach_lerp_(ms, gs, 1 - b1)
        torch._foreach_lerp_(ds, diff, 1 - b2)
        u = torch._foreach_add(gs, diff, alpha=b2)
        torch._foreach_mul_(ns, b3)
        torch._foreach_addcmul_(ns, u, u, value=1 - b3)
        denom = torch._foreach_sqrt(ns)
        torch._foreach_div_(denom, (1 - b3 ** t) ** 0.5)
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(ms, 1 - b1 ** t)
        torch._foreach_add_(update, ds, alpha=b2 / (1 - b2 ** t))
        torch._foreach_div_(update, denom)
        if no_prox:
            torch._foreach_mul_(ps, 1 - lr * weight_decay)
            torch._foreach_add_(ps, update, alpha=-lr)
        else:
            torch._foreach_add_(ps, update, alpha=-lr)
            torch._foreach_div_(ps, 1 + lr * weight_decay)
        torch._foreach_copy_(gps, gs)

    def set_lr(self, lr: float):
        self.hyper["lr"] = lr


# -- the compiled implementations -------------------------------------------------------------

def _adamw_tensor(p, g, m, v, t, lr, b1, b2, eps, wd):
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    p.mul_(1 - lr * wd)
    p.sub_(lr / (1 - b1 ** t) * m / (v.sqrt() / (1 - b2 ** t).sqrt() + eps))


def _lion_tensor(p, g, m, t, lr, b1, b2, wd):
    c = (b1 * m + (1 - b1) * g).sign()
    p.sub_(lr * (c + wd * p))
    m.lerp_(g, 1 - b2)


def _adan_tensor(p, g, m, d, n, gp, t, lr, b1, b2, b3, eps, wd):
    diff = g - gp
    u = g + b2 * diff
    m.lerp_(g, 1 - b1)
    d.lerp_(diff, 1 - b2)
    n.mul_(b3).addcmul_(u, u, value=1 - b3)
    update = (m / (1 - b1 ** t) + b2 * d / (1 - b2 ** t)) / (n.sqrt() / (1 - b3 ** t).sqrt() + eps)
    p.copy_((p - lr * update) / (1 + lr * wd))
    gp.copy_(g)


class CompiledStep:
    """torch.compile of a loop over the params of the update in tensor ops (fp32 math, the
    param rounded once into its dtype); the step count and every hyper-parameter are 0-d
    fp32 device tensors, filled in place, so a new LR needs no new graph."""

    def __init__(self, name: str, params, hyper: dict, device: str):
        self.foreach = ForeachStep(name, params, hyper)  # the same state layout and values
        self.name, self.params = name, params

        def scalar(x):
            return torch.tensor(float(x), dtype=torch.float32, device=device)
        h = hyper
        betas = [scalar(b) for b in h["betas"]]
        self.lr, self.t = scalar(h["lr"]), scalar(0)
        extra = [scalar(h[k]) for k in ("eps", "weight_decay") if k in h]  # the rules' last parameters
        self.scalars = [self.t, self.lr, *betas, *extra]
        rule = {"adamw": _adamw_tensor, "lion": _lion_tensor, "adan": _adan_tensor}[name]

        def update(params, grads, states, scalars):
            for i, (p, g) in enumerate(zip(params, grads)):
                if p.dtype == torch.float32:
                    rule(p, g.float(), *(s[i] for s in states), *scalars)
                else:  # the update in fp32, rounded into the param once
                    p32 = p.float()
                    rule(p32, g.float(), *(s[i] for s in states), *scalars)
                    p.copy_(p32)
        self.compiled = torch.compile(update)

    @torch.no_grad()
    def step(self):
        self.t.add_(1)
        self.compiled(self.params, [p.grad for p in self.params], self.foreach.state, self.scalars)

    def set_lr(self, lr: float):
        self.lr.fill_(lr)


# -- the run ----------------------------------------------------------------------------------

def _make(impl: str, name: str, params, device: str):
    """(a step callable, set_lr callable, the state's dtype) of one implementation."""
    import fusegen.optim as optim

    hyper = HYPER[name]
    if impl in ("fusegen", "fusegen-narrow"):  # state in float32, or (narrow) in the params' dtype as torch's
        narrow = impl == "fusegen-narrow"
        opt = {"adamw": optim.AdamW, "lion": optim.Lion, "adan": optim.Adan}[name](
            params, **hyper, **({"state_dtype": None} if narrow else {}))
        return opt.step, lambda lr: opt.param_groups[0].__setitem__("lr", lr), \
            params[0].dtype if narrow else torch.float32
    if impl in TORCH_ONLY:
        opt = torch.optim.AdamW(params, **hyper, **{impl.removeprefix("torch-"): True})
        return opt.step, lambda lr: opt.param_groups[0].__setitem__("lr", lr), params[0].dtype
    runner = ForeachStep(name, params, hyper) if impl == "foreach" else CompiledStep(name, params, hyper, device)
    return runner.step, runner.set_lr, torch.float32


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def run(config: dict, setups, optimizers, impls, device: str, budget_s: float, out_json: str | None) -> dict:
    import fusegen

    shapes = llama_shapes(config)
    if "compile" in impls:
        configure_compile(False, 1)
    result = {"fusegen_bench_optim": 1, "device": device_info(device), "fusegen": fusegen.__version__,
              "config": config, "tensors": len(shapes), "params": sum(_numel(s) for _, s in shapes),
              "budget_s": budget_s, "rows": [], "skipped": [], "copy": []}
    copies = _Copies(device, 0, budget_s)
    print(f"fusegen bench optim on {result['device'].get('name', device)} ({device}): {len(shapes)} tensors, "
          f"{result['params'] / 1e9:.3f}B params; setups {', '.join(setups)}", flush=True)
    for setup in setups:
        dtype = SETUPS[setup]
        params = make_params(shapes, dtype, device)
        for name in optimizers:
            for impl in impls:
                if TORCH_ONLY.get(impl, name) != name:
                    continue
                key = {"setup": setup, "param_dtype": dtype_name(dtype), "optimizer": name, "impl": impl}
                try:
                    row = _measure(impl, name, params, device, budget_s, copies)
                except Exception as err:  # a peer failing (OOM, a compile error): reported, the run goes on
                    result["skipped"].append({**key, "reason": failure(err)})
                    print(f"skipped  {setup} {name} {impl}: {failure(err)}", flush=True)
                else:
                    result["rows"].append({**key, **row})
                    print(f"{setup:5s} {name:6s} {impl:14s} {row['ms']:.3f} ms ±{row['spread_pct']:.0f}% "
                          f"{row['pct_copy']:.0f}% of copy", flush=True)
                finally:
                    if device == "cuda":
                        torch.cuda.empty_cache()
                if out_json:
                    _store(result, copies, out_json)
        del params
    _store(result, copies, out_json)
    return result


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _store(result, copies, out_json):
    result["copy"] = [{"bytes": b, "ms": ms, "spread_pct": copies.spread[b]} for b, ms in sorted(copies.ms.items())]
    if out_json:
        write_text(out_json, json.dumps(result, indent=1))


def _measure(impl, name, params, device, budget_s, copies) -> dict:
    start = time.perf_counter()
    step, set_lr, state_dtype = _make(impl, name, params, device)
    step()  # the first step: state created, compiled
    if device == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    times = rotating_times(lambda: step(), [()] * (3 if device == "cuda" else 1), device, budget_s,
                           min_samples=5, max_samples=20)
    recompiles = None
    if impl == "compile":
        before = _dynamo_graphs()
        for lr in LR_CHANGES:
            set_lr(lr)
            step()
        recompiles = _dynamo_graphs() - before
    nbytes = moved_bytes(params, STATES[name], state_dtype)
    ms = statistics.median(times)
    copy_bytes = min(nbytes, COPY_CAP)
    copy_ms = copies.time(copy_bytes) * nbytes / copy_bytes  # the copy rate, at this byte count
    return {"ms": ms, "spread_pct": spread_pct(times), "samples": len(times), "bytes": nbytes,
            "gbs": nbytes / ms / 1e6, "pct_copy": 100 * copy_ms / ms, "state_dtype": dtype_name(state_dtype),
            "first_step_s": first_s, "recompiles": recompiles}


def report(result: dict):
    from fusegen.bench.report import table, with_spread

    device = result["device"]
    print(f"\n{device.get('name', device['kind'])} ({device['kind']}), torch {device['torch']}, fusegen "
          f"{result['fusegen']}: {result['tensors']} tensors, {result['params'] / 1e9:.3f}B params")
    rows = result["rows"]
    best = {}
    for r in rows:
        if not r["impl"].startswith("fusegen"):
            k = (r["setup"], r["optimizer"])
            best[k] = min(best.get(k, float("inf")), r["ms"])

    def vs(r):
        k = (r["setup"], r["optimizer"])
        if not r["impl"].startswith("fusegen") or k not in best:
            return "-"
        return f"{r['ms'] / best[k]:.2f}"

    table("ms per optimizer step (median ±spread), GB/s and % of copy of the bytes it moves; "
          "fusegen / best PyTorch",
          ["setup", "optimizer", "impl", "state", "ms", "GB/s", "% of copy", "first step s", "recompiles",
           "fusegen / best"],
          [[r["setup"], r["optimizer"], r["impl"], r["state_dtype"], with_spread(r["ms"], r["spread_pct"]),
            f"{r['gbs']:.0f}", f"{r['pct_copy']:.0f}", f"{r['first_step_s']:.2f}",
            "-" if r["recompiles"] is None else str(r["recompiles"]), vs(r)] for r in rows])
    for s in result["skipped"]:
        print(f"skipped  {s['setup']} {s['optimizer']} {s['impl']}: {s['reason']}")


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="fusegen bench optim", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 2-layer model of the same structure (39M params)")
    p.add_argument("--setups", type=name_list("setup", SETUPS), default=",".join(SETUPS))
    p.add_argument("--optimizers", type=name_list("optimizer", OPTIMIZERS), default=",".join(OPTIMIZERS))
    p.add_argument("--impls", type=name_list("implementation", IMPLS), default=",".join(IMPLS))
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help="seconds of timed samples per row (default 1; 0.2 with --quick)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--json", metavar="PATH", help="write every row to this file")
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("fusegen: error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    quick = args.quick or device == "cpu"
    if device == "cpu" and not args.quick:
        print("fusegen bench optim: no CUDA device: the --quick parameter list on the CPU", flush=True)
    budget = args.budget if args.budget is not None else (0.2 if quick else 1.0)
    config = LLAMA if not quick else QUICK if device == "cuda" else CPU_QUICK
    result = run(config, args.setups, args.optimizers, args.impls, device, budget, args.json)
    report(result)
    if args.json:
        print(f"json     {args.json}")
    return 0

"""`fusegen bench`: fusegen against eager PyTorch, torch.compile, jiterator and CuPy.

    fusegen bench                              # the seed ops, fp32/bf16/fp16, 2^12..2^28 (CPU: ..2^20)
    fusegen bench "a*b+c" "x*tanh(x)"          # any expressions
    fusegen bench --quick --json b.json --plot b.png   # also: python -m fusegen.bench
    fusegen bench ffn                          # the FFN block and SwiGLU/GeGLU (ffn.py)
    fusegen bench build | cpu | layouts | gp   # build latency, CPU kernels, layouts, gradient penalty
    fusegen bench compile                      # fusion across a fused op under torch.compile (compile.py)

For each expression, dtype and size: the median time of one call, forward and
forward+backward (`torch.autograd.grad` of every input), of each implementation
(peers.py), with CUDA events after warm-up. Small sizes would sit in L2 between
calls, so each timed sample runs the call over a rotation of input sets that together hold
more than twice the L2 cache. Beside each time: the effective bandwidth (the bytes an ideal
fused kernel moves, `moved_tensors`, over the time) as a % of a device-to-device copy of
the same bytes timed the same way, and the time relative to the best peer. Host
microseconds per call at n = 4096, forward and forward+backward, against the cheapest
PyTorch calls (`x*2`; `x*2` and `torch.autograd.grad`) measured in the same run. On a
machine without CUDA everything runs on the CPU (no jiterator or CuPy), which the tests use.
Each median is printed with its spread (half the interquartile range, as a % of the
median), and figures that cannot be right (faster than a copy of the same bytes by a
margin, a time near zero, a wide spread: a loaded machine) are listed as warnings.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from fusegen.bench.peers import FORWARD_ONLY, IMPLS, Impl, build_impls, configure_compile, failure, optional_module
from fusegen.files import write_text

# The seed ops, benchmarked when no expression is given: label -> expression.
SEEDS = {
    "fma": "a*b+c",
    "addmul": "(x+y)*w",
    "relu_add": "relu(x+y)",
    "silu": "x*sigmoid(x)",
    "gelu_tanh": "0.5*x*(1+tanh(0.7978845608*(x+0.044715*x*x*x)))",
}
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}
DIRECTIONS = ("fwd", "fwd+bwd")
HOST_N = 4096            # host overhead is measured at this size, where launch costs dominate
HOST_TARGET = 1.15       # target: fusegen's host time per call at most this times PyTorch's floor
DEFAULT_SIZES = {"cuda": "2^12..2^28", "cpu": "2^12..2^20"}
# --quick: every 16x instead of every 4x; on the CPU also fp32 only, up to 2^20, and a
# shorter timing budget: 1-2 minutes on 2 cores (torch.compile's compiles are most of it),
# where the 1 GiB tensors of 2^28 took over half an hour.
QUICK_SIZES = {"cuda": "2^12..2^28:16", "cpu": "2^12..2^20:16"}
QUICK_DTYPES = {"cuda": None, "cpu": "fp32"}   # None: the --dtypes default
QUICK_BUDGET = {"cuda": 0.04, "cpu": 0.02}
DEFAULT_DTYPES = "fp32,bf16,fp16"
L2_MULTIPLE = 2          # a rotation of input sets holds this many times the L2 cache
MAX_SETS = 64


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- timing -----------------------------------------------------------------------------------

def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def _sample_ms(call, sets, device: str) -> float:
    """One sample: `call` over every set back to back, milliseconds per call."""
    if device != "cuda":
        t = time.perf_counter()
        for args in sets:
            call(*args)
        return (time.perf_counter() - t) * 1e3 / len(sets)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for args in sets:
        call(*args)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / len(sets)


def timed_ms(fn, reps: int, device: str, warm: int = 5, calls: int = 10) -> float:
    """Median milliseconds of one call: CUDA events on the GPU, perf_counter on the CPU.
    On the GPU a sample is `calls` calls back to back, as a training loop makes them: the
    GPU's time, not a lone call's host time before its first kernel (with one call between
    the events, torch.compile's ~60 us of Python before its launch counted as GPU time,
    and an NCHW bf16 forward of 61 us of kernel measured 0.131 ms)."""
    for _ in range(warm):
        fn()
    _sync(device)
    sets = [()] * (calls if device == "cuda" else 1)
    return statistics.median(_sample_ms(fn, sets, device) for _ in range(reps))


def rotating_times(call, sets, device: str, budget_s: float, min_samples: int = 5,
                   max_samples: int = 30) -> list[float]:
    """Every sample's ms per call: one warm-up pass over the sets, then as many samples as
    fit in about `budget_s` seconds, within [min_samples, max_samples]."""
    _sample_ms(call, sets, device)  # warm-up: caches, allocator, autotuning, lazy compiles
    _sync(device)
    first = _sample_ms(call, sets, device)
    per_sample = first * len(sets) / 1e3
    count = int(min(max_samples, max(min_samples, budget_s / max(per_sample, 1e-9))))
    return [first] + [_sample_ms(call, sets, device) for _ in range(count - 1)]


def rotating_ms(call, sets, device: str, budget_s: float, min_samples: int = 5,
                max_samples: int = 30) -> tuple[float, int]:
    """(median ms per call, samples) of rotating_times."""
    times = rotating_times(call, sets, device, budget_s, min_samples, max_samples)
    return statistics.median(times), len(times)


def spread_pct(times) -> float:
    """How far the samples scatter: half their interquartile range as a % of their median
    (robust to one slow sample; 0 for fewer than two samples)."""
    times = list(times)
    if len(times) < 2:
        return 0.0
    median = statistics.median(times)
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return 100 * (q3 - q1) / 2 / median if median > 0 else math.inf


def quick_plan(device: str) -> dict:
    """What --quick measures on a device: sizes, dtypes (None: the --dtypes default) and the
    timing budget per measurement."""
    return {"sizes": parse_sizes(QUICK_SIZES[device]), "dtypes": QUICK_DTYPES[device],
            "budget_s": QUICK_BUDGET[device]}


def host_us(fn, device: str, calls: int = 2000) -> float:
    """Wall microseconds per call of back-to-back calls: dispatch and launch overhead."""
    for _ in range(20):
        fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / calls * 1e6


def host_median_us(fn, device: str, calls: int, repeats: int = 3) -> float:
    return statistics.median(host_us(fn, device, calls) for _ in range(repeats))


def paired_host_us(fn, floor, device: str, calls: int, pairs: int) -> tuple[list[float], list[float]]:
    """(fn's, floor's) µs per call of `pairs` batches each, run alternately (floor first in
    every other pair), so that a slow spell of a busy machine lands on both sides of a pair
    instead of deciding one figure: the ratio to the floor is then the median of the pairs'."""
    times = {fn: [], floor: []}
    for i in range(pairs):
        for f in ((fn, floor) if i % 2 else (floor, fn)):
            times[f].append(host_us(f, device, calls))
    return times[fn], times[floor]


def l2_bytes(device: str) -> int:
    """The L2 cache of the current GPU (0 on the CPU: no rotation there)."""
    if device != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 50 << 20))


def rotation(set_bytes: int, l2: int) -> int:
    """How many input sets a sample cycles through so that they do not fit in L2."""
    return max(1, min(MAX_SETS, math.ceil(L2_MULTIPLE * l2 / max(set_bytes, 1))))


def fwd_bwd(f, xs, g):
    return lambda: torch.autograd.grad(f(*xs), xs, g)


def _grad_call(forward):
    """forward+backward over one set (inputs..., incoming gradient)."""
    def call(*args):
        return torch.autograd.grad(forward(*args[:-1]), args[:-1], args[-1])
    return call


def bench_op(op, n: int | None = None) -> list[str]:
    """Fused vs eager for one FusedOp, forward and forward+backward (for `fusegen --bench`)."""
    from fusegen.tools.reference import evaluate_text

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


# -- what is measured -------------------------------------------------------------------------

@dataclass
class Case:
    """One expression: its label in the tables, its text, the FusedOp and the tensors of n
    elements an ideal fused implementation moves, per direction."""

    label: str
    text: str
    op: object
    tensors: dict


def moved_tensors(spec) -> dict[str, int]:
    """Tensors of n elements an ideal fused implementation reads and writes: the forward
    reads each input and writes the output; the backward reads the incoming gradient and
    the inputs its gradients use, and writes each distinct gradient once (a gradient that
    is the incoming one is returned as it is, for free). fma: 4 and 4 + 5."""
    kernel = [g for g in spec.gradients if not g.passthrough]
    used = {s.name for g in kernel for s in g.expr.free_symbols} & set(spec.inputs)
    backward = 1 + len(used) + len({g.expr for g in kernel}) if kernel else 0
    forward = len(spec.inputs) + 1
    return {"fwd": forward, "fwd+bwd": forward + backward}


def make_cases(exprs) -> list[Case]:
    """The seed ops, or the given expressions (a seed's text keeps its label), built into
    one library in one compiler run."""
    from fusegen.api import Request, fuse_many

    labels = {text: label for label, text in SEEDS.items()}
    chosen = list(SEEDS.values()) if not exprs else list(dict.fromkeys(exprs))
    ops = fuse_many([Request(text) for text in chosen])
    return [Case(labels.get(text, text), text, op, moved_tensors(op.spec)) for text, op in zip(chosen, ops)]


def parse_sizes(text: str) -> list[int]:
    """'4096,1048576', '2^12,2^20', or a range 'A..B' (powers of 4 from A to B) or
    'A..B:K' (every K-fold): element counts, in the order given."""
    def number(item: str) -> int:
        item = item.strip()
        try:
            if "^" in item:
                base, exponent = item.split("^")
                return int(base) ** int(exponent)
            return int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a size like 4096 or 2^12, got {item!r}") from None

    sizes = []
    for item in text.split(","):
        if ".." in item:
            low, _, rest = item.partition("..")
            high, _, step = rest.partition(":")
            n, high, factor = number(low), number(high), number(step) if step else 4
            if factor < 2:
                raise argparse.ArgumentTypeError(f"the step of {item!r} must be at least 2")
            while n <= high:
                sizes.append(n)
                n *= factor
        else:
            sizes.append(number(item))
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return list(dict.fromkeys(sizes))


def name_list(kind: str, table):
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in items if t not in table]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"unknown {kind} {', '.join(unknown) or repr(text)}; "
                                             f"expected some of {', '.join(table)}")
        return items
    return parse


class _Copies:
    """Device-to-device copies of a byte count, timed like the ops (the reference of `% of
    copy`), each count once."""

    def __init__(self, device: str, l2: int, budget_s: float):
        self.device, self.l2, self.budget = device, l2, budget_s
        self.ms: dict[int, float] = {}
        self.spread: dict[int, float] = {}  # spread_pct of each copy's samples

    def time(self, nbytes: int) -> float:
        """Milliseconds to copy nbytes (read nbytes / 2, write nbytes / 2)."""
        if nbytes not in self.ms:
            half = max(nbytes // 2, 1)
            sets = [(torch.empty(half, dtype=torch.uint8, device=self.device),
                     torch.empty(half, dtype=torch.uint8, device=self.device))
                    for _ in range(rotation(nbytes, self.l2))]
            times = rotating_times(lambda dst, src: dst.copy_(src), sets, self.device, self.budget)
            self.ms[nbytes], self.spread[nbytes] = statistics.median(times), spread_pct(times)
        return self.ms[nbytes]


def _random_sets(count: int, k: int, n: int, dtype, device: str):
    return [[torch.randn(n, dtype=dtype, device=device) for _ in range(k)] for _ in range(count)]


def run(cases, dtypes, sizes, wanted, directions, device: str, static: bool, budget_s: float,
        host: bool, out_json: str | None, progress) -> dict:
    """Every measurement of the comparison; returns (and writes to out_json after each
    dtype and expression, so a run cut short keeps what it measured) the result dict."""
    import fusegen

    if "compile" in wanted:
        configure_compile(static, len(sizes))
    l2 = l2_bytes(device)
    result = {
        "fusegen_bench": 1,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_info(device),
        "fusegen": fusegen.__version__,
        "settings": {"sizes": sizes, "dtypes": [dtype_name(d) for d in dtypes], "impls": list(wanted),
                     "directions": list(directions), "compile": "static" if static else "dynamic",
                     "budget_s": budget_s, "l2_bytes": l2, "l2_multiple": L2_MULTIPLE},
        "peers": {"cupy": getattr(optional_module("cupy"), "__version__", None) if device == "cuda" else None},
        "exprs": [{"label": c.label, "expr": c.text, "op": c.op.name, "inputs": list(c.op.entry.inputs),
                   "tensors": c.tensors} for c in cases],
        "rows": [], "skipped": [], "copy": [], "host": None,
    }
    runner = _Runner(device, l2, budget_s, wanted, directions, static, progress, result["rows"], result["skipped"])
    host_rows = []
    floors = _floors(device) if host else {}  # the floor's calls, timed in pairs with each row's
    for dtype in dtypes:  # dtype by dtype: a run cut short has every expression of the first ones
        for case in cases:
            impls = runner.case(case, dtype, sorted(sizes, reverse=True))
            if host and not any(r["expr"] == case.label for r in host_rows):
                host_rows.extend(_host_rows(case, impls, dtype, device, directions, floors))
            result["copy"] = [{"bytes": b, "ms": ms, "spread_pct": runner.copies.spread[b]}
                              for b, ms in sorted(runner.copies.ms.items())]
            result["summary"] = summarize(result["rows"])
            if host:
                result["host"] = _host_result(floors, host_rows, device)
            if out_json:
                write_text(out_json, json.dumps(result, indent=1))
    return result


@dataclass
class _Runner:
    """The timed measurements of one run, appended to `rows`; what could not run, with the
    reason, to `skipped`."""

    device: str
    l2: int
    budget_s: float
    wanted: list
    directions: list
    static: bool
    progress: object
    rows: list
    skipped: list

    def __post_init__(self):
        self.copies = _Copies(self.device, self.l2, self.budget_s)
        self.failed: set = set()  # (expr, dtype, impl, direction) that raised: not tried at other sizes
        self.planned = [(d, i) for d in self.directions for i in self.wanted if d == "fwd" or i not in FORWARD_ONLY]

    def case(self, case, dtype, sizes) -> dict:
        """Every size (the largest first: torch.compile's first call sizes its kernels) of one
        expression and dtype; returns the implementations that ran."""
        where = {"expr": case.label, "dtype": dtype_name(dtype)}
        impls, missing = build_impls(case.op, case.text, dtype, self.device, self.wanted, self.static)
        self.skipped.extend({**where, "impl": name, "reason": why} for name, why in missing.items())
        k, es = len(case.op.entry.inputs), torch.empty((), dtype=dtype).element_size()
        for n in sizes:
            count = rotation((k + 1) * n * es, self.l2)
            try:
                inputs = _random_sets(count, k, n, dtype, self.device)
                grads = [torch.randn(n, dtype=dtype, device=self.device) for _ in range(count)]
            except torch.cuda.OutOfMemoryError as err:
                self.skipped.append({**where, "n": n, "impl": "*", "reason": failure(err)})
                self.progress.advance(f"{case.label} n={n}: out of memory", len(self.planned))
                continue
            for direction, name in self.planned:
                key = {**where, "n": n, "direction": direction, "impl": name}
                if name in impls and (case.label, key["dtype"], name, direction) not in self.failed:
                    self.one(key, impls[name], inputs, grads, case.tensors[direction] * n * es)
                self.progress.advance(f"{case.label} {key['dtype']} n={n} {name} {direction}")
            del inputs, grads
            _release(self.device)
        return impls

    def one(self, key: dict, impl, inputs, grads, nbytes: int):
        try:
            if key["direction"] == "fwd":
                call, sets = impl.forward, [impl.prepare(s) for s in inputs]
            else:
                call = _grad_call(impl.forward)
                sets = [[x.detach().requires_grad_() for x in s] + [g] for s, g in zip(inputs, grads)]
            times = rotating_times(call, sets, self.device, self.budget_s)
            ms, samples = statistics.median(times), len(times)
            copy_ms = self.copies.time(nbytes) if nbytes else None
        except Exception as err:  # OOM, a peer failing: reported, the run goes on
            self.skipped.append({**key, "reason": failure(err)})
            if not isinstance(err, torch.cuda.OutOfMemoryError):  # a compile error would repeat at every size
                self.failed.add((key["expr"], key["dtype"], key["impl"], key["direction"]))
            _release(self.device)
            return
        self.rows.append({**key, "ms": ms, "gbs": nbytes / ms / 1e6 if nbytes and ms > 0 else None,
                          "pct_copy": 100 * copy_ms / ms if copy_ms and ms > 0 else None, "samples": samples,
                          "spread_pct": spread_pct(times),
                          "calls_per_sample": len(sets)})


def _release(device: str):
    if device == "cuda":
        torch.cuda.empty_cache()


def device_info(device: str) -> dict:
    info = {"kind": device, "torch": torch.__version__, "cuda": torch.version.cuda}
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    else:
        import platform
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


# -- host overhead ----------------------------------------------------------------------------

HOST_CALLS = {"fwd": 500, "fwd+bwd": 150}  # calls per batch
HOST_PAIRS = 7                              # batches of each implementation, each paired with one of the floor's


def _floors(device: str) -> dict:
    """PyTorch's cheapest calls at HOST_N, by direction: `x*2`, and `x*2` with
    torch.autograd.grad (callables, timed in pairs with each implementation's)."""
    x = torch.randn(HOST_N, device=device)
    xg = x.detach().requires_grad_()
    g = torch.randn(HOST_N, device=device)
    return {"fwd": lambda: x * 2, "fwd+bwd": lambda: torch.autograd.grad(xg * 2, xg, g)}


def _host_rows(case, impls, dtype, device: str, directions, floors) -> list[dict]:
    """Host µs per call at HOST_N of each implementation, and of torch.ops.fusegen.<name>
    called directly (`fusegen.op`: the op without FusedOp's Python binding), each in
    HOST_PAIRS batches alternated with batches of the floor (paired_host_us): `us` and
    `floor_us` are the medians of the batches, `vs_floor` the median of the pairs' ratios."""
    k = len(case.op.entry.inputs)
    xs = [torch.randn(HOST_N, dtype=dtype, device=device) for _ in range(k)]
    xg = [x.detach().requires_grad_() for x in xs]
    g = torch.randn(HOST_N, dtype=dtype, device=device)
    chosen = dict(impls)
    if "fusegen" in chosen:
        chosen = {"fusegen": chosen.pop("fusegen"), "fusegen.op": Impl("fusegen.op", case.op.op), **chosen}
    rows = []
    for name, impl in chosen.items():
        for direction in directions:
            if direction == "fwd+bwd" and name in FORWARD_ONLY:
                continue
            try:
                if direction == "fwd":
                    args = impl.prepare(xs)
                    fn = lambda: impl.forward(*args)  # noqa: E731
                else:
                    fn = lambda: torch.autograd.grad(impl.forward(*xg), xg, g)  # noqa: E731
                ours, floor = paired_host_us(fn, floors[direction], device, HOST_CALLS[direction], HOST_PAIRS)
            except Exception:  # already reported by the timed runs
                continue
            rows.append({"expr": case.label, "dtype": dtype_name(dtype), "impl": name, "direction": direction,
                         "us": statistics.median(ours), "floor_us": statistics.median(floor),
                         "vs_floor": statistics.median(a / b for a, b in zip(ours, floor)),
                         "samples_us": ours, "floor_samples_us": floor})
    return rows


def _host_result(floors, rows, device) -> dict:
    """The host part of the JSON: the rows, and per direction the floor, the median of every
    batch of it that ran paired with a row (measured alone when no row has that direction)."""
    floor_us = {}
    for direction, fn in floors.items():
        pooled = [us for r in rows if r["direction"] == direction for us in r["floor_samples_us"]]
        floor_us[direction] = statistics.median(pooled) if pooled else host_median_us(fn, device, HOST_CALLS[direction])
    return {"n": HOST_N, "device": device, "floor": {"fwd": {"what": "x*2", "us": floor_us["fwd"]},
                                                      "fwd+bwd": {"what": "x*2 and torch.autograd.grad",
                                                                  "us": floor_us["fwd+bwd"]}},
            "target": HOST_TARGET, "pairs": HOST_PAIRS, "rows": rows}


# -- ratios -----------------------------------------------------------------------------------

def summarize(rows) -> list[dict]:
    """Per expression, dtype, size and direction: fusegen's time, the best peer's, their
    ratio (below 1: fusegen is faster) and the speedup over each peer (peer time / fusegen's)."""
    groups: dict[tuple, dict[str, float]] = {}
    for r in rows:
        groups.setdefault((r["expr"], r["dtype"], r["n"], r["direction"]), {})[r["impl"]] = r["ms"]
    out = []
    for (expr, dtype, n, direction), times in groups.items():
        peers = {k: v for k, v in times.items() if k != "fusegen"}
        if "fusegen" not in times or not peers:
            continue
        best = min(peers, key=peers.get)
        out.append({"expr": expr, "dtype": dtype, "n": n, "direction": direction, "fusegen_ms": times["fusegen"],
                    "best_peer": best, "best_peer_ms": peers[best], "vs_best": _ratio(times["fusegen"], peers[best]),
                    "speedup": {k: _ratio(v, times["fusegen"]) for k, v in peers.items()}})
    return out


def _ratio(a: float, b: float) -> float:
    """a / b, infinite for a zero b (a broken timing is reported as implausible, not raised)."""
    return a / b if b > 0 else math.inf


# -- a gradient-penalty training step (double backward through fused activations) ------------

GP_ACTIVATIONS = {"silu": SEEDS["silu"], "gelu_tanh": SEEDS["gelu_tanh"]}
GP_EAGER = (lambda x: x * torch.sigmoid(x),
            lambda x: 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x))))


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
    eager = GP_EAGER
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


# -- the command ------------------------------------------------------------------------------

def _parser(subcommands):
    from fusegen.tools.console import Parser

    p = Parser(prog="fusegen bench", description=__doc__.splitlines()[0],
               epilog=f"subcommands: fusegen bench {{{','.join(subcommands)}}} ...; to bench an expression "
                      "spelled like one, write it in parentheses: fusegen bench \"(build)\"")
    p.add_argument("exprs", nargs="*", metavar="EXPR", help="expressions (default: the seed ops: "
                   + ", ".join(f"{k} {v}" for k, v in list(SEEDS.items())[:4]) + ", gelu_tanh)")
    p.add_argument("--dtypes", type=name_list("dtype", DTYPES), default=None,
                   help="comma-separated: fp32, bf16, fp16 (default: all three; fp32 with --quick on the CPU)")
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help="element counts: 4096,2^20 or a range 2^12..2^28 (powers of 4) or 2^12..2^28:16 "
                        f"(default: {DEFAULT_SIZES['cuda']} on CUDA, {DEFAULT_SIZES['cpu']} on the CPU)")
    p.add_argument("--impls", type=name_list("implementation", IMPLS), default=",".join(IMPLS),
                   help=f"comma-separated, of {','.join(IMPLS)} (default: all; those absent here are reported)")
    p.add_argument("--directions", type=name_list("direction", DIRECTIONS), default=",".join(DIRECTIONS),
                   help="fwd, fwd+bwd or both (default)")
    p.add_argument("--compile", choices=("dynamic", "static"), default="dynamic",
                   help="torch.compile with dynamic shapes, compiled once per expression and dtype at the "
                        "largest size (default), or static shapes, compiled again for every size (slow)")
    p.add_argument("--quick", action="store_true",
                   help=f"sizes {QUICK_SIZES['cuda']} on CUDA, {QUICK_SIZES['cpu']} and fp32 only on the CPU "
                        "(unless --sizes, --dtypes), and shorter timing: a few minutes on an H200, 1-2 "
                        "minutes on a 2-core CPU")
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help=f"seconds of timed samples per measurement (default 0.1; with --quick "
                        f"{QUICK_BUDGET['cuda']} on CUDA, {QUICK_BUDGET['cpu']} on the CPU)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--no-host", action="store_true", help=f"skip the host overhead at n = {HOST_N}")
    p.add_argument("--json", metavar="PATH", help="write every measurement to this file")
    p.add_argument("--plot", metavar="PNG", help="plot against size, one panel per expression, dtype and "
                   "direction (needs matplotlib: pip install 'fusegen[bench]')")
    p.add_argument("--plot-metric", choices=("bandwidth", "time"), default="bandwidth")
    p.add_argument("--report", metavar="JSON", help="measure nothing: print the tables (and --plot) of a JSON "
                   "that an earlier run wrote, even one cut short")
    return p


def bench_main(argv, subcommands=()) -> int:
    """`fusegen bench [EXPR ...]`; `subcommands`, the other first words (command.py), for --help."""
    from fusegen.bench import report as bench_report
    args = _parser(subcommands).parse_args(argv)
    if args.plot and bench_report.pyplot() is None:
        missing = "--plot needs matplotlib: pip install 'fusegen[bench]' (or pip install matplotlib)"
        if args.report:
            print(f"fusegen: error: {missing}", file=sys.stderr)
            return 2
        # measuring is what costs GPU time: do it, and say how to plot the JSON later
        print(f"fusegen bench: {missing}; measuring without the plot (then: fusegen bench --report "
              f"{args.json or 'the --json file'} --plot {args.plot})", file=sys.stderr)
        args.plot = None
    if args.report:
        try:
            result = json.loads(open(args.report, encoding="utf-8").read())
        except (OSError, ValueError) as err:
            print(f"fusegen: error: cannot read {args.report}: {err}", file=sys.stderr)
            return 2
    else:
        result = _measure(args)
        if result is None:
            return 2
    bench_report.print_report(result)
    if args.plot:
        bench_report.plot(result, args.plot, args.plot_metric)
        print(f"plot     {args.plot}")
    if args.json:
        print(f"json     {args.json}")
    return 0


def plan(args, device: str) -> tuple[list[int], list[str], float]:
    """(sizes, dtype names, budget per measurement) of a run: what was asked for, else the
    --quick plan or the defaults of the device."""
    quick = quick_plan(device) if args.quick else {}
    sizes = args.sizes or quick.get("sizes") or parse_sizes(DEFAULT_SIZES[device])
    dtypes = args.dtypes or name_list("dtype", DTYPES)(quick.get("dtypes") or DEFAULT_DTYPES)
    budget = args.budget if args.budget is not None else quick.get("budget_s", 0.1)
    return sizes, dtypes, budget


def _measure(args) -> dict | None:
    from fusegen.bench import report as bench_report
    from fusegen.tools.console import Progress
    from fusegen.errors import FusegenError

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("fusegen: error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return None
    sizes, dtype_names, budget = plan(args, device)
    dtypes = list(dict.fromkeys(DTYPES[d] for d in dtype_names))
    info = device_info(device)
    print(f"fusegen bench on {info['name']} ({device}), torch {info['torch']}: {len(args.exprs) or len(SEEDS)} "
          f"expression(s), {', '.join(map(dtype_name, dtypes))}, sizes {', '.join(map(str, sizes))}", flush=True)
    start = time.perf_counter()
    building = Progress.install()  # the build's progress lines, as `fusegen EXPR` shows them
    try:
        cases = make_cases(args.exprs)
    except FusegenError as err:
        print(f"fusegen: error: {str(err).removeprefix('fusegen: ')}", file=sys.stderr)
        return None
    finally:
        building.uninstall()
    print(f"fusegen bench: {len(cases)} op(s) built or loaded in {time.perf_counter() - start:.1f} s", flush=True)
    per_size = sum(1 for d in args.directions for i in args.impls if d == "fwd" or i not in FORWARD_ONLY)
    with bench_report.Progress(len(cases) * len(dtypes) * len(sizes) * per_size) as progress:
        result = run(cases, dtypes, sizes, args.impls, args.directions, device, args.compile == "static",
                     budget, not args.no_host, args.json, progress)
    result["seconds"] = time.perf_counter() - start
    if args.json:
        write_text(args.json, json.dumps(result, indent=1))
    return result

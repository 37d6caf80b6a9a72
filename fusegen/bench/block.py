"""One training step of a small Llama-style decoder, five ways: `fusegen bench block`.

    fusegen bench block [--layers 4] [--hidden 2048] [--heads 16] [--head-dim 128] [--mlp 5632]
                        [--vocab 32000] [--batch 4] [--seq 2048] [--steps 10] [--rounds 5] [--check-steps 20]
                        [--variants eager,compile,fusegen,fusegen+compile,liger] [--no-compile]
                        [--quick] [--device auto|cuda|cpu] [--json out.json]

The model is written here in plain PyTorch (no model library): a token embedding; decoder
layers of RMSNorm -> q, k, v projections -> RoPE on q and k ->
F.scaled_dot_product_attention(is_causal=True) -> o projection -> residual add -> RMSNorm ->
SwiGLU MLP (one gate_up projection whose output's `.chunk(2, -1)` halves are the gate and the
up, as ffn.py writes it; `silu(gate) * up`; the down projection) -> residual add; a final
RMSNorm; an untied LM head; cross-entropy of the next token, in float32 as Hugging Face's loss
computes it. Each residual add is done together with the RMSNorm that reads its sum (the
next layer's or the final one): the same arithmetic in every variant, written so that one op
can do both. One step is the forward, the backward and torch.optim.AdamW(fused=True).

Variants, each its own model with the same initial weights, all trained on one batch (the
same at every step, so that the loss falls and its curve follows the gradients):

- eager: PyTorch ops; F.rms_norm, Hugging Face's `q*cos + rotate_half(q)*sin` with
  full-width tables, `F.silu(gate) * up`, F.cross_entropy;
- compile: torch.compile of the eager model (its first step, which compiles, is a warm-up);
- fusegen: the eager model with fusegen ops for the memory-bound parts: `block_rms_norm`
  (`x * torch.rsqrt((x*x).mean(-1, keepdim=True) + eps) * w`, once, before the first
  layer), `block_add_rms_norm` (the residual add and the RMSNorm of its sum, two outputs),
  `block_rope` (rope.py's two-output op on `q.chunk(2, -1)`, with cos/sin half tables),
  `block_swiglu` (`a * torch.sigmoid(a) * b` on the gate_up halves) and
  `block_cross_entropy` (`torch.logsumexp(x, -1, keepdim=True) - x.gather(-1, label)` on the
  LM head's logits in the model's dtype, computed in float in its kernel, where eager casts
  the logits to float32 first; the mean over the tokens outside). Its RoPE rotates q and k
  in the projections' (batch, seq, heads, head_dim) layout, its tables broadcast as (seq, 1,
  head_dim / 2), and transposes them for the attention after it, where the other variants
  transpose first: the op's backward writes both halves' gradients into one contiguous
  tensor of q's shape (docs/architecture.md, "Chunk halves"), which in this layout is the
  projection's own, so its backward reads it as it is. Rotated after the transpose, q's
  gradient would come in the transposed layout and be copied back to the projection's, for
  q and k in every layer;
- fusegen+compile: torch.compile of the fusegen model (the fused ops decompose into ATen
  ops that Inductor fuses, fusegen's default under compile; FUSEGEN_COMPILE=opaque keeps
  their kernels);
- liger: the eager model with Liger Kernel's functional ops (liger_kernel.transformers.
  functional, whose names are the same from 0.5 to 0.8): liger_rms_norm after the plain
  residual add, liger_rope, liger_swiglu, and liger_fused_linear_cross_entropy in place of
  the LM head and the loss, as Liger's Llama patch trains: it never holds the (tokens, vocab)
  logits, which every other variant materializes. CUDA only (Triton); skipped with the
  reason where it is not installed. Its SwiGLU makes the strided gate_up halves contiguous
  before its kernel (a copy that separate gate and up projections would not need).

Times: CUDA events around each step (perf_counter on a CPU), the median over `--steps`
steps with the spread (half the interquartile range, % of the median), tokens per second, the
speed-up over eager, and the peak of allocated CUDA memory during the variant's check steps
(beyond what the models built before it hold). Before them, `--check-steps` steps (the
warm-up, compiles included) record each variant's loss curve from the same initial weights,
each step on a batch of its own (the same batches for every variant); the timed steps repeat
the first batch. Every variant's model stays resident until the end, and the timed steps run
in `--rounds` rounds of every variant in turn (the order rotating; an untimed step before
each variant's share, so that the host is ahead of the GPU as in training): a drift of the
GPU's clocks over the run, or a slow spell of the host, falls on every variant alike instead
of on the ones timed last.

Two checks, both against the eager model in float64 from the same weights (the rule torch's
own benchmark suite uses against a float64 reference: no worse than eager's rounding, give
or take). The gradients: after its timed steps, each variant's model goes back to the
initial weights and computes one forward and backward; each parameter's relative error
against float64's gradient (||g - g64|| / ||g64||) may be at most `GRAD_MULTIPLIER` times
eager's own error in the model's dtype, plus `GRAD_FLOOR`. The loss curve: the float64
model takes the same `--check-steps` steps; a curve's largest relative distance from
float64's may be at most `GRAD_MULTIPLIER` times eager's, plus `LOSS_FLOOR`. A batch per
step, not one batch repeated: over one batch the bf16 curves over-fit and part after a few
steps whatever computes them (eager's own distance from float64 was 0.11 in one run, 0.21
in another, and torch.compile's and Liger's curves failed the bound as often as fusegen's).
A fusegen variant that fails either check makes the exit status 1; a peer that fails is
marked in the table.

Without CUDA the default is a tiny model in float32 (CPU_CONFIG), so that a test can run
every variant; `--no-compile` leaves out the two torch.compile variants (on a 2-core CPU
their compiles take most of a minute) and says so in the skipped list.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fusegen.bench.core import DTYPES, device_info, dtype_name, name_list, spread_pct
from fusegen.bench.peers import configure_compile, failure, optional_module
from fusegen.bench.rope import ROPE, _tables, rotate_half
from fusegen.files import write_text

EPS = 1e-6
VARIANTS = ("eager", "compile", "fusegen", "fusegen+compile", "liger")
COMPILED = {"compile", "fusegen+compile"}
# The gradient check: a parameter's relative error against float64 may be this many times
# eager's own error, plus the floor (by dtype: where eager's error is near zero).
GRAD_MULTIPLIER = 2.0
GRAD_FLOOR = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-3, torch.float16: 1e-3}
# The loss-curve check: a curve's largest relative distance from float64's may be this many
# times eager's, plus the floor.
LOSS_FLOOR = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 1e-2}
OURS = {"fusegen", "fusegen+compile"}

FUSEGEN_OPS = (
    {"expr": "x * torch.rsqrt((x*x).mean(-1, keepdim=True) + eps) * w", "name": "block_rms_norm",
     "scalars": ["eps"]},
    {"expr": "h = x + r; (h, h * torch.rsqrt((h*h).mean(-1, keepdim=True) + eps) * w)",
     "name": "block_add_rms_norm", "scalars": ["eps"]},
    {"expr": ROPE, "name": "block_rope", "inputs": "x1,x2,c,s"},
    {"expr": "a * torch.sigmoid(a) * b", "name": "block_swiglu"},
    {"expr": "torch.logsumexp(x, -1, keepdim=True) - x.gather(-1, label)", "name": "block_cross_entropy",
     "inputs": "x,label"},
)


@dataclass(frozen=True)
class Config:
    layers: int
    hidden: int
    heads: int
    head_dim: int
    mlp: int
    vocab: int
    batch: int
    seq: int


CUDA_CONFIG = Config(layers=4, hidden=2048, heads=16, head_dim=128, mlp=5632, vocab=32000, batch=4, seq=2048)
QUICK_CONFIG = Config(layers=2, hidden=1024, heads=8, head_dim=128, mlp=2816, vocab=32000, batch=2, seq=1024)
CPU_CONFIG = Config(layers=2, hidden=64, heads=4, head_dim=16, mlp=128, vocab=256, batch=2, seq=32)
STEPS = {"cuda": 10, "cpu": 3}


@dataclass(frozen=True)
class Kernels:
    """What a variant computes the memory-bound parts with; the projections, the attention
    and the embedding are PyTorch's in every variant."""

    norm: Callable      # (x, w) -> rms_norm(x) * w
    add_norm: Callable  # (x, r, w) -> (x + r, rms_norm(x + r) * w)
    rope: Callable      # (q, k, model) -> q and k rotated, from the projections' (batch, seq, heads,
    #                     head_dim) to the attention's (batch, heads, seq, head_dim)
    swiglu: Callable    # (gate, up) -> silu(gate) * up
    loss: Callable      # (normed hidden, LM head weight, targets) -> mean cross-entropy


def eager_norm(x, w):
    return F.rms_norm(x, x.shape[-1:], w, EPS)


def eager_add_norm(x, r, w):
    h = x + r
    return h, eager_norm(h, w)


def eager_rope(q, k, model):
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = model.cos, model.sin
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def eager_swiglu(gate, up):
    return F.silu(gate) * up


def eager_loss(hidden, weight, targets):
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


EAGER = Kernels(eager_norm, eager_add_norm, eager_rope, eager_swiglu, eager_loss)


def fusegen_kernels() -> Kernels:
    """The fused ops, built into one library in one compiler run."""
    import fusegen

    norm_op, add_norm_op, rope_op, swiglu_op, loss_op = fusegen.fuse_many(FUSEGEN_OPS)

    def norm(x, w):
        return norm_op(x, w, eps=EPS)

    def add_norm(x, r, w):
        return add_norm_op(x, r, w, eps=EPS)

    def rope(q, k, model):  # before the transpose: module docstring
        c, s = model.cos_half[:, None], model.sin_half[:, None]  # (seq, 1, head_dim / 2): over the heads

        def rotated(x):
            return rope_op(*x.chunk(2, -1), c, s).transpose(1, 2)

        return rotated(q), rotated(k)

    def loss(hidden, weight, targets):  # the bf16 logits, computed in float in the kernel
        logits = F.linear(hidden, weight)
        return loss_op(logits.view(-1, logits.shape[-1]), targets.reshape(-1, 1)).float().mean()

    return Kernels(norm, add_norm, rope, swiglu_op, loss)


def liger_kernels(device: str):
    """Liger Kernel's ops, or the reason they cannot run here."""
    if device != "cuda":
        return None, "needs CUDA (Liger Kernel's ops are Triton kernels)"
    functional = optional_module("liger_kernel.transformers.functional")
    if functional is None:
        return None, "liger_kernel is not installed (pip install liger-kernel)"
    names = ("liger_rms_norm", "liger_rope", "liger_swiglu", "liger_fused_linear_cross_entropy")
    missing = [n for n in names if not hasattr(functional, n)]
    if missing:
        return None, f"liger_kernel {_version('liger-kernel')} has no {', '.join(missing)}"

    def norm(x, w):
        return functional.liger_rms_norm(x, w, EPS)

    def add_norm(x, r, w):
        h = x + r
        return h, norm(h, w)

    def rope(q, k, model):  # tables (1, seq, head_dim), as Hugging Face's rotary embedding gives them
        return functional.liger_rope(q.transpose(1, 2), k.transpose(1, 2), model.cos[None], model.sin[None])

    def loss(hidden, weight, targets):
        out = functional.liger_fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                          targets.reshape(-1))
        # the loss alone unless z-loss or accuracy is asked for; a tuple or an output
        # object in some releases
        return out[0] if isinstance(out, tuple) else getattr(out, "loss", out)

    return Kernels(norm, add_norm, rope, functional.liger_swiglu, loss), None


class Layer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        width = cfg.heads * cfg.head_dim
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden))
        self.q = nn.Linear(cfg.hidden, width, bias=False)
        self.k = nn.Linear(cfg.hidden, width, bias=False)
        self.v = nn.Linear(cfg.hidden, width, bias=False)
        self.o = nn.Linear(width, cfg.hidden, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden))
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.mlp, bias=False)
        self.down = nn.Linear(cfg.mlp, cfg.hidden, bias=False)


class Decoder(nn.Module):
    """The decoder, its memory-bound parts computed by `kernels`. forward(tokens, targets)
    returns the mean next-token loss."""

    def __init__(self, cfg: Config, kernels: Kernels):
        super().__init__()
        self.cfg, self.kernels = cfg, kernels
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden))
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        # RoPE's tables: the cos/sin halves (seq, head_dim / 2) and their full-width (seq,
        # head_dim) copies; buffers, so that .to() casts them with the weights
        c, s = _tables(cfg.seq, cfg.head_dim, torch.float32, "cpu")
        for name, table in (("cos_half", c), ("sin_half", s), ("cos", torch.cat((c, c), -1)),
                            ("sin", torch.cat((s, s), -1))):
            self.register_buffer(name, table, persistent=False)

    def forward(self, tokens, targets):
        k = self.kernels
        x = self.embed(tokens)
        h, n = x, k.norm(x, self.layers[0].attn_norm)
        for i, layer in enumerate(self.layers):
            h, n = k.add_norm(h, self._attention(layer, n), layer.mlp_norm)
            following = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
            h, n = k.add_norm(h, self._mlp(layer, n), following)
        return k.loss(n, self.head.weight, targets)

    def _attention(self, layer: Layer, x):
        batch, seq, _ = x.shape
        heads, dim = self.cfg.heads, self.cfg.head_dim
        q, k, v = (p(x).view(batch, seq, heads, dim) for p in (layer.q, layer.k, layer.v))
        q, k = self.kernels.rope(q, k, self)  # and to (batch, heads, seq, head_dim), before or after RoPE
        out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        return layer.o(out.transpose(1, 2).reshape(batch, seq, heads * dim))

    def _mlp(self, layer: Layer, x):
        gate, up = layer.gate_up(x).chunk(2, -1)
        return layer.down(self.kernels.swiglu(gate, up))


def initial_weights(cfg: Config, dtype, device: str, seed: int = 0) -> dict:
    """The weights every variant starts from: N(0, 0.02) matrices, unit norm weights."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Decoder(cfg, EAGER)
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    return {k: v.to(device=device, dtype=dtype) for k, v in model.state_dict().items()}


def batch(cfg: Config, device: str, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return data[:, :-1].contiguous().to(device), data[:, 1:].contiguous().to(device)


def batches(cfg: Config, device: str, count: int) -> list:
    """The check steps' batches, one a step (the module docstring says why)."""
    return [batch(cfg, device, seed=1 + i) for i in range(count)]


def _optimizer(params, lr: float):
    """AdamW with fused=True; the foreach form where this build has no fused kernel for the
    parameters' device and dtype (noted in the result)."""
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True), "fused"
    except (RuntimeError, ValueError) as err:
        return torch.optim.AdamW(params, lr=lr, foreach=True), f"foreach ({failure(err)})"


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass
class _Running:
    """A variant between its check steps and its gradient check: its model, its step, and
    its row as far as measured."""

    name: str
    model: nn.Module
    forward: Callable
    step: Callable  # one training step on the first batch
    row: dict


def start_variant(name: str, kernels: Kernels, cfg: Config, weights: dict, data: list, args,
                  device: str) -> _Running:
    """One variant's model from `weights` and the loss curve of `check_steps` steps (the
    warm-up), one batch of `data` each; its peak memory is counted from the memory in use
    before its model was built (other variants' models stay resident until their checks)."""
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    with torch.device(device):  # built where it runs: no host-side initialization of weights overwritten next
        model = Decoder(cfg, kernels).to(device=device, dtype=weights["embed.weight"].dtype)
    model.load_state_dict(weights)
    forward = torch.compile(model) if name in COMPILED else model
    optimizer, kind = _optimizer(list(model.parameters()), args.lr)

    def step(tokens, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = forward(tokens, targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    first = step(*data[0])
    _sync(device)
    first_s = time.perf_counter() - started
    losses = torch.stack([first] + [step(*b) for b in data[1:]]).float().tolist()
    row = {"variant": name, "first_step_s": first_s, "optimizer": kind, "losses": losses, "times": []}
    if device == "cuda":
        row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return _Running(name, model, forward, lambda: step(*data[0]), row)


def time_variants(running: list, args, device: str, failed: Callable) -> None:
    """The timed steps, `--rounds` rounds of every variant in turn, the order rotating each
    round: one untimed step (so that the host runs ahead of the GPU, as in training), then
    the variant's share of `--steps`. A drift of the GPU's clocks over the run falls on every
    variant alike, not on the ones timed last. A variant whose step fails leaves the rounds
    (`failed` reports it)."""
    rounds = max(1, min(args.rounds, args.steps))
    for i in range(rounds if running else 0):
        share = args.steps // rounds + (i < args.steps % rounds)
        for v in running[i % len(running):] + running[:i % len(running)]:
            try:
                v.row["times"] += _timed(v.step, share, device, untimed=1)
            except Exception as err:  # a peer failing (OOM, a Triton error): reported, the rest go on
                running.remove(v)
                failed(v.name, err)


def finish_variant(v: _Running, cfg: Config, weights: dict, data: list) -> dict:
    """The variant's row: its times' statistics and its gradients of the first batch from
    the initial weights."""
    row, times = v.row, v.row.pop("times")
    v.model.load_state_dict(weights)
    grads = gradients(v.forward, v.model, data[0])
    row.update({"ms": statistics.median(times), "min": min(times), "max": max(times),
                "spread_pct": spread_pct(times), "samples": len(times),
                "tokens_per_s": cfg.batch * cfg.seq / (statistics.median(times) / 1e3), "grads": grads})
    return row


def gradients(forward, model: nn.Module, data, keep: bool = False) -> dict:
    """Each parameter's gradient of one forward and backward from the model's weights now,
    and the loss (key "loss"): float64 copies in host memory, out of the device memory a
    variant's peak counts. The parameters keep their gradients where `keep` says so."""
    for p in model.parameters():
        p.grad = None
    loss = forward(*data)
    loss.backward()
    out = {name: p.grad.detach().to("cpu", torch.float64) for name, p in model.named_parameters()}
    out["loss"] = loss.detach().to("cpu", torch.float64)
    if not keep:
        for p in model.parameters():
            p.grad = None
    return out


def reference(cfg: Config, weights: dict, data, args, device: str) -> dict:
    """The check's oracle: the eager model in float64 from the same weights, its gradients
    of the first batch and its loss curve over the batches of `data` with the same optimizer."""
    with torch.device(device):
        model = Decoder(cfg, EAGER).to(device=device, dtype=torch.float64)
    model.load_state_dict({k: v.double() for k, v in weights.items()})
    optimizer, _ = _optimizer(list(model.parameters()), args.lr)
    grads = gradients(model, model, data[0], keep=True)
    losses = [float(grads["loss"])]
    for tokens, targets in data[1:]:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        losses.append(float(loss.detach()))
    return {"grads": grads, "losses": losses}


def grad_errors(grads: dict, ref: dict) -> dict:
    """Each parameter's (and the loss's) relative error against the float64 reference."""
    return {k: float((g - ref[k]).norm() / ref[k].norm().clamp_min(1e-300)) for k, g in grads.items()}


def _timed(step, steps: int, device: str, untimed: int = 0) -> list[float]:
    """Milliseconds of each of `steps` steps after `untimed` more: CUDA events recorded
    around every step and read after the last one (one synchronization, so that the host
    runs ahead as in training), or perf_counter on a CPU."""
    for _ in range(untimed):
        step()
    if device != "cuda":
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _release(device: str):
    if device == "cuda":
        torch.cuda.empty_cache()


def run(cfg: Config, dtype, wanted, args, device: str) -> dict:
    configure_compile(False, 1)
    result = {"device": device_info(device), "config": asdict(cfg), "dtype": dtype_name(dtype),
              "liger_kernel": _version("liger-kernel"), "steps": args.steps,
              "rounds": max(1, min(args.rounds, args.steps)), "check_steps": args.check_steps,
              "lr": args.lr, "grad_multiplier": GRAD_MULTIPLIER, "grad_floor": GRAD_FLOOR[dtype],
              "loss_floor": LOSS_FLOOR[dtype],
              "rows": [], "skipped": []}
    rows, skipped = result["rows"], result["skipped"]
    kernels = {"eager": lambda: EAGER, "compile": lambda: EAGER}
    fused: list = []

    def fusegen_once():  # one build for both fusegen variants
        if not fused:
            started = time.perf_counter()
            fused.append(fusegen_kernels())
            result["fusegen_build_s"] = time.perf_counter() - started
        return fused[0]

    def liger():
        found, why = liger_kernels(device)
        if found is None:
            raise LookupError(why)
        return found

    kernels.update({"fusegen": fusegen_once, "fusegen+compile": fusegen_once, "liger": liger})
    weights = initial_weights(cfg, dtype, device)
    data = batches(cfg, device, args.check_steps)
    ref = reference(cfg, weights, data, args, device)
    result["float64_losses"] = ref["losses"]
    _release(device)
    running = []

    def failed(name: str, err: Exception):
        if name in ("eager", "fusegen"):
            raise err
        skipped.append({"variant": name, "reason": failure(err)})

    for name in VARIANTS:
        if name not in wanted:
            skipped.append({"variant": name, "reason": "not in --variants"})
            continue
        if name in COMPILED and args.no_compile:
            skipped.append({"variant": name, "reason": "--no-compile (torch.compile variants left out)"})
            continue
        print(f"  {name} ...", flush=True)
        try:
            running.append(start_variant(name, kernels[name](), cfg, weights, data, args, device))
        except LookupError as err:  # a peer that is not here: its reason
            skipped.append({"variant": name, "reason": str(err).strip("'\"")})
        except Exception as err:  # a peer failing (OOM, a Triton or compile error): reported, the run goes on
            failed(name, err)
        _release(device)
    print(f"  timing {len(running)} variants in {result['rounds']} rounds ...", flush=True)
    time_variants(running, args, device, failed)
    for v in running:
        row = finish_variant(v, cfg, weights, data)
        row["grad_errors"] = grad_errors(row.pop("grads"), ref["grads"])
        rows.append(row)
    del running
    torch._dynamo.reset()  # dynamo's cache holds the compiled steps: let their memory go
    _release(device)
    _check(result)
    if args.json:
        write_text(args.json, json.dumps(result, indent=1) + "\n")
    return result


def _check(result: dict):
    """Each row's speed-up over eager, its loss curve's largest relative difference from
    eager's, and the two checks against float64: every parameter's gradient error at most
    `grad_multiplier` times eager's plus `grad_floor`, and the loss curve's largest
    relative distance from float64's at most `grad_multiplier` times eager's plus
    `loss_floor`."""
    eager = next((r for r in result["rows"] if r["variant"] == "eager"), None)
    if eager is None:
        return
    ref, mult = result["float64_losses"], result["grad_multiplier"]

    def distance(a: list, b: list) -> float:
        if not all(map(_finite, a)):
            return float("inf")
        return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))

    loss_allowed = mult * distance(eager["losses"], ref) + result["loss_floor"]
    for r in result["rows"]:
        r["speedup"] = eager["ms"] / r["ms"]
        r["loss_max_rel_diff"] = distance(r["losses"], eager["losses"])
        r["loss_vs_float64"] = distance(r["losses"], ref)
        r["loss_ok"] = r["loss_vs_float64"] <= loss_allowed
        errors, base = r["grad_errors"], eager["grad_errors"]
        allowed = {k: mult * base[k] + result["grad_floor"] for k in base}
        worst = max(base, key=lambda k: errors[k] / allowed[k] if _finite(errors[k]) else float("inf"))
        r["grad_worst"] = {"name": worst, "error": errors[worst], "eager_error": base[worst]}
        r["grad_ok"] = all(_finite(errors[k]) and errors[k] <= allowed[k] for k in base)


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def report(result: dict) -> None:
    from fusegen.bench.report import table, with_spread

    d, cfg = result["device"], result["config"]
    liger = result["liger_kernel"] or "not installed"
    print(f"\n{d['name']} ({d['kind']}), torch {d['torch']}, Liger Kernel {liger}; "
          f"{cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads of {cfg['head_dim']}, MLP "
          f"{cfg['mlp']}, vocab {cfg['vocab']}, batch {cfg['batch']} x seq {cfg['seq']}, {result['dtype']}")
    cuda = d["kind"] == "cuda"
    columns = ["variant", "ms per step", "min..max", "tokens/s", "speed-up over eager"]
    columns += ["peak GiB"] if cuda else []
    columns += ["gradient error vs float64 (worst parameter; eager's)",
                f"loss curve vs float64 (max rel diff, {result['check_steps']} steps)", "first step s"]
    lines = []
    for r in result["rows"]:
        line = [r["variant"], with_spread(r["ms"], r["spread_pct"]), f"{r['min']:.4g}..{r['max']:.4g}",
                f"{r['tokens_per_s']:,.0f}", f"{r['speedup']:.2f}x" if "speedup" in r else "-"]
        line += [f"{r['peak_gib']:.1f}"] if cuda else []
        worst = r.get("grad_worst")
        line += [f"{worst['error']:.1e} {'ok' if r['grad_ok'] else 'over'} ({worst['name']}; "
                 f"{worst['eager_error']:.1e})" if worst else "-",
                 f"{r['loss_vs_float64']:.1e} {'ok' if r['loss_ok'] else 'over'}" if "loss_ok" in r else "-",
                 f"{r['first_step_s']:.1f}"]
        lines.append(line)
    table(f"one training step (forward, backward, AdamW), median of {result['steps']} steps"
          f" in {result.get('rounds', 1)} rounds of every variant in turn", columns, lines)
    for s in result["skipped"]:
        print(f"skipped  {s['variant']}: {s['reason']}")
    if "fusegen_build_s" in result:
        print(f"fusegen's ops built or loaded from the cache in {result['fusegen_build_s']:.1f} s "
              "(not in the first step's time)")
    eager = next((r for r in result["rows"] if r["variant"] == "eager"), None)
    if eager is not None:
        print(f"eager loss: {eager['losses'][0]:.4f} at the first step, {eager['losses'][-1]:.4f} at step "
              f"{len(eager['losses'])} (float64: {result['float64_losses'][-1]:.4f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fusegen bench block", description=__doc__.splitlines()[0])
    for field in ("layers", "hidden", "heads", "head_dim", "mlp", "vocab", "batch", "seq"):
        p.add_argument(f"--{field.replace('_', '-')}", type=int, help="default: the device's configuration")
    p.add_argument("--steps", type=int, help=f"timed steps after the check steps (default: {STEPS})")
    p.add_argument("--rounds", type=int, default=5,
                   help="the timed steps run in this many rounds of every variant in turn")
    p.add_argument("--check-steps", type=int, default=20,
                   help="steps from the initial weights whose losses are compared with eager's (the warm-up)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on CUDA, fp32 on a CPU")
    p.add_argument("--variants", type=name_list("variant", VARIANTS), default=",".join(VARIANTS),
                   help="eager always runs: it is the reference")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile variants")
    p.add_argument("--quick", action="store_true", help="a smaller model on CUDA (the CPU's is tiny already)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cfg = CPU_CONFIG if device == "cpu" else QUICK_CONFIG if args.quick else CUDA_CONFIG
    cfg = replace(cfg, **{f: getattr(args, f) for f in asdict(cfg) if getattr(args, f) is not None})
    dtype = DTYPES[args.dtype] if args.dtype else torch.bfloat16 if device == "cuda" else torch.float32
    args.steps = args.steps or STEPS[device]
    args.check_steps = max(args.check_steps, 1)
    wanted = ["eager"] + [v for v in args.variants if v != "eager"]
    print(f"fusegen bench block on {device}: {cfg}, {dtype_name(dtype)}", flush=True)
    result = run(cfg, dtype, wanted, args, device)
    report(result)
    failed = [r["variant"] for r in result["rows"] if not (r.get("grad_ok", True) and r.get("loss_ok", True))]
    if failed:
        print(f"check failed: {', '.join(failed)} (against float64: more than {result['grad_multiplier']:g} "
              f"times eager's error plus {result['grad_floor']:g} in a gradient or {result['loss_floor']:g} "
              "in the loss curve)")
    return 1 if set(failed) & OURS else 0

"""What every rank runs for tests/test_distributed.py (2 CPU ranks, gloo) and
tests/gpu/test_distributed_nccl.py (2 GPUs, NCCL): training runs of models with fused
activations and `fusegen.optim.AdamW`, data parallel, against one process.

- DDP: `DistributedDataParallel` over plain params, each rank half the batch.
- FSDP2: `torch.distributed.fsdp.fully_shard` per block and at the root, so every param is
  a DTensor sharded on dim 0 (some unevenly) and `fusegen.optim.AdamW` steps the local
  shards; FSDP2 all-gathers the params for the forward (the fused ops see plain tensors)
  and reduce-scatters the gradients. It runs on a CPU mesh with gloo as on GPUs with NCCL.

The oracle of both is one process training the same model with eager activations and
`torch.optim.AdamW` on the full batch: the per-step losses, the final params and (FSDP2)
the optimizer state agree within TOL (float64 throughout). Each check records its largest
param difference in the rank's figures, which the test modules print.

`run_ranks` spawns the ranks once, sharing one fresh fusegen cache: the ops are built by one
rank while the other waits and loads them. Each rank runs the checks in order and writes
{"failed": check -> traceback, "figures": check -> line} to <out>/rank<r>.json. Every check
is symmetric (the ranks compare gathered results), so a failing assertion fails on both
ranks at the same point and no collective is left waiting; the process group's timeout
bounds a hang all the same."""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import statistics
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtensor_ranks import WORLD, _Builds, free_port

ACTIVATIONS = {
    "dist_silu": "x*sigmoid(x)",
    "dist_swiglu": "g*sigmoid(g)*u",
}
EAGER = {
    "dist_silu": F.silu,
    "dist_swiglu": lambda g, u: F.silu(g) * u,
}
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
STEPS = 20
# float64: what differs from the one-process run is the order of the sums (a gradient is
# the mean of two half-batch means; FSDP2 divides before and after its reduce-scatter), a
# few ulps that 20 AdamW steps carry into the params; measured 3e-14 relative at most.
TOL = dict(rtol=1e-10, atol=1e-12)


def run_ranks(tmp_path_factory, device: str, checks: tuple[str, ...] | None = None) -> tuple[dict, dict]:
    """Spawn WORLD ranks on `device` ("cpu": gloo, "cuda": NCCL, one GPU per rank) sharing a
    fresh fusegen cache (holding only the runtime); run `checks` (default CHECKS) on each.
    Returns (check -> the tracebacks of the ranks it failed on, check -> rank 0's figure)."""
    from conftest import seed_runtime

    names = tuple(checks or CHECKS)
    cache, out = tmp_path_factory.mktemp("distributed-cache"), tmp_path_factory.mktemp("distributed-out")
    seed_runtime(cache)
    torch.multiprocessing.spawn(_rank, args=(free_port(), str(cache), str(out), device, names), nprocs=WORLD)
    failures: dict[str, list[str]] = {}
    figures: dict[str, str] = {}
    for r in range(WORLD):
        result = json.loads((out / f"rank{r}.json").read_text())
        for check, tb in result["failed"].items():
            failures.setdefault(check, []).append(f"rank {r}: {tb}")
        if r == 0:
            figures = result["figures"]
    return failures, figures


def _rank(rank: int, port: int, cache: str, out: str, device: str, names: tuple[str, ...]):
    os.environ["FUSEGEN_CACHE_DIR"] = cache
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=180))
    failed: dict[str, str] = {}
    state: dict = {"device": torch.device(device, rank) if device == "cuda" else torch.device("cpu"), "figures": {}}
    try:
        for name in names:
            try:
                ALL_CHECKS[name](state)
            except Exception:  # recorded per check; the test of that check fails with it
                failed[name] = traceback.format_exc()
                if "ops" not in state:  # every later check needs the ops
                    failed.update({n: f"not run: {name} built no ops" for n in names if n not in failed})
                    break
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps({"failed": failed, "figures": state["figures"]}))
        dist.destroy_process_group()


# -- checks -------------------------------------------------------------------------------------

def check_build_once(state):
    """Both ranks ask at once for the activations (one library) and AdamW's step op (another):
    each is built by one rank, the other waits and loads it."""
    import fusegen
    from fusegen.optim import algorithms

    log = logging.getLogger("fusegen")
    builds = _Builds()
    log.addHandler(builds)
    log.setLevel(logging.INFO)
    try:
        dist.barrier()  # both ranks reach the builds together
        ops = fusegen.fuse_many([{"expr": e, "name": n} for n, e in ACTIVATIONS.items()])
        dist.barrier()
        adamw = algorithms.step_op(algorithms.ADAMW)
    finally:
        log.removeHandler(builds)
    state["ops"] = dict(zip(ACTIVATIONS, ops))
    seen = [None] * WORLD
    dist.all_gather_object(seen, (builds.builds, ops[0].library.cached, adamw.name))
    assert sum(b for b, _, _ in seen) == 2, f"(builds, activations loaded from cache, step op) per rank: {seen}"
    assert sorted(c for _, c, _ in seen) == [False, True], seen  # the other rank loaded the activations


def _batch(shape, seed, device, dtype=torch.float64, high=None):
    """The same data on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(high, shape, generator=g) if high else torch.randn(shape, generator=g, dtype=dtype)
    return t.to(device)


def _mine(t):
    """This rank's equal part of a batch (dim 0)."""
    n = t.shape[0] // WORLD
    return t[dist.get_rank() * n:(dist.get_rank() + 1) * n]


def _mean_over_ranks(value: torch.Tensor) -> float:
    """The full batch's loss from each rank's loss of its equal part."""
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / WORLD


def _differences(pairs) -> tuple[float, float]:
    """Largest |got - want| and largest |got - want| / |want| (where |want| > 1e-3) over the
    (name, got, want) triples."""
    abs_diff, rel_diff = 0.0, 0.0
    for _, got, want in pairs:
        d = (got - want).abs()
        abs_diff = max(abs_diff, d.max().item())
        big = want.abs() > 1e-3
        if big.any():
            rel_diff = max(rel_diff, (d[big] / want.abs()[big]).max().item())
    return abs_diff, rel_diff


def _compare(what, state, losses, want_losses, pairs):
    """Per-step losses and final tensors within TOL; the largest differences as the figure."""
    for step, (got, want) in enumerate(zip(losses, want_losses)):
        assert abs(got - want) <= TOL["atol"] + TOL["rtol"] * abs(want), f"{what}: loss at step {step}: {got} != {want}"
    for name, got, want in pairs:
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {name}: {m}")
    abs_diff, rel_diff = _differences(pairs)
    loss_diff = max(abs(a - b) for a, b in zip(losses, want_losses))
    state["figures"][what] = (f"{STEPS} AdamW steps, float64: max |param diff| {abs_diff:.1e}, max rel {rel_diff:.1e}, "
                              f"max |loss diff| {loss_diff:.1e}; loss {want_losses[0]:.4f} -> {want_losses[-1]:.4f}")


class FFN(torch.nn.Module):
    """in -> silu -> a SwiGLU block with a residual -> head."""

    def __init__(self, silu, swiglu, width=8, model=16, hidden=32, out=4):
        super().__init__()
        self.silu, self.swiglu = silu, swiglu
        self.inp = torch.nn.Linear(width, model)
        self.gate, self.up = torch.nn.Linear(model, hidden), torch.nn.Linear(model, hidden)
        self.down = torch.nn.Linear(hidden, model)
        self.head = torch.nn.Linear(model, out)

    def forward(self, x):
        h = self.silu(self.inp(x))
        h = h + self.down(self.swiglu(self.gate(h), self.up(h)))
        return self.head(h)


def check_ddp(state):
    """DDP over the fused FFN with fusegen.optim.AdamW, half the batch per rank, 20 steps:
    the losses and params of one process with eager activations and torch.optim.AdamW."""
    import fusegen
    from torch.nn.parallel import DistributedDataParallel

    dev, ops = state["device"], state["ops"]
    torch.manual_seed(0)
    ref = FFN(EAGER["dist_silu"], EAGER["dist_swiglu"]).double().to(dev)
    fused = copy.deepcopy(ref)
    fused.silu, fused.swiglu = ops["dist_silu"], ops["dist_swiglu"]
    ddp = DistributedDataParallel(fused, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = fusegen.optim.AdamW(ddp.parameters(), **HYPER)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    losses, want = [], []
    for step in range(STEPS):
        x, y = _batch((4 * WORLD, 8), 100 + step, dev), _batch((4 * WORLD, 4), 200 + step, dev)
        loss = F.mse_loss(ddp(_mine(x)), _mine(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_ranks(loss))
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(ref_loss.item())
    pairs = [(n, p.detach(), q.detach()) for (n, p), q in zip(fused.named_parameters(), ref.parameters())]
    _compare("ddp", state, losses, want, pairs)


class Block(torch.nn.Module):
    def __init__(self, swiglu, model, hidden):
        super().__init__()
        self.swiglu = swiglu
        self.gate, self.up = torch.nn.Linear(model, hidden), torch.nn.Linear(model, hidden)
        self.down = torch.nn.Linear(hidden, model)

    def forward(self, h):
        return h + self.down(self.swiglu(self.gate(h), self.up(h)))


class Decoder(torch.nn.Module):
    """Embedding, SwiGLU blocks with residuals, a head (vocab 13 and model width 10: rows
    that do not split evenly over two ranks)."""

    def __init__(self, swiglu, vocab=13, model=10, hidden=24, blocks=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, model)
        self.blocks = torch.nn.ModuleList(Block(swiglu, model, hidden) for _ in range(blocks))
        self.head = torch.nn.Linear(model, vocab)

    def forward(self, tokens):
        """The logits of every position, (tokens.numel(), vocab): the head on 2-d rows, whose
        result is no view (FSDP2's backward hook on a returned view would be dropped by an
        in-place op on it, and it warns)."""
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h.reshape(-1, h.shape[-1]))

    def set_swiglu(self, swiglu):
        for block in self.blocks:
            block.swiglu = swiglu


def _next_token_loss(model, tokens):
    return F.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:].reshape(-1))


def _fully_shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def check_fsdp2(state):
    """FSDP2 (fully_shard per block and at the root) with fusegen.optim.AdamW over its
    DTensor params, half the batch per rank, 20 steps: the step issues no collective, the
    state is sharded like the params, and the losses, params (full_tensor) and moments
    are those of one process with eager activations and torch.optim.AdamW."""
    import fusegen
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    dev = state["device"]
    mesh = init_device_mesh(dev.type, (WORLD,))
    torch.manual_seed(0)
    ref = Decoder(EAGER["dist_swiglu"]).double().to(dev)
    model = copy.deepcopy(ref)
    model.set_swiglu(state["ops"]["dist_swiglu"])
    _fully_shard(model, mesh)
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in params.values()), \
        {n: type(p).__name__ for n, p in params.items()}
    rows = params["embed.weight"].to_local().shape[0]
    assert rows == (7, 6)[dist.get_rank()], f"13 embedding rows over 2 ranks, this one holds {rows}"
    opt = fusegen.optim.AdamW(model.parameters(), **HYPER)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    tokens = _batch((4 * WORLD, 7), 300, dev, high=13)  # one batch, learnt over the steps
    losses, want = [], []
    for step in range(STEPS):
        loss = _next_token_loss(model, _mine(tokens))
        loss.backward()
        with CommDebugMode() as comm:
            opt.step()
        assert comm.get_total_counts() == 0, f"step {step}: the step communicated: {dict(comm.get_comm_counts())}"
        opt.zero_grad()
        losses.append(_mean_over_ranks(loss))
        ref_loss = _next_token_loss(ref, tokens)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(ref_loss.item())
    pairs = []
    for (name, p), q in zip(params.items(), ref.parameters()):
        pairs.append((name, p.detach().full_tensor(), q.detach()))
        mine, theirs = opt.state[p], ref_opt.state[q]
        for ours, torchs in (("m", "exp_avg"), ("v", "exp_avg_sq")):
            assert isinstance(mine[ours], DTensor) and mine[ours].placements == p.placements, (name, ours)
            pairs.append((f"{name} {ours}", mine[ours].full_tensor(), theirs[torchs]))
        assert mine["step"].item() == STEPS, (name, mine["step"])
    _compare("fsdp2", state, losses, want, pairs)


def check_fsdp2_step_time(state):
    """The optimizer step of a 4-block float32 decoder (vocab 32000, width 1024, hidden 4096:
    about 115M params, sharded over the ranks) under FSDP2: fusegen.optim.AdamW beside
    torch.optim.AdamW(fused=True) and (foreach=True), median ms per step, CUDA only. A
    figure, not a pass mark; the check fails only if a step fails."""
    import fusegen
    from torch.distributed.tensor import init_device_mesh

    dev = state["device"]
    assert dev.type == "cuda", "the step-time comparison runs on GPUs"
    mesh = init_device_mesh(dev.type, (WORLD,))
    torch.manual_seed(0)
    with dev:  # initialised on the GPU: 115M params on the host would take seconds
        model = Decoder(state["ops"]["dist_swiglu"], vocab=32000, model=1024, hidden=4096, blocks=4)
    _fully_shard(model, mesh)
    _next_token_loss(model, _batch((2, 65), 400, dev, high=32000)).backward()
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    makers = {
        "fusegen.optim.AdamW": lambda: fusegen.optim.AdamW(params, **HYPER),
        "torch AdamW(fused=True)": lambda: torch.optim.AdamW(params, **HYPER, fused=True),
        "torch AdamW(foreach=True)": lambda: torch.optim.AdamW(params, **HYPER, foreach=True),
    }
    rows = []
    for label, make in makers.items():
        opt = make()
        for _ in range(3):  # state created, kernels loaded and warm
            opt.step()
        times = []
        for _ in range(20):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        rows.append(f"{label} {statistics.median(times):.3f} ms")
        del opt
        torch.cuda.empty_cache()
    state["figures"]["fsdp2_step_time"] = (f"FSDP2 step of {count / 1e6:.0f}M float32 params over {WORLD} GPUs, "
                                           "median of 20 (rank 0): " + ", ".join(rows))


CHECKS = {
    "build_once": check_build_once,
    "ddp": check_ddp,
    "fsdp2": check_fsdp2,
}
ALL_CHECKS = {**CHECKS, "fsdp2_step_time": check_fsdp2_step_time}

"""What every rank runs for tests/test_dtensor.py (2 CPU ranks, gloo) and
tests/gpu/test_dtensor_nccl.py (2 GPUs, NCCL): fusegen ops on DTensors (and under DDP)
against eager PyTorch on the same DTensors, and against one process's unsharded result.

`run_ranks` spawns the ranks once; each rank runs every check in CHECKS in order and writes
what failed (a traceback per check) to <out>/rank<r>.json, which the test modules read, one
pytest test per check. Every check is symmetric (the ranks compare gathered full tensors),
so a failing assertion fails on both ranks at the same point and no collective is left
waiting; the process group's timeout bounds a hang all the same."""

from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

WORLD = 2

# name -> (expression, scalars): built by both ranks at once into one fresh, shared cache.
EXPRS = {
    "dt_gelu_tanh": ("0.5*x*(1+tanh(0.7978845608*(x+0.044715*x*x*x)))", []),
    "dt_swiglu": ("g*sigmoid(g)*u", []),
    "dt_bias_silu": ("(x+b)*sigmoid(x+b)", []),
    "dt_fma": ("a*b+c", []),
    "dt_swish": ("x*sigmoid(beta*x)", ["beta"]),
    "dt_rope": ("(x1*c - x2*s, x2*c + x1*s)", []),
    "dt_rope_cat": ("torch.cat((x1*c - x2*s, x2*c + x1*s), -1)", []),
    "dt_rms_norm": ("x * torch.rsqrt((x*x).mean(-1, keepdim=True) + eps) * w", ["eps"]),
}
# The same expressions as eager PyTorch, the oracle on DTensors and on plain tensors.
EAGER = {
    "dt_gelu_tanh": lambda x: 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x))),
    "dt_swiglu": lambda g, u: g * torch.sigmoid(g) * u,
    "dt_bias_silu": lambda x, b: (x + b) * torch.sigmoid(x + b),
    "dt_fma": lambda a, b, c: a * b + c,
    "dt_swish": lambda x, beta: x * torch.sigmoid(beta * x),
    "dt_rope": lambda x1, c, x2, s: (x1 * c - x2 * s, x2 * c + x1 * s),
    "dt_rope_cat": lambda x1, c, x2, s: torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1),
    "dt_rms_norm": lambda x, w, eps: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w,
}
TOL = dict(rtol=1e-10, atol=1e-12)  # float64 throughout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path_factory, device: str) -> dict[str, list[str]]:
    """Spawn WORLD ranks on `device` ("cpu": gloo, "cuda": NCCL, one GPU per rank) sharing a
    fresh fusegen cache (holding only the runtime, so the ops are new to both ranks); returns
    check name -> the tracebacks of the ranks it failed on."""
    from conftest import seed_runtime

    cache, out = tmp_path_factory.mktemp("dtensor-cache"), tmp_path_factory.mktemp("dtensor-out")
    seed_runtime(cache)
    torch.multiprocessing.spawn(_rank, args=(free_port(), str(cache), str(out), device), nprocs=WORLD)
    failures: dict[str, list[str]] = {}
    for r in range(WORLD):
        for check, tb in json.loads((out / f"rank{r}.json").read_text()).items():
            failures.setdefault(check, []).append(f"rank {r}: {tb}")
    return failures


def _rank(rank: int, port: int, cache: str, out: str, device: str):
    os.environ["FUSEGEN_CACHE_DIR"] = cache
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    failed: dict[str, str] = {}
    state: dict = {"device": torch.device(device, rank) if device == "cuda" else torch.device("cpu")}
    try:
        for name, check in CHECKS.items():
            try:
                check(state)
            except Exception:  # recorded per check; the test of that check fails with it
                failed[name] = traceback.format_exc()
                if "ops" not in state:  # every later check needs the ops
                    failed.update({n: f"not run: {name} built no ops" for n in CHECKS if n not in failed})
                    break
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(failed))
        try:
            dist.barrier()  # neither rank tears down while the other still has collectives out
        finally:
            dist.destroy_process_group()
    # The results are written: leave without the interpreter's teardown, where a rank of this
    # run (gloo, DTensor's mesh, torch.compile's workers) was once seen to abort ("terminate
    # called without an active exception") after every check had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- checks -------------------------------------------------------------------------------------

class _Builds(logging.Handler):
    """Counts this process's build starts and lock waits (fusegen's INFO records)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.builds, self.waits = 0, 0

    def emit(self, record):
        self.builds += getattr(record, "fusegen_build", None) == "start"
        self.waits += record.getMessage().startswith("waiting for another process")


def check_build_once(state):
    """Both ranks ask for the same new ops at once: one builds, the other waits and loads."""
    import fusegen

    log = logging.getLogger("fusegen")
    builds = _Builds()
    log.addHandler(builds)
    log.setLevel(logging.INFO)
    dist.barrier()  # both ranks reach the build together
    ops = fusegen.fuse_many([{"expr": e, "name": n, "scalars": s} for n, (e, s) in EXPRS.items()])
    log.removeHandler(builds)
    state["ops"] = dict(zip(EXPRS, ops))
    seen = [None] * WORLD
    dist.all_gather_object(seen, (builds.builds, builds.waits, ops[0].library.cached))
    assert sum(b for b, _, _ in seen) == 1, f"(builds, lock waits, loaded from cache) per rank: {seen}"
    assert sorted(c for _, _, c in seen) == [False, True], seen  # the other rank loaded the build


def _mesh(state):
    from torch.distributed.tensor import init_device_mesh

    if "mesh" not in state:
        state["mesh"] = init_device_mesh(state["device"].type, (WORLD,))
    return state["mesh"]


def _full(shape, seed, device):
    """The same tensor on every rank (seeded), in float64."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device)


def _run(fn, args, grad_seed):
    """fn(*args) and the gradients of the DTensor leaves (for an incoming gradient with the
    output's placements), with the collectives each half issued."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    with CommDebugMode() as forward:
        out = fn(*leaves)
    grad = distribute_tensor(_full(out.shape, grad_seed, out.device), out.device_mesh, out.placements)
    with CommDebugMode() as backward:
        out.backward(grad)
    grads = [t.grad for t in leaves if isinstance(t, torch.Tensor)]
    return out, grads, forward.get_comm_counts(), backward.get_comm_counts()


def _same_as_eager(what, name, op, args, scalars=()):
    """The fused op on DTensors: no collective in its forward, the output placement eager's
    expression gives, and eager's values and gradients (placements, values, collectives)."""
    out, grads, fwd, bwd = _run(lambda *a: op(*a, *scalars), args, grad_seed=99)
    want, want_grads, want_fwd, want_bwd = _run(lambda *a: EAGER[name](*a, *scalars), args, grad_seed=99)
    assert sum(fwd.values()) == 0, f"{what}: the fused forward redistributed: {dict(fwd)}"
    assert out.placements == want.placements, f"{what}: {out.placements} != eager's {want.placements}"
    torch.testing.assert_close(out.full_tensor(), want.full_tensor(), **TOL)
    assert dict(bwd) == dict(want_bwd), f"{what}: backward collectives {dict(bwd)} != eager's {dict(want_bwd)}"
    for i, (g, w) in enumerate(zip(grads, want_grads)):
        assert g.placements == w.placements, f"{what}: grad {i} {g.placements} != eager's {w.placements}"
        torch.testing.assert_close(g.full_tensor(), w.full_tensor(), **TOL)


def check_placements(state):
    """Sharded x sharded, sharded x replicated, broadcast (a bias) and a runtime scalar: the
    fused op runs locally wherever eager's pointwise ops do."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    ops, mesh, dev = state["ops"], _mesh(state), state["device"]

    def dt(shape, seed, placement):
        return distribute_tensor(_full(shape, seed, dev), mesh, [placement])

    S0, S1, R = Shard(0), Shard(1), Replicate()
    cases = [
        ("sharded x sharded", "dt_fma", [dt((8, 6), 1, S0), dt((8, 6), 2, S0), dt((8, 6), 3, S0)]),
        ("sharded x replicated", "dt_fma", [dt((8, 6), 1, S1), dt((8, 6), 2, R), dt((8, 6), 3, S1)]),
        ("bias, batch sharded", "dt_bias_silu", [dt((8, 6), 4, S0), dt((6,), 5, R)]),
        ("bias, features sharded", "dt_bias_silu", [dt((8, 6), 4, S1), dt((6,), 5, S0)]),
        ("column x row broadcast", "dt_fma", [dt((8, 1), 6, S0), dt((1, 6), 7, R), dt((6,), 8, R)]),
        ("two sharded inputs", "dt_swiglu", [dt((8, 6), 9, S1), dt((8, 6), 10, S1)]),
        ("a Python number", "dt_fma", [dt((8, 6), 1, S0), 2.0, dt((6,), 3, R)]),
    ]
    for what, name, args in cases:
        _same_as_eager(what, name, ops[name], args)
    _same_as_eager("runtime scalar", "dt_swish", ops["dt_swish"], [dt((8, 6), 11, S0)], scalars=(0.7,))


def check_backward_op(state):
    """`<name>_backward` called directly: its Tensor[] follows the output mask, stays local,
    and keeps a Partial incoming gradient Partial (it is linear in it), as eager's mul does."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh, dev = _mesh(state), state["device"]
    backward = torch.ops.fusegen.dt_swiglu_backward.default
    g, u, dout = (_full((8, 6), s, dev) for s in (21, 22, 23))
    for mask in ([True, True], [False, True], [True, False]):
        want = backward(dout, g, u, mask)
        args = [distribute_tensor(t, mesh, [Shard(0)]) for t in (dout, g, u)]
        with CommDebugMode() as comm:
            got = backward(*args, mask)
        assert comm.get_total_counts() == 0, f"mask {mask}: {dict(comm.get_comm_counts())}"
        assert len(got) == len(want) == sum(mask), (mask, len(got), len(want))
        for a, b in zip(got, want):
            assert a.placements == (Shard(0),), (mask, a.placements)
            torch.testing.assert_close(a.full_tensor(), b, **TOL)

    rank = dist.get_rank()
    pieces = [_full((8, 6), 30 + r, dev) for r in range(WORLD)]  # dout = their sum: Partial
    partial = DTensor.from_local(pieces[rank], mesh, [Partial()])
    g_r, u_r = (distribute_tensor(t, mesh, [Replicate()]) for t in (g, u))
    with CommDebugMode() as comm:
        got = backward(partial, g_r, u_r, [True, True])
    eager_placement = (partial * g_r).placements  # eager: mul(Partial, Replicate)
    assert comm.get_total_counts() == 0, dict(comm.get_comm_counts())
    for a, b in zip(got, backward(sum(pieces), g, u, [True, True])):
        assert a.placements == eager_placement, (a.placements, eager_placement)
        torch.testing.assert_close(a.full_tensor(), b, **TOL)


def check_partial_input(state):
    """A Partial input to a nonlinear op is reduced first, as eager's aten.gelu does."""
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.debug import CommDebugMode

    mesh, dev = _mesh(state), state["device"]
    pieces = [_full((8, 6), 40 + r, dev) for r in range(WORLD)]
    x = DTensor.from_local(pieces[dist.get_rank()], mesh, [Partial()])
    with CommDebugMode() as comm:
        out = state["ops"]["dt_gelu_tanh"](x)
    with CommDebugMode() as eager_comm:
        want = F.gelu(x, approximate="tanh")
    assert out.placements == want.placements, (out.placements, want.placements)
    assert dict(comm.get_comm_counts()) == dict(eager_comm.get_comm_counts())
    torch.testing.assert_close(out.full_tensor(), EAGER["dt_gelu_tanh"](sum(pieces)), **TOL)


def check_double_backward(state):
    """A gradient penalty through the op on DTensors: <name>_grad2_backward, sharded."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh, dev = _mesh(state), state["device"]
    x0 = distribute_tensor(_full((8, 6), 50, dev), mesh, [Shard(0)])
    results = []
    for fn in (state["ops"]["dt_gelu_tanh"], EAGER["dt_gelu_tanh"]):
        x = x0.detach().requires_grad_()
        (gx,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
        (gx * gx).sum().backward()
        results.append((gx.detach(), x.grad))
    for got, want in zip(*results):
        assert got.placements == want.placements, (got.placements, want.placements)
        torch.testing.assert_close(got.full_tensor(), want.full_tensor(), **TOL)


class MLP(torch.nn.Module):
    """Two residual feed-forward blocks: linear -> gelu-tanh -> linear, and SwiGLU."""

    def __init__(self, gelu, swiglu, width=16, hidden=32):
        super().__init__()
        self.gelu, self.swiglu = gelu, swiglu
        self.fc1, self.fc2 = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)
        self.gate, self.up = torch.nn.Linear(width, hidden), torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x):
        x = x + self.fc2(self.gelu(self.fc1(x)))
        return x + self.down(self.swiglu(self.gate(x), self.up(x)))


def _models(state):
    """The single-process reference (float64, same seed on every rank) and a copy with the
    fused activations."""
    torch.manual_seed(0)
    ref = MLP(EAGER["dt_gelu_tanh"], EAGER["dt_swiglu"]).double().to(state["device"])
    fused = copy.deepcopy(ref)
    fused.gelu, fused.swiglu = state["ops"]["dt_gelu_tanh"], state["ops"]["dt_swiglu"]
    return ref, fused


def _step(model, x, w):
    out = model(x)
    (out * w).sum().backward()
    return out.detach()


def check_tensor_parallel_mlp(state):
    """Colwise fc1/gate/up (outputs stay DTensors, Shard(-1)), Rowwise fc2/down: the fused
    activations run on the shards; output and every parameter gradient match the
    unsharded model, with the collectives of the same model with eager activations."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh, dev = _mesh(state), state["device"]
    plan = {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel(),
            "gate": ColwiseParallel(use_local_output=False), "up": ColwiseParallel(use_local_output=False),
            "down": RowwiseParallel()}
    ref, fused = _models(state)
    eager_tp = parallelize_module(copy.deepcopy(ref), mesh, plan)
    fused_tp = parallelize_module(fused, mesh, plan)
    x, w = _full((4, 16), 60, dev), _full((4, 16), 61, dev)
    want = _step(ref, x, w)

    seen = []  # what the fused gelu is given
    hook = fused_tp.fc1.register_forward_hook(lambda m, i, o: seen.append(o))
    counts = []
    for model in (fused_tp, eager_tp):
        with CommDebugMode() as comm:
            out = _step(model, x, w)
        counts.append(dict(comm.get_comm_counts()))
        torch.testing.assert_close(out, want, **TOL)
    hook.remove()
    assert isinstance(seen[0], DTensor) and seen[0].placements[0].is_shard(), seen[0]
    assert counts[0] == counts[1], f"fused {counts[0]} != eager activations {counts[1]}"
    for (name, p), q in zip(fused_tp.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL, msg=lambda m: f"{name}: {m}")


def check_ddp(state):
    """DDP over the fused MLP, a different batch per rank: the averaged gradients are the
    full batch's in one process."""
    from torch.nn.parallel import DistributedDataParallel

    dev, rank = state["device"], dist.get_rank()
    ref, fused = _models(state)
    ddp = DistributedDataParallel(fused, device_ids=[dev.index] if dev.type == "cuda" else None)
    x, w = _full((4 * WORLD, 16), 70, dev), _full((4 * WORLD, 16), 71, dev)
    mine = slice(4 * rank, 4 * rank + 4)
    torch.testing.assert_close(_step(ddp, x[mine], w[mine] * WORLD), _step(ref, x, w)[mine], **TOL)
    for (name, p), q in zip(fused.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{name}: {m}")


def check_step_op(state):
    """A step op (an in-place update, no result) on DTensors: on each rank's shard, for
    Shard(0) of an uneven size (5 rows over 2 ranks), Shard(1) and Replicate, and through
    `_foreach` with other placements per update; the full tensors are eager's update of
    the unsharded ones, with no collective."""
    import fusegen
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    dev, mesh = state["device"], _mesh(state)
    step = fusegen.fuse("m = beta*m + g; p = p - lr*m", name="dt_sgd_step", inputs="p,g,m", scalars="lr,beta")

    def eager(p, g, m, lr, beta):
        m = beta * m + g
        return p - lr * m, m

    groups = []
    for k, placements in enumerate(([Shard(0)], [Shard(1)], [Replicate()])):
        full = [_full((5, 3), 80 + 3 * k + i, dev) for i in range(3)]
        groups.append((full, [distribute_tensor(t.clone(), mesh, placements) for t in full]))
    with CommDebugMode() as comm:
        for full, ours in groups:
            step(*ours, lr=0.1, beta=0.9)
        step.foreach(*[[ours[i] for _, ours in groups] for i in range(3)], lr=0.05, beta=0.5)
    assert comm.get_total_counts() == 0, dict(comm.get_comm_counts())
    for full, ours in groups:
        p, m = eager(*full, lr=0.1, beta=0.9)
        p, m = eager(p, full[1], m, lr=0.05, beta=0.5)
        torch.testing.assert_close(ours[0].full_tensor(), p, **TOL)
        torch.testing.assert_close(ours[2].full_tensor(), m, **TOL)
        torch.testing.assert_close(ours[1].full_tensor(), full[1], rtol=0, atol=0)


def check_several_outputs(state):
    """An op of two outputs and one that joins them (torch.cat, dim -1) on DTensors sharded
    by batch: both run locally, with eager's placements, values and gradients; the joined
    one on a tensor sharded along its last dimension is redistributed first, never wrong."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh, dev = _mesh(state), state["device"]

    def dt(shape, seed, placement):
        return distribute_tensor(_full(shape, seed, dev), mesh, [placement])

    for name in ("dt_rope", "dt_rope_cat"):
        args = [dt((8, 6), 60, Shard(0)), dt((6,), 61, Replicate()), dt((8, 6), 62, Shard(0)),
                dt((6,), 63, Replicate())]
        leaves = [a.detach().requires_grad_() for a in args]
        out = state["ops"][name](*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        assert all(o.placements == (Shard(0),) for o in outs), [o.placements for o in outs]
        eager_leaves = [a.detach().requires_grad_() for a in args]
        want = EAGER[name](*eager_leaves)
        wants = want if isinstance(want, tuple) else (want,)
        for o, w in zip(outs, wants):
            torch.testing.assert_close(o.full_tensor(), w.full_tensor(), **TOL)
        grads = torch.autograd.grad([o.sum() for o in outs], leaves)
        want_grads = torch.autograd.grad([w.sum() for w in wants], eager_leaves)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g.full_tensor(), w.full_tensor(), **TOL)
    cat_args = [dt((8, 6), 64, Shard(1)), dt((8, 6), 65, Shard(1)), dt((8, 6), 66, Shard(1)), dt((8, 6), 67, Shard(1))]
    out = state["ops"]["dt_rope_cat"](*cat_args)
    assert out.placements != (Shard(1),), out.placements  # its last dimension holds both outputs
    torch.testing.assert_close(out.full_tensor(), EAGER["dt_rope_cat"](*[a.full_tensor() for a in cat_args]), **TOL)


def check_row_op(state):
    """A row op (RMSNorm) on DTensors sharded by rows runs locally with eager's placements,
    values and gradients (the weight's gradient Partial, then summed); one sharded along its
    rows' dimension is redistributed first, never reduced over half a row."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh, dev = _mesh(state), state["device"]
    op = state["ops"]["dt_rms_norm"]
    for placement in (Shard(0), Shard(1)):
        x = distribute_tensor(_full((8, 6), 70, dev), mesh, [placement]).requires_grad_()
        w = distribute_tensor(_full((6,), 71, dev), mesh, [Replicate()]).requires_grad_()
        out = op(x, w, eps=1e-5)
        if placement == Shard(0):
            assert out.placements == (Shard(0),), out.placements
        else:
            assert out.placements != (Shard(1),), out.placements
        ex = x.detach().full_tensor().requires_grad_()
        ew = w.detach().full_tensor().requires_grad_()
        want = EAGER["dt_rms_norm"](ex, ew, 1e-5)
        torch.testing.assert_close(out.full_tensor(), want, **TOL)
        grads = torch.autograd.grad(out.sum(), (x, w))
        for g, e in zip(grads, torch.autograd.grad(want.sum(), (ex, ew))):
            torch.testing.assert_close(g.full_tensor(), e, **TOL)


CHECKS = {
    "build_once": check_build_once,
    "placements": check_placements,
    "backward_op": check_backward_op,
    "partial_input": check_partial_input,
    "double_backward": check_double_backward,
    "tensor_parallel_mlp": check_tensor_parallel_mlp,
    "ddp": check_ddp,
    "step_op": check_step_op,
    "several_outputs": check_several_outputs,
    "row_op": check_row_op,
}

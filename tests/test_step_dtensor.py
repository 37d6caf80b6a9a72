"""Step ops on DTensors (fusegen/pytorch/dtensor.py register_step): every tensor of an update
of one mesh, placements and shape runs on the local shards; anything else is an error naming
the argument. A one-rank gloo group here; two ranks (uneven shards) in tests/dtensor_ranks.py
(check_step_op), run by tests/test_dtensor.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fusegen

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

SGD = "m = beta*m + g; p = p - lr*m"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from torch.distributed.tensor import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sgd():
    return fusegen.fuse(SGD, name="t_dt_sgd", inputs="p,g,m", scalars="lr,beta")


def eager(p, g, m, lr, beta):
    m.copy_(beta * m + g)
    p.copy_(p - lr * m)


def state(seed, shape=(6, 4)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("placement", ["shard0", "shard1", "replicate"])
def test_an_update_runs_on_the_local_shards(mesh, sgd, placement):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    placements = {"shard0": [Shard(0)], "shard1": [Shard(1)], "replicate": [Replicate()]}[placement]
    ref = state(1)
    ours = [distribute_tensor(t.clone(), mesh, placements) for t in ref]
    locals_ = [t._local_tensor for t in ours]
    sgd(*ours, lr=0.1, beta=0.9)
    eager(*ref, lr=0.1, beta=0.9)
    for got, local, want in zip(ours, locals_, ref):
        assert isinstance(got, DTensor) and got.placements == tuple(placements)
        assert got._local_tensor is local  # updated in place, not a redistributed copy
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-12, atol=1e-14)


def test_foreach_with_other_placements_per_update_and_a_tensor_scalar(mesh, sgd):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    refs = [state(2), state(3, (5,))]
    placements = [[Shard(1)], [Replicate()]]
    ours = [[distribute_tensor(t.clone(), mesh, pl) for t in r] for r, pl in zip(refs, placements)]
    lr = distribute_tensor(torch.tensor(0.05, dtype=torch.float64), mesh, [Replicate()])
    sgd.foreach(*[list(ts) for ts in zip(*ours)], lr=lr, beta=0.5)
    for ts, r in zip(ours, refs):
        eager(*r, lr=0.05, beta=0.5)
        for got, want in zip(ts, r):
            torch.testing.assert_close(got.full_tensor(), want, rtol=1e-12, atol=1e-14)
    # torch.ops.fusegen.<name> called directly, positional scalars
    ref = state(4)
    direct = [distribute_tensor(t.clone(), mesh, [Shard(0)]) for t in ref]
    torch.ops.fusegen.t_dt_sgd(*direct, 0.1, 0.9)
    eager(*ref, lr=0.1, beta=0.9)
    torch.testing.assert_close(direct[0].full_tensor(), ref[0], rtol=1e-12, atol=1e-14)


def test_mismatches_are_errors_naming_the_argument(mesh, sgd):
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    p, g, m = state(5)
    dp, dm = (distribute_tensor(t, mesh, [Shard(0)]) for t in (p, m))
    with pytest.raises(RuntimeError, match=r"'t_dt_sgd' on DTensors: argument 'g' has placements "
                                           r"\(Replicate\(\),\).*expected the same mesh, placements"):
        sgd(dp, distribute_tensor(g, mesh, [Replicate()]), dm, lr=0.1, beta=0.9)
    with pytest.raises(RuntimeError, match="argument 'g' is a torch.Tensor while 'p' is a DTensor"):
        sgd(dp, g, dm, lr=0.1, beta=0.9)
    partial = torch.distributed.tensor.DTensor.from_local(g, mesh, [Partial()])
    pp, pm = (torch.distributed.tensor.DTensor.from_local(t.clone(), mesh, [Partial()]) for t in (p, m))
    with pytest.raises(RuntimeError, match="argument 'p' has placements.*Partial"):
        sgd(pp, partial, pm, lr=0.1, beta=0.9)
    with pytest.raises(RuntimeError, match=r"argument 'g\[0\]'"):
        sgd.foreach([dp], [distribute_tensor(g, mesh, [Shard(1)])], [dm], lr=0.1, beta=0.9)
    lr = torch.distributed.tensor.DTensor.from_local(torch.tensor(0.1, dtype=torch.float64), mesh, [Partial()])
    with pytest.raises(RuntimeError, match=r"scalar tensor 'lr' has placements \(Partial"):
        sgd.foreach([dp], [distribute_tensor(g, mesh, [Shard(0)])], [dm], lr=lr, beta=0.9)


def test_a_failed_registration_warns(monkeypatch):
    """A torch whose private DTensor dispatcher moved: a warning naming the step op, never an
    error in `fuse` or in `import torch.distributed.tensor`."""
    from fusegen.pytorch import dtensor

    with pytest.warns(RuntimeWarning, match="no DTensor rule for step op t_dt_missing"):
        dtensor._register_step_now(("t_dt_missing", ()))  # no such op: getattr fails

"""DTensor: every op of a family has a pointwise sharding rule (fusegen/pytorch/dtensor.py). Two CPU
ranks (gloo) run tests/dtensor_ranks.py once: the ops built once into one shared cache,
sharded/replicated/broadcast inputs without redistribution, the backward op's output mask
and Partial gradient, a double backward, a tensor-parallel MLP and DDP against one process.
The NCCL twin is tests/gpu/test_dtensor_nccl.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dtensor_ranks import CHECKS, run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    return run_ranks(tmp_path_factory, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("check", list(CHECKS))
def test_on_two_ranks(failures, check):
    if check in failures:
        pytest.fail("\n".join(failures[check]), pytrace=False)


# A fresh interpreter: fusegen's rule must reach DTensor whichever is imported first, and a
# cached load must not import torch.distributed.tensor (0.4 s) itself.
ORDER = """
import os, sys, torch, torch.distributed as dist
dtensor_first = sys.argv[1] == "dtensor-first"
if dtensor_first:
    import torch.distributed.tensor
import fusegen
op = fusegen.fuse("a*b+c", name="dt_order")
assert dtensor_first or "torch.distributed.tensor" not in sys.modules, "fuse imported DTensor"
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
a, b, c = (distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]) for _ in range(3))
out = op(a, b, c)
assert out.placements == (Shard(0),), out.placements
torch.testing.assert_close(out.full_tensor(), a.full_tensor() * b.full_tensor() + c.full_tensor())
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("order", ["fusegen-first", "dtensor-first"])
def test_import_order(order):
    from dtensor_ranks import free_port

    proc = subprocess.run([sys.executable, "-c", ORDER, order, str(free_port())], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_failed_registration_warns(monkeypatch):
    """A torch whose private DTensor API moved: a warning naming the op, never an error in
    `fuse` or in `import torch.distributed.tensor` (where the import hook registers)."""
    from fusegen.pytorch import dtensor
    from fusegen.ir.family import Member

    def moved(members):
        raise AttributeError("module 'torch.distributed.tensor._ops.utils' has no attribute 'register_op_strategy'")
    monkeypatch.setattr(dtensor, "_register_rules", moved)
    with pytest.warns(RuntimeWarning, match="no DTensor sharding rule for dt_moved and its family"):
        dtensor._register_now((Member("dt_moved", 1, False, False),))

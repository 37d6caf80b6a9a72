"""Data-parallel training with fused activations and fusegen.optim.AdamW on two CPU ranks
(gloo), from tests/distributed_ranks.py, spawned once: the ops built once into one shared
cache; DDP, and FSDP2 (`fully_shard`, DTensor params stepped shard by shard), each 20 steps
against one process with eager activations and torch.optim.AdamW, in float64. The NCCL twin
is tests/gpu/test_distributed_nccl.py."""

from __future__ import annotations

import pytest
import torch

from distributed_ranks import CHECKS, run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(tmp_path_factory, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("check", list(CHECKS))
def test_on_two_ranks(results, check, capsys):
    failures, figures = results
    if check in failures:
        pytest.fail("\n".join(failures[check]), pytrace=False)
    if check in figures:  # the largest differences from the one-process run, in the test log
        with capsys.disabled():
            print(f"\n{check}: {figures[check]}")

"""The NCCL twin of tests/test_dtensor.py: the same rank checks (tests/dtensor_ranks.py:
the ops built once into one shared cache, sharded/replicated/broadcast inputs without
redistribution, the backward op's output mask and Partial gradient, a double backward, a
tensor-parallel MLP and DDP, against one process) on two GPUs, one rank per GPU, NCCL.
Needs a machine with two GPUs:

    PYTHONPATH=. python -m pytest -q -m cuda tests/gpu/test_dtensor_nccl.py
"""

from __future__ import annotations

import pytest
import torch

from dtensor_ranks import CHECKS, run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
    pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                       reason="torch built without NCCL"),
]


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    from fusegen.build.builder import cuda_enabled

    if not cuda_enabled():
        pytest.fail("torch sees GPUs but fusegen builds without CUDA (nvcc missing? FUSEGEN_CPU_ONLY=1?)")
    return run_ranks(tmp_path_factory, "cuda")


@pytest.mark.parametrize("check", list(CHECKS))
def test_on_two_gpus(failures, check):
    if check in failures:
        pytest.fail("\n".join(failures[check]), pytrace=False)

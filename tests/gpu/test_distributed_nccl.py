"""The NCCL twin of tests/test_distributed.py: the same rank checks (tests/distributed_ranks.py:
the ops built once into one shared cache; DDP and FSDP2 training with fused activations and
fusegen.optim.AdamW, 20 steps against one process with eager activations and
torch.optim.AdamW, float64) on two GPUs, one rank per GPU, NCCL; and the optimizer step of a
115M-param float32 decoder under FSDP2 timed beside torch.optim.AdamW(fused=True) and
(foreach=True), printed. Needs a machine with two GPUs:

    PYTHONPATH=. python -m pytest -q -m cuda tests/gpu/test_distributed_nccl.py
"""

from __future__ import annotations

import pytest
import torch

from distributed_ranks import CHECKS, run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
    pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                       reason="torch built without NCCL"),
]

GPU_CHECKS = (*CHECKS, "fsdp2_step_time")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from fusegen.build.builder import cuda_enabled

    if not cuda_enabled():
        pytest.fail("torch sees GPUs but fusegen builds without CUDA (nvcc missing? FUSEGEN_CPU_ONLY=1?)")
    return run_ranks(tmp_path_factory, "cuda", GPU_CHECKS)


@pytest.mark.parametrize("check", GPU_CHECKS)
def test_on_two_gpus(results, check, capsys):
    failures, figures = results
    if check in failures:
        pytest.fail("\n".join(failures[check]), pytrace=False)
    if check in figures:
        with capsys.disabled():
            print(f"\n{check}: {figures[check]}")

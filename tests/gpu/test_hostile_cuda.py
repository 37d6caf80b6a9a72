"""The CUDA build through a cache path that holds shell and ninja syntax (tests/test_hostile.py
on the CPU): nvcc compiles the op's .cu units through the same plain-path link, the op
library finds the runtime through its `$ORIGIN` rpath in a fresh process, and the kernels
run. Run on a GPU machine with

    PYTHONPATH=. python -m pytest -m cuda tests/gpu/test_hostile_cuda.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import TESTS, seed_runtime

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCRIPT = r"""
import sys, torch, fusegen
from fusegen.build import builder as build
assert build.cuda_enabled(), "fusegen builds without CUDA here"
op = fusegen.fuse("x*sigmoid(x)*alpha + y", scalars=["alpha"], name="hostile_cuda")
x = torch.randn(4097, device="cuda", requires_grad=True)
y = torch.randn(4097, device="cuda")
out = op(x, y, alpha=0.5)
out.sum().backward()
ref = x.detach().requires_grad_(True)
(ref * torch.sigmoid(ref) * 0.5 + y).sum().backward()
torch.testing.assert_close(x.grad, ref.grad)
print(op.library.cached)
"""


def test_a_cuda_op_builds_and_runs_from_a_hostile_cache_path(tmp_path):
    root = tmp_path / "my cache 'q\" ;touch PWNED; $x :y"
    seed_runtime(root)
    env = dict(os.environ, FUSEGEN_CACHE_DIR=str(root), PYTHONPATH=str(TESTS.parent), x="; touch PWNED ;")
    outs = []
    for _ in range(2):  # built, then loaded from the cache by a fresh process
        r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True,
                           env=env, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        outs.append(r.stdout.split()[-1])
    assert outs == ["False", "True"]
    assert not list(tmp_path.rglob("PWNED*"))

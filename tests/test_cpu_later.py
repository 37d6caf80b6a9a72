"""An op library that leaves its CPU kernels for later (OpDef::cpu_later, the NVRTC route's
default on a GPU machine, where a new op then compiles its descriptor alone): forced here on
the CPU, its first CPU call builds the ops whole (builder.load_cpu_kernels, through
fusegen::__cpu_kernels), once, in this process and in a later one, and the results are
eager's in float64."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusegen
from fusegen.build import builder

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def later(monkeypatch):
    monkeypatch.setattr(builder, "cpu_later", lambda cuda: True)


def _entries() -> set[str]:
    return {p.name for p in builder.cache_dir().iterdir() if (p / builder.CPU_LATER_MARK).is_file()}


def test_the_first_cpu_call_builds_the_op_whole(later):
    op = fusegen.fuse("a*b + c*alpha", name="later_fma", scalars=["alpha"])
    entry = op.library.path.parent
    assert (entry / builder.CPU_LATER_MARK).is_file()
    (unit,) = [p for p in entry.glob("unit*.cpp")]
    assert unit.read_text().startswith("#define FUSEGEN_CPU_LATER\n")
    symbols = subprocess.run(["nm", "-C", "--defined-only", str(op.library.path)], capture_output=True,
                             text=True).stdout
    assert "forward_cpu" not in symbols and "run_cpu" not in symbols  # the descriptor alone
    assert "later_fma" in builder._CPU_LATER
    a, b, c = (torch.randn(257, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = op(a, b, c, alpha=0.25)
    torch.testing.assert_close(out, a * b + c * 0.25)
    assert "later_fma" not in builder._CPU_LATER
    out.sum().backward()
    torch.testing.assert_close(a.grad, b.detach())
    torch.testing.assert_close(c.grad, torch.full_like(c, 0.25))
    whole = builder.build([(n, f) for n, f in builder._entry_sources(entry)], whole=True)
    assert whole.cached and whole.key != op.library.key  # the op built whole: found, not built again


def test_a_batch_builds_whole_once_and_a_new_process_finds_it(later, tmp_path):
    ops = fusegen.fuse_many([{"expr": "x*y + 1", "name": "later_b1"}, {"expr": "tanh(x)*y", "name": "later_b2"}])
    x, y = (torch.randn(64, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(ops[0](x, y), x * y + 1)
    assert "later_b1" not in builder._CPU_LATER and "later_b2" not in builder._CPU_LATER  # one build, both
    torch.testing.assert_close(ops[1](x, y), torch.tanh(x) * y)
    # A new process loads the batch from the request index, and its first CPU call finds
    # the whole library in the cache: nothing is compiled.
    code = ("import torch, fusegen\nfrom fusegen.build import builder\n"
            "builder.cpu_later = lambda cuda: True\n"
            "ops = fusegen.fuse_many([{'expr': 'x*y + 1', 'name': 'later_b1'}, {'expr': 'tanh(x)*y', 'name': 'later_b2'}])\n"
            "assert ops[0].library.cached\n"
            "x = torch.randn(8, dtype=torch.float64)\n"
            "torch.testing.assert_close(ops[1](x, x), torch.tanh(x) * x)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert "building" not in result.stderr, result.stderr


def test_an_entry_gone_before_the_first_cpu_call_is_a_clear_error(later, tmp_path):
    """The CPU kernels come from the sources in the library's entry: when it went (the cache
    cleared under a running process), the first CPU call says so and how to recover."""
    import shutil
    op = fusegen.fuse("a*b - c", name="later_gone")
    assert "later_gone" in builder._CPU_LATER
    builder._CPU_LATER["later_gone"] = lambda: builder._entry_sources(tmp_path / "gone")
    a = torch.randn(4, dtype=torch.float64)
    from fusegen.errors import LoadError
    with pytest.raises(LoadError, match=r"fusegen: the CPU kernels of later_gone are built from the sources "
                                        r"in its cache entry, which cannot be read .*fusegen.fuse again"):
        op(a, a, a)
    shutil.rmtree(tmp_path, ignore_errors=True)

"""Compile only what is used, when first used: an op's auxiliary ops (`<name>_grad2` for the
double backward, `<name>_jvp` for forward mode) are built on their first use, not with the
op; then they give eager's results. The generated folder keeps every file."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from torch.func import jvp

import fusegen
from fusegen.api import Request
from fusegen.build import builder as fbuild
from fusegen.pytorch import autograd

from conftest import seed_runtime


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory):
    """A cache holding only the runtime: every op here is compiled here, and its builds and
    the libraries it leaves can be counted."""
    cache = tmp_path_factory.mktemp("lazy-cache")
    cache.chmod(0o700)
    seed_runtime(cache)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSEGEN_CACHE_DIR", str(cache))
        yield cache


def _cached_ops() -> list[list[str]]:
    """The ops of every library in the cache (entry.json)."""
    out = []
    for entry in fbuild.cache_dir().glob("*/entry.json"):
        out.append(json.loads(entry.read_text()).get("ops", []))
    return out


def _builds(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if getattr(r, "fusegen_build", None) == "start"]


def _eager(x, y, alpha=0.75):
    return torch.tanh(x) * y * alpha + x * x


def test_fp32_forward_backward_never_compiles_the_auxiliary_ops(caplog):
    caplog.set_level(logging.INFO, logger="fusegen")
    op = fusegen.fuse("tanh(x)*y*alpha + x*x", name="lz_plain", scalars=["alpha"])
    assert {"lz_plain_grad2", "lz_plain_jvp"} <= set(autograd.pending_auxiliary())
    x, y = (torch.randn(33, requires_grad=True) for _ in range(2))
    op(x, y, alpha=0.5).sum().backward()
    torch.ops.fusegen.lz_plain(x, y, 0.5).sum().backward()
    with torch.no_grad():
        op(x, y, alpha=0.5)
    assert {"lz_plain_grad2", "lz_plain_jvp"} <= set(autograd.pending_auxiliary())
    assert not hasattr(torch.ops.fusegen, "lz_plain_grad2") and not hasattr(torch.ops.fusegen, "lz_plain_jvp")
    ops = _cached_ops()
    assert ["lz_plain"] in ops and not any(n.startswith("lz_plain_") for lib in ops for n in lib), ops
    # The op's library holds its own files only; the generated folder all of them.
    assert "lz_plain_grad2.cpp" not in op.generated.own_files and "lz_plain_grad2.cpp" in op.files
    assert not [m for m in _builds(caplog) if "lz_plain_" in m]


def test_first_double_backward_builds_grad2_once_and_matches_eager(caplog):
    """Through torch.ops (the runtime's double-backward node asks fusegen::__auxiliary)."""
    caplog.set_level(logging.INFO, logger="fusegen")
    fusegen.fuse("tanh(x)*y*alpha + x*x", name="lz_gg", scalars=["alpha"])
    raw = torch.ops.fusegen.lz_gg
    x, y = (torch.randn(9, dtype=torch.float64, requires_grad=True) for _ in range(2))
    caplog.clear()
    assert torch.autograd.gradgradcheck(lambda a, b: raw(a, b, 0.75), (x, y))
    assert [m for m in _builds(caplog) if "lz_gg" in m] == ["building op(s) lz_gg_grad2 for CPU"]
    assert "lz_gg_grad2" not in autograd.pending_auxiliary() and "lz_gg_jvp" in autograd.pending_auxiliary()
    results = []
    for f in (lambda a, b: raw(a, b, 0.75), _eager):
        g = torch.autograd.grad(f(x, y).pow(2).sum(), (x, y), create_graph=True)
        results.append(torch.autograd.grad(sum(t.sum() for t in g), (x, y)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
    assert not [m for m in _builds(caplog) if "lz_gg" in m and "grad2" not in m]  # built once


def test_first_jvp_builds_jvp_once_and_matches_eager(caplog):
    """Through a FusedOp under torch.func (the Python path asks autograd._op), then
    forward_ad through torch.ops (the runtime's tangent): one build."""
    caplog.set_level(logging.INFO, logger="fusegen")
    op = fusegen.fuse("tanh(x)*y*alpha + x*x", name="lz_fwd", scalars=["alpha"])
    x, y, tx, ty = (torch.randn(9, dtype=torch.float64) for _ in range(4))
    caplog.clear()
    out, tangent = jvp(lambda a, b: op(a, b, alpha=0.75), (x, y), (tx, ty))
    want, want_tangent = jvp(_eager, (x, y), (tx, ty))
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(tangent, want_tangent)
    want_x = jvp(lambda a: _eager(a, y), (x,), (tx,))[1]
    with torch.autograd.forward_ad.dual_level():
        dual = torch.ops.fusegen.lz_fwd(torch.autograd.forward_ad.make_dual(x, tx), y, 0.75)
        torch.testing.assert_close(torch.autograd.forward_ad.unpack_dual(dual).tangent, want_x)
    assert [m for m in _builds(caplog) if "lz_fwd" in m] == ["building op(s) lz_fwd_jvp for CPU"]
    assert "lz_fwd_grad2" in autograd.pending_auxiliary()


@pytest.mark.slow
def test_one_batch_builds_its_auxiliary_ops_of_one_kind_together(caplog):
    """fuse_many's ops were built in one library; the first double backward of one builds
    the batch's `_grad2` ops in one library too, and no `_jvp`."""
    caplog.set_level(logging.INFO, logger="fusegen")
    a, b = fusegen.fuse_many([{"expr": "sin(x)*y", "name": "lz_b1"}, {"expr": "x*x*y", "name": "lz_b2"}])
    x, y = (torch.randn(5, dtype=torch.float64, requires_grad=True) for _ in range(2))
    caplog.clear()
    assert torch.autograd.gradgradcheck(lambda s, t: a(s, t), (x, y))
    assert [m for m in _builds(caplog) if "lz_b" in m] == ["building op(s) lz_b1_grad2, lz_b2_grad2 for CPU"]
    assert torch.autograd.gradgradcheck(lambda s, t: b(s, t), (x, y))
    assert [m for m in _builds(caplog) if "lz_b" in m] == ["building op(s) lz_b1_grad2, lz_b2_grad2 for CPU"]
    assert {"lz_b1_jvp", "lz_b2_jvp"} <= set(autograd.pending_auxiliary())
    b.load_auxiliary()
    assert hasattr(torch.ops.fusegen, "lz_b2_jvp") and "lz_b2_jvp" not in autograd.pending_auxiliary()


CACHED_DOUBLE_BACKWARD = """
import sys, torch, fusegen
from fusegen.pytorch import autograd
op = fusegen.fuse("tanh(x)*y*alpha + x*x", name="lz_index", scalars=["alpha"])
print(op.library.cached, autograd.pending_auxiliary())
x, y = (torch.randn(6, dtype=torch.float64, requires_grad=True) for _ in range(2))
print(torch.autograd.gradgradcheck(lambda a, b: torch.ops.fusegen.lz_index(a, b, 0.5), (x, y)))
print(autograd.pending_auxiliary())
"""


@pytest.mark.slow
def test_an_op_from_the_index_builds_its_auxiliary_ops_on_first_use_too():
    """A new process finds the op in the request index (no pipeline) with its auxiliary ops
    pending; its first double backward builds, the next process's finds the cache's."""
    runs = [subprocess.run([sys.executable, "-c", CACHED_DOUBLE_BACKWARD], capture_output=True, text=True)
            for _ in range(3)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    first, second, third = (r.stdout.splitlines() for r in runs)
    assert first == ["False ['lz_index_grad2', 'lz_index_jvp']", "True", "['lz_index_jvp']"], runs[0]
    assert second == third == ["True ['lz_index_grad2', 'lz_index_jvp']", "True", "['lz_index_jvp']"]
    assert "building op(s) lz_index_grad2" in runs[0].stderr and "building" not in runs[2].stderr


def test_generated_files_keep_the_auxiliary_ops():
    """The generated files (what `fusegen --out`, generated/ and `fusegen package` build with
    ninja) still hold the auxiliary ops."""
    from fusegen.api import generate
    g = generate(Request("x*y", "lz_files"))
    assert {"lz_files_grad2.cpp", "lz_files_jvp.cu", "lz_files.cpp"} <= set(g.files)
    assert set(g.own_files) | set(g.auxiliary_files("lz_files_grad2")) | set(g.auxiliary_files("lz_files_jvp")) \
        == set(g.files)
    assert "lz_files_jvp.cpp" not in g.auxiliary_files("lz_files_grad2")

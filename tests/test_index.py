"""The cached path: a request built before, in any process, is loaded
through the request index (fusegen/build/index.py) without importing sympy or Jinja, and the
index never hands back a library that is gone or that another generator made. And @fused
functions defined together are built together, in one library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import fusegen
from fusegen import api
from fusegen.build import index, keys
from fusegen.build import builder as fbuild
from fusegen.api import Request

from conftest import TESTS

CACHED_LOAD = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from corpus import CORPUS
import fusegen
from fusegen.api import Request
case = next(c for c in CORPUS if c.name == "cp_fma")
op = fusegen.fuse_many([Request(case.expr, case.name, case.inputs, case.scalars)])[0]
light = not any(m in sys.modules for m in ("sympy", "jinja2", "fusegen.ir.spec", "fusegen.codegen.render",
                                          "fusegen.pytorch.step"))  # the step module: step ops only
a, b, c = (torch.randn(7, dtype=torch.float64) for _ in range(3))
torch.testing.assert_close(op(a, b, c), a * b + c)
print(light, op.library.cached, op.library.key, op.backward_op is not None)
spec = op.spec                           # asked for: the pipeline runs, once
print(spec.inputs == op.params and "sympy" in sys.modules)
"""


def _run(script: str, *args: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env=dict(os.environ), check=True).stdout.split()


def test_a_cached_load_imports_neither_sympy_nor_jinja(corpus_ops):
    out = _run(CACHED_LOAD, str(TESTS))
    assert out == ["True", "True", corpus_ops["cp_fma"].library.key, "True", "True"]


HIGHER_ORDER_AFTER_A_CACHED_LOAD = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from corpus import CORPUS
import fusegen
from fusegen.api import Request
case = next(c for c in CORPUS if c.name == "cp_silu")
op = fusegen.fuse_many([Request(case.expr, case.name, case.inputs, case.scalars)])[0]
x = torch.randn(6, dtype=torch.float64, requires_grad=True)
eager = lambda x: x * torch.sigmoid(x)
def derivatives(f, order):
    out, y = [], f(x).sum()
    for k in range(order):
        (y,) = torch.autograd.grad(y, x, create_graph=k < order - 1)
        out.append(y)
        y = y.sum()
    return out
for got, want in zip(derivatives(op, 2), derivatives(eager, 2)):
    torch.testing.assert_close(got, want)
# second order: the C++ kernels, nothing derived (torch.testing itself imports sympy)
light = not any(m in sys.modules for m in ("fusegen.pytorch.derivatives", "fusegen.ir.spec"))
torch.testing.assert_close(derivatives(op, 3)[2], derivatives(eager, 3)[2])   # composite
t = torch.randn(6, dtype=torch.float64)
torch.testing.assert_close(torch.func.jvp(op, (x.detach(),), (t,))[1], torch.func.jvp(eager, (x.detach(),), (t,))[1])
torch.testing.assert_close(torch.vmap(op)(x.detach().view(2, 3)), eager(x.detach().view(2, 3)))
print(light, op.library.cached)
"""


def test_higher_order_and_torch_func_after_a_cached_load(corpus_ops):
    """The index's family description registers vmap rules and autograd kernels without
    sympy; second order runs on the C++ kernels; third order and torch.func derive on
    first need and match eager. The auxiliary ops, built on first use in an earlier
    process, are found through the index too (no pipeline)."""
    corpus_ops["cp_silu"].load_auxiliary()
    assert _run(HIGHER_ORDER_AFTER_A_CACHED_LOAD, str(TESTS)) == ["True", "True"]


def _request(corpus_ops, name="cp_fma") -> Request:
    from corpus import CORPUS
    case = next(c for c in CORPUS if c.name == name)
    return Request(case.expr, case.name, case.inputs, case.scalars)


def test_the_index_points_at_the_library_the_pipeline_finds(corpus_ops):
    entry = index.lookup(_request(corpus_ops))
    op = corpus_ops["cp_fma"]
    assert entry is not None and entry.library.path == op.library.path
    assert entry.library.runtime == op.library.runtime
    assert (entry.name, entry.inputs, entry.scalars, entry.text) == (op.name, op.spec.inputs, op.spec.scalars,
                                                                      op.spec.text)
    assert entry.digest == keys.files_digest(op.files)


def test_a_miss_on_anything_that_changes_the_files(corpus_ops, monkeypatch):
    request = _request(corpus_ops)
    key = keys.request_key(request)
    assert keys.request_key(Request(request.expr, "other_name", request.inputs)) != key
    assert keys.request_key(Request(request.expr, request.name, ("c", "b", "a"))) != key
    monkeypatch.setattr(keys, "generator_digest", lambda: "an edited template")
    assert keys.request_key(request) != key
    assert index.lookup(request) is None


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A fresh cache with the runtime in it, and a fresh in-process memo."""
    from conftest import seed_runtime
    seed_runtime(tmp_path / "cache")
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(api, "_MEMO", {})
    return tmp_path / "cache"


def test_an_index_entry_whose_library_is_gone_or_corrupt_is_a_miss(own_cache, monkeypatch):
    request = Request("x*3.5 - y", name="ix_gone")
    op = fusegen.fuse_many([request])[0]
    assert index.lookup(request).library.path == op.library.path
    path = own_cache / "index" / f"{keys.request_key(request)}.json"
    data = json.loads(path.read_text())
    path.write_text("{not json")
    assert index.lookup(request) is None
    path.write_text(json.dumps(dict(data, format=0)))
    assert index.lookup(request) is None
    path.write_text(json.dumps(data))
    shutil.rmtree(op.library.path.parent)            # trimmed from the cache
    assert index.lookup(request) is None
    # the long way then rebuilds it (in a new process: this one has its ops) and rewrites the entry
    script = ("import fusegen\nop = fusegen.fuse('x*3.5 - y', name='ix_gone')\n"
              "print(op.library.cached, op.library.path.is_file())\n")
    assert _run(script) == ["False", "True"]
    assert index.lookup(request).library.path == op.library.path


def test_fused_functions_defined_together_build_together(own_cache, monkeypatch):
    builds = []
    real = fbuild.build
    monkeypatch.setattr(fbuild, "build", lambda ops, *a, **k: builds.append([n for n, _ in ops]) or real(ops, *a, **k))

    def make_first():
        @fusegen.fused(name="ix_first")
        def first(x, y):
            return torch.relu(x) * y
        return first

    first = make_first()

    @fusegen.fused(name="ix_second")
    def second(x, alpha: float = 2.0):
        return torch.tanh(x) * alpha

    assert builds == []                               # defined, checked, not built
    x, y = torch.randn(11, dtype=torch.float64), torch.randn(11, dtype=torch.float64)
    torch.testing.assert_close(second(x), torch.tanh(x) * 2.0)  # the first call builds both
    assert builds == [["ix_first", "ix_second"]]
    torch.testing.assert_close(first(x, y), torch.relu(x) * y)
    assert builds == [["ix_first", "ix_second"]] and first.op.library.key == second.op.library.key
    again = make_first()                              # the same source again: found, not built
    assert again._op is first.op and builds == [["ix_first", "ix_second"]]


def test_build_pending_builds_now_and_a_failed_build_keeps_them_waiting(own_cache, monkeypatch):
    def broken(ops, *a, **k):
        raise fusegen.FusegenError("fusegen: building failed (test)")

    @fusegen.fused(name="ix_later")
    def later(x):
        return torch.sigmoid(x) * x

    monkeypatch.setattr(fbuild, "build", broken)
    with pytest.raises(fusegen.FusegenError, match="test"):
        later(torch.randn(3))
    monkeypatch.undo()
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(own_cache))
    fusegen.build_pending()
    assert later._op is not None
    x = torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(later(x), torch.sigmoid(x) * x)


def test_an_op_found_in_the_index_keeps_the_files_at_hand(corpus_ops, monkeypatch):
    """load_requests given a request's generated files (the CLI has them) and finding its op
    in the index: the op takes those files, so its spec is not derived again."""
    op, request = corpus_ops["cp_fma"], _request(corpus_ops)
    generated = op.generated
    found = api.FusedOp(op.entry, request=request)  # as a lookup in the index makes it: no spec yet
    monkeypatch.setattr(api, "cached", lambda r: found)
    monkeypatch.setattr(api, "generate", lambda r: pytest.fail("the spec was derived again"))
    api.load_requests([(request, generated)])
    assert found.generated is generated



TWO_LIBRARIES = """
import sys
import fusegen
from fusegen.api import Request
from fusegen.build import builder, index
from fusegen.errors import FusegenError
if sys.argv[1] == "first":
    fusegen.fuse("a - 1", name="idx_twice")
    raise SystemExit
old = index.lookup(Request("a - 1", "idx_twice")).library
fusegen.fuse("a - 2", name="idx_twice")           # registers fusegen::idx_twice
try:
    builder.load(old)                               # registers it again, from a static initializer
    print("loaded")
except FusegenError as err:
    print("error", "idx_twice" in str(err) and "unregistered" in str(err))
"""


def test_a_registration_that_fails_in_a_library_is_an_error_not_a_crash(tmp_path, monkeypatch):
    """Two libraries defining one op name in one process: the second's registration fails in
    its static initializer, where an exception would end the process; the runtime keeps the
    error and the loader raises it."""
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(tmp_path / "cache"))
    for step in ("first", "second"):
        run = subprocess.run([sys.executable, "-c", TWO_LIBRARIES, step], capture_output=True, text=True,
                             env=dict(os.environ))
        assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["error", "True"], run.stdout + run.stderr[-2000:]

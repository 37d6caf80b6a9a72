"""The three front ends: the CLI (as a subprocess), fuse(), and @fused.

Builds are the cost here (~15-20 s each on two cores), so: one real CLI build, two
decorator builds (bare and named), and fuse() tests that reuse the test run's corpus
library (fuse with a corpus op's expression and name finds it already loaded)."""

from __future__ import annotations

import json
import re
import math
import os
import subprocess
import sys
import uuid

import pytest
import torch

from fusegen.files import runtime_files

import fusegen
from fusegen import FusegenError
from fusegen.build import builder as fbuild
def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fusegen", *args], capture_output=True, text=True,
                          cwd=cwd, env=dict(os.environ), timeout=300)


def unique(prefix):
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


# -- CLI -------------------------------------------------------------------------------------

def test_cli_no_build_writes_files(tmp_path):
    r = run_cli("a*b+c", "--name", "cli_fma", "--out", str(tmp_path), "--no-build")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "cli_fma"
    names = {p.name for p in out.iterdir()}
    assert names == {f"cli_fma{aux}{ext}" for aux in ("", "_grad2", "_jvp") for ext in (".cpp", ".cu", ".h")} | {"spec.json"}
    assert {p.name for p in (tmp_path / "_runtime").iterdir()} == set(runtime_files())  # one copy, beside
    spec = json.loads((out / "spec.json").read_text())
    assert spec["expression"] == "a*b+c" and spec["inputs"] == ["a", "b", "c"] and spec["passthrough"] == ["c"]
    assert "torch.ops.fusegen.cli_fma(a, b, c)" in r.stdout
    assert "d/dc = grad" in r.stdout
    # (a long string literal is wrapped into adjacent literals, which C concatenates)
    cpp = re.sub(r'"\n\s*"', "", (out / "cli_fma.cpp").read_text())
    # The schemas the runtime defines: the user's names forward, the C names backward.
    assert '"cli_fma(Tensor a, Tensor b, Tensor c) -> Tensor"' in cpp
    assert '"cli_fma_backward(Tensor dout, Tensor in_a, Tensor in_b, bool[2] output_mask) -> Tensor[]"' in cpp
    # nothing was built: the cache holds no library for it
    assert "library" not in r.stdout


def test_cli_inputs_and_scalars(tmp_path):
    r = run_cli("alpha*x + y", "--name", "cli_axpy", "--inputs", "y,x", "--scalar", "alpha",
                "--out", str(tmp_path), "--no-build")
    assert r.returncode == 0, r.stderr
    assert "torch.ops.fusegen.cli_axpy(y, x, alpha)" in r.stdout
    cpp = (tmp_path / "cli_axpy" / "cli_axpy.cpp").read_text()
    assert "cli_axpy(Tensor y, Tensor x, float alpha) -> Tensor" in cpp


def test_cli_default_name_and_show(tmp_path):
    r = run_cli("x*sigmoid(x)", "--out", str(tmp_path), "--no-build", "--show")
    assert r.returncode == 0, r.stderr
    (out,) = [p for p in tmp_path.iterdir() if p.name != "_runtime"]  # the runtime's one copy beside it
    assert out.name.startswith("fused_")
    assert "sigmoid(in_x)" in r.stdout and f"===== {out}" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["sigmod(x)"], "did you mean 'sigmoid'?"),
    (["a % b"], "unsupported operator '%'"),
    (["__import__('os').system('echo hacked')"], "only named functions can be called"),
    (["a*b+c", "--inputs", "a,b"], "not among inputs"),
    (["a*b+c", "--name", "bad name"], "ASCII identifier"),
    (["a*b+c", "--scalar", "z"], "scalar 'z' is not used"),
    (["x*" * 3000 + "x"], "too long"),
])
def test_cli_errors_are_one_message(tmp_path, capsys, args, message):
    """In process (cli.main), to spare an interpreter start per case; the subprocess
    twin below checks the exit status and that no traceback escapes."""
    from fusegen.tools.cli import main

    status = main([*args, "--out", str(tmp_path), "--no-build"])
    out, err = capsys.readouterr()
    assert status == 2
    assert message in err and err.startswith("fusegen: error:")
    assert "Traceback" not in err + out and "hacked" not in out
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("args, message", [
    (["sigmod(x)"], "did you mean 'sigmoid'?"),
    (["__import__('os').system('echo hacked')"], "only named functions can be called"),
])
def test_cli_subprocess_error_exit_status(tmp_path, args, message):
    r = run_cli(*args, "--out", str(tmp_path), "--no-build")
    assert r.returncode != 0
    assert message in r.stderr and r.stderr.startswith("fusegen: error:")
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert "hacked" not in r.stdout
    assert not any(tmp_path.iterdir())


def test_cli_caret_is_printed(tmp_path):
    r = run_cli("x + sigmod(x)", "--out", str(tmp_path), "--no-build")
    lines = r.stderr.splitlines()
    i = next(k for k, l in enumerate(lines) if l.strip() == "x + sigmod(x)")
    assert lines[i + 1].index("^") == lines[i].index("sigmod")


def test_cli_build_and_check(tmp_path):
    """One real build through the CLI (~15-20 s), with --check against eager."""
    name = unique("cli_fma")
    r = run_cli("a*b+c", "--name", name, "--out", str(tmp_path), "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "built in" in r.stdout or "loaded from cache" in r.stdout
    checks = [l for l in r.stdout.splitlines() if l.startswith("check")]
    assert checks and all(" ok " in l for l in checks), r.stdout
    assert any("float64 d/da" in l for l in checks) and any("bfloat16 forward" in l for l in checks)
    # a second run is a cache hit: no rebuild
    r2 = run_cli("a*b+c", "--name", name, "--out", str(tmp_path))
    assert r2.returncode == 0, r2.stderr
    assert "loaded from cache" in r2.stdout


# -- fuse() -----------------------------------------------------------------------------------

def test_fuse_same_request_returns_same_object(corpus_ops, monkeypatch):
    """fuse() with a corpus op's expression and name finds it loaded: same object, no build."""
    monkeypatch.setattr(fbuild, "build", lambda *a, **k: pytest.fail("fuse() rebuilt a loaded op"))
    first = fusegen.fuse("a*b+c", name="cp_fma")
    second = fusegen.fuse("a*b+c", name="cp_fma")
    assert first is second is corpus_ops["cp_fma"]
    assert first.op is torch.ops.fusegen.cp_fma
    assert repr(first) == "FusedOp(torch.ops.fusegen.cp_fma: a*b+c)"


def test_fuse_same_name_other_expression_raises(corpus_ops, monkeypatch):
    monkeypatch.setattr(fbuild, "build", lambda *a, **k: pytest.fail("should not build"))
    with pytest.raises(FusegenError, match="cp_fma.*already defined"):
        fusegen.fuse("a*b-c", name="cp_fma")
    # the original still works
    a, b, c = torch.randn(3), torch.randn(3), torch.randn(3)
    torch.testing.assert_close(fusegen.fuse("a*b+c", name="cp_fma")(a, b, c), a * b + c)


def test_fuse_rejects_bad_input_before_building(monkeypatch):
    monkeypatch.setattr(fbuild, "build", lambda *a, **k: pytest.fail("should not build"))
    with pytest.raises(FusegenError):
        fusegen.fuse("a % b", name="never_built")
    with pytest.raises(FusegenError):
        fusegen.fuse("a*b", name="never_built_backward")


def test_runtime_scalar_value_never_rebuilds(corpus_ops, monkeypatch):
    case_op = corpus_ops["cp_swish_beta"]
    key = case_op.library.key
    monkeypatch.setattr(fbuild, "build", lambda *a, **k: pytest.fail("a scalar value rebuilt the op"))
    same = fusegen.fuse("x*torch.sigmoid(beta*x) + alpha*y", name="cp_swish_beta", scalars=("beta", "alpha"))
    assert same is case_op and same.library.key == key
    x, y = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    results = []
    for beta in (0.5, 1.0, 2.0):
        out = same(x, y, beta, alpha=1.5)
        torch.testing.assert_close(out, x * torch.sigmoid(beta * x) + 1.5 * y)
        results.append(out)
    assert not torch.equal(results[0], results[1])
    # the value is an argument of the schema, not a constant in the sources
    assert "float beta" in same.files["cp_swish_beta.cpp"]
    assert same.library.key == key


# -- @fused ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def decorated():
    @fusegen.fused
    def fg_swish(x, y, alpha: float):
        """silu of a scaled input, plus y."""
        s = torch.sigmoid(alpha * x)
        z = x * s
        return z + torch.nn.functional.relu(y) * math.pi

    return fg_swish


def test_fused_bare_decorator(decorated):
    op = decorated.op
    assert isinstance(op, fusegen.FusedOp) and op.name == "fg_swish"
    assert op.spec.inputs == ("x", "y") and op.spec.scalars == ("alpha",)  # float annotation
    assert decorated.__name__ == "fg_swish" and "silu" in decorated.__doc__
    assert op.op is torch.ops.fusegen.fg_swish
    x = torch.randn(100, dtype=torch.float64, requires_grad=True)
    y = torch.randn(100, dtype=torch.float64, requires_grad=True)
    for alpha in (1.0, -0.3):
        got = decorated(x, y, alpha)
        want = decorated.eager(x, y, alpha)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(decorated(x, alpha=alpha, y=y), want)
        g = torch.randn(100, dtype=torch.float64)
        for a, b in zip(torch.autograd.grad(got, (x, y), g), torch.autograd.grad(want, (x, y), g)):
            torch.testing.assert_close(a, b)


def test_fused_with_name():
    name = unique("fg_named")

    @fusegen.fused(name=name)
    def anything(a, b):
        return torch.where(a > b, a * b, torch.clamp(a - b, min=-1.0))

    assert anything.op.name == name and anything.op.op is getattr(torch.ops.fusegen, name)
    a, b = torch.randn(64), torch.randn(64)
    torch.testing.assert_close(anything(a, b), anything.eager(a, b))
    assert anything.op.spec.scalars == ()


def test_fused_rejects_bad_bodies_without_building(monkeypatch):
    monkeypatch.setattr(fbuild, "build", lambda *a, **k: pytest.fail("should not build"))
    with pytest.raises(FusegenError, match="only 'name = expression' lines"):
        @fusegen.fused
        def bad(x):
            print(x)
            return x

    with pytest.raises(FusegenError, match="not a parameter"):
        @fusegen.fused
        def bad2(x):
            return x * undefined_global  # noqa: F821


def test_fused_defaults_and_number_defaults_are_scalars():
    """Defaults work as in Python; a parameter whose default is a number is a runtime
    scalar even without an annotation (before: `f(a, b)` raised KeyError: 'beta')."""
    name = unique("fg_defaults")

    @fusegen.fused(name=name)
    def f(a, b, beta: float = 1.0, gamma=0.5):
        return a * beta + b * gamma

    assert f.op.spec.inputs == ("a", "b") and f.op.spec.scalars == ("beta", "gamma")
    a, b = torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    torch.testing.assert_close(f(a, b), a * 1.0 + b * 0.5)
    torch.testing.assert_close(f(a, b, 2.0), a * 2.0 + b * 0.5)
    torch.testing.assert_close(f(a, b, gamma=-1.0), a - b)


def test_fused_rejects_a_tensor_default(monkeypatch):
    monkeypatch.setattr(fbuild, "build", lambda *a, **k: pytest.fail("should not build"))
    with pytest.raises(FusegenError, match="parameter 'b' has default 'x'"):
        @fusegen.fused
        def bad(a, b="x"):
            return a * b


def test_fuse_scalars_as_one_string(corpus_ops, monkeypatch):
    """scalars="beta" is the name beta, not the scalars b, e, t, a."""
    monkeypatch.setattr(fbuild, "build", lambda *a, **k: pytest.fail("should not rebuild"))
    op = fusegen.fuse("x*torch.sigmoid(beta*x) + alpha*y", name="cp_swish_beta", scalars="beta,alpha")
    assert op is corpus_ops["cp_swish_beta"]
    with pytest.raises(FusegenError, match="scalar 'beta' is not used"):
        fusegen.fuse("x*y", name="never_built_scalar", scalars="beta")


def test_fuse_many_is_public_and_takes_expressions_and_dicts(corpus_ops, monkeypatch):
    monkeypatch.setattr(fbuild, "build", lambda *a, **k: pytest.fail("should not rebuild"))
    fma, swish = fusegen.fuse_many([
        {"expr": "a*b+c", "name": "cp_fma"},
        {"expr": "x*torch.sigmoid(beta*x) + alpha*y", "name": "cp_swish_beta", "scalars": ["beta", "alpha"]},
    ])
    assert fma is corpus_ops["cp_fma"] and swish is corpus_ops["cp_swish_beta"]
    with pytest.raises(FusegenError, match="each dict needs 'expr'"):
        fusegen.fuse_many([{"expression": "a*b"}])

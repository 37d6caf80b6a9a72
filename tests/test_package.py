"""`fusegen package`: a wheel of generated/fma and generated/silu, installed into a fresh
virtualenv that has torch and no fusegen, passes opcheck, gradcheck, gradgradcheck and a
forward/backward comparison with eager PyTorch there.

The virtualenv is made without system site packages and torch is installed into it from the
package index (local disk on the CI machine: about a minute, run while the wheel compiles).
A .pth pointing at the dev environment's site-packages would be faster, but that directory
holds fusegen itself (and every package the tests use), so it could not show that the wheel
needs nothing but torch. The checks run with `python -I` from an empty directory: no
PYTHONPATH, no current directory, no user site on sys.path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fusegen import package

ROOT = Path(__file__).resolve().parent.parent

def _clean_env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONWARNINGS")}
    return e


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """(wheel, the fresh venv's python) with the wheel installed."""
    import torch

    tmp = tmp_path_factory.mktemp("package")
    venv = tmp / "venv"
    python = venv / "bin" / "python"
    log = open(tmp / "venv.log", "w")
    # torch at the version the wheel is built against (the dev torch), plus expecttest, which
    # torch.library.opcheck imports
    torch_req = "torch==" + torch.__version__.split("+")[0]
    maker = subprocess.Popen(
        f"{sys.executable} -m venv {venv} && {python} -m pip install --quiet "
        f"--disable-pip-version-check '{torch_req}' expecttest",
        shell=True, stdout=log, stderr=subprocess.STDOUT, env=_clean_env(), cwd=tmp)
    try:
        out = tmp / "dist"
        r = subprocess.run([sys.executable, "-m", "fusegen", "package", str(ROOT / "generated" / "fma"),
                            str(ROOT / "generated" / "silu"), "--name", "myops", "--out", str(out)],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr
        (wheel,) = out.glob("myops-*.whl")
        assert wheel.name.endswith("-cp39-abi3-linux_x86_64.whl"), wheel.name  # one wheel, CPython >= 3.9
        assert maker.wait(timeout=900) == 0, (tmp / "venv.log").read_text()[-3000:]
    finally:
        if maker.poll() is None:
            maker.kill()
        log.close()
    r = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)],
                       capture_output=True, text=True, env=_clean_env(), cwd=tmp, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return wheel, python


CHECKS = textwrap.dedent("""
    import importlib.util, sys
    import torch
    import myops

    # nothing from fusegen: not imported, not even importable here
    assert not any(m == "fusegen" or m.startswith("fusegen.") for m in sys.modules)
    assert importlib.util.find_spec("fusegen") is None, importlib.util.find_spec("fusegen")
    assert myops.OPS == ("fma", "silu"), myops.OPS
    # the ops, their backward and auxiliary ops (forward-mode AD through the _jvp ops is wired
    # by fusegen's Python side only: the C++ autograd Function has no jvp)
    for name in ("fma", "fma_backward", "fma_grad2", "fma_jvp", "silu", "silu_backward", "silu_grad2", "silu_jvp"):
        assert hasattr(torch.ops.fusegen, name), name

    g = torch.Generator().manual_seed(0)
    def sample(n, dtype, grad=True):
        return tuple(torch.randn(5, 7, generator=g, dtype=dtype).requires_grad_(grad) for _ in range(n))

    cases = [(torch.ops.fusegen.fma, 3, lambda a, b, c: a * b + c),
             (torch.ops.fusegen.silu, 1, lambda x: x * torch.sigmoid(x))]
    for op, n, eager in cases:
        for dtype in (torch.float32, torch.float64):
            for grad in (True, False):
                result = torch.library.opcheck(op, sample(n, dtype, grad))
                assert all(v == "SUCCESS" for v in result.values()), (op, result)
        args = sample(n, torch.float64)
        assert torch.autograd.gradcheck(op, args)
        assert torch.autograd.gradgradcheck(op, args)  # second order: the fused _grad2 op
        # forward and backward against eager, float32 and float64, broadcasting
        for dtype in (torch.float32, torch.float64):
            args = tuple(torch.randn(shape, generator=g, dtype=dtype, requires_grad=True)
                         for shape in [(4, 1, 6), (3, 1), (6,)][:n])
            out, want = op(*args), eager(*args)
            torch.testing.assert_close(out, want)
            dout = torch.randn(out.shape, generator=g, dtype=dtype)
            for got, exp in zip(torch.autograd.grad(out, args, dout), torch.autograd.grad(want, args, dout)):
                torch.testing.assert_close(got, exp)
    print("wheel ok")
""")


@pytest.mark.slow
def test_wheel_in_fresh_venv_without_fusegen(wheel_venv, tmp_path):
    _, python = wheel_venv
    script = tmp_path / "check_wheel.py"
    script.write_text(CHECKS)
    r = subprocess.run([str(python), "-I", str(script)], cwd=tmp_path, env=_clean_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wheel ok" in r.stdout


@pytest.mark.slow
def test_wheel_metadata(wheel_venv):
    """The wheel pins the torch it was built against and holds one library."""
    import zipfile

    import torch

    wheel, _ = wheel_venv
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        info = z.read("myops/_build_info.py").decode()
    assert [n for n in names if n.endswith(".so")] == ["myops/_C.abi3.so"]
    assert "Requires-Dist: torch==" + torch.__version__.split("+")[0] in metadata
    assert repr(torch.__version__) in info and "CUDA_VERSION = None" in info


# -- the project it writes (no build: fast) ------------------------------------------------------

def test_project_has_one_runtime_and_each_op_once(tmp_path):
    folders = [ROOT / "generated" / "fma", ROOT / "generated" / "silu", ROOT / "generated" / "fma"]
    ops = package.write_project(folders, "myops", tmp_path / "myops", cuda=False)
    assert ops == ["fma", "silu"]
    csrc = sorted(p.name for p in (tmp_path / "myops" / "csrc").iterdir())
    assert csrc.count("fusegen-runtime.cpp") == 1
    assert [n for n in csrc if n.endswith(".cpp")] == [
        "_module.cpp", "fma.cpp", "fma_grad2.cpp", "fma_jvp.cpp", "fusegen-runtime.cpp",
        "silu.cpp", "silu_grad2.cpp", "silu_jvp.cpp"]
    assert not any(n.endswith(".cu") for n in csrc)
    package.write_project(folders, "myops", tmp_path / "cuda", cuda=True)
    assert (tmp_path / "cuda" / "csrc" / "cuda" / "fma.cu").is_file()  # not beside fma.cpp: one fma.o each
    assert "CUDA = True" in (tmp_path / "cuda" / "setup.py").read_text()


def test_project_errors(tmp_path):
    with pytest.raises(package.PackageError, match="not a generated op folder"):
        package.write_project([tmp_path], "myops", tmp_path / "p", cuda=False)
    with pytest.raises(package.PackageError, match="Python package name"):
        package.write_project([ROOT / "generated" / "fma"], "my-ops", tmp_path / "p", cuda=False)
    # a folder whose runtime differs from the others': one library cannot hold two runtimes
    import shutil
    other = tmp_path / "silu"
    shutil.copytree(ROOT / "generated" / "silu", other)
    (other / "fusegen-runtime.cpp").write_text("// another version\n")
    with pytest.raises(package.PackageError, match="the runtime must be the same"):
        package.write_project([ROOT / "generated" / "fma", other], "myops", tmp_path / "p", cuda=False)


def test_cli_package_no_build(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fusegen", "package", str(ROOT / "generated" / "fma"),
                        "--name", "myops", "--out", str(tmp_path), "--no-build"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "project" in r.stdout and (tmp_path / "myops" / "setup.py").is_file()
    bad = subprocess.run([sys.executable, "-m", "fusegen", "package", str(tmp_path), "--name", "myops",
                          "--out", str(tmp_path / "o")], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("fusegen: error:"), bad.stderr

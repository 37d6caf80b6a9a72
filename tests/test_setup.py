"""`fusegen setup`: the shared runtime built once at install time (builder.install_runtime,
into $FUSEGEN_RUNTIME_DIR here), which the first op of an empty cache then links against
instead of building the runtime into the cache."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # one runtime build


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """An environment whose runtime directory `fusegen setup` has filled."""
    base = tmp_path_factory.mktemp("setup")
    env = dict(os.environ, FUSEGEN_RUNTIME_DIR=str(base / "runtime"), FUSEGEN_CACHE_DIR=str(base / "cache"))
    cli = [sys.executable, "-m", "fusegen", "setup"]
    first = subprocess.run(cli, capture_output=True, text=True, env=env, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    assert "built in" in first.stdout and str(base / "runtime") in first.stdout
    again = subprocess.run(cli, capture_output=True, text=True, env=env, cwd=ROOT)
    assert again.returncode == 0 and "already built" in again.stdout
    return env


def test_first_op_in_an_empty_cache_builds_the_op_alone(installed, tmp_path):
    env = dict(installed, FUSEGEN_CACHE_DIR=str(tmp_path / "cache"))
    code = ("import torch, fusegen\n"
            "op = fusegen.fuse('a*b+c', name='setup_fma')\n"
            "a, b, c = (torch.randn(33, dtype=torch.float64, requires_grad=True) for _ in range(3))\n"
            "out = op(a, b, c)\n"
            "assert torch.equal(out, a * b + c)\n"
            "out.sum().backward()\n"
            "assert torch.equal(a.grad, b.detach())\n"
            "print(op.library.runtime)\n")
    result = _run(code, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(installed["FUSEGEN_RUNTIME_DIR"])
    assert not list((tmp_path / "cache").glob("runtime-*"))  # nothing of the runtime's in the cache
    assert "building the fusegen runtime" not in result.stderr
    # A later process finds the op in the request index, against the installed runtime,
    # and runs none of the pipeline (sympy is never imported).
    again = _run("import sys, torch, fusegen\n"
                 "from fusegen import api\n"
                 "op = api._from_index(api.Request.of({'expr': 'a*b+c', 'name': 'setup_fma'}))\n"
                 "assert op is not None and 'sympy' not in sys.modules\n"
                 "print(op.library.runtime)\n", env)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == result.stdout.strip()


def test_an_installed_runtime_others_can_write_is_not_used(installed, tmp_path):
    """Whoever can write the runtime's folder can put code into every process: such a
    runtime is passed over, with a warning, for one built in the cache."""
    runtime = Path(installed["FUSEGEN_RUNTIME_DIR"])
    entry = next(runtime.glob("runtime-*"))
    mode = entry.stat().st_mode
    os.chmod(entry, mode | 0o002)
    try:
        env = dict(installed, FUSEGEN_CACHE_DIR=str(tmp_path / "cache"))
        result = _run("from fusegen.build import builder as b\n"
                      "key = b.runtime_key(b.cuda_enabled())\n"
                      "print(b._installed_runtime(key, f'runtime-{key}', f'libfusegen_runtime_{key}.so'))\n", env)
    finally:
        os.chmod(entry, mode)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"
    assert "group or others can write" in result.stderr and "building the runtime in the cache" in result.stderr


def test_setup_refuses_a_folder_fusegen_did_not_make(tmp_path):
    """The runtime directory is a store like the cache: a folder with someone's files in it
    and no fusegen marker is refused, never written into."""
    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    env = dict(os.environ, FUSEGEN_RUNTIME_DIR=str(folder), FUSEGEN_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-m", "fusegen", "setup"], capture_output=True, text=True,
                            env=env, cwd=ROOT)
    assert result.returncode == 1
    assert "fusegen: error:" in result.stderr and str(folder) in result.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]

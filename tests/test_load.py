"""Ops built earlier, by the CLI or another process: `fusegen.load(name)`, `fusegen.ops.<name>`,
`fusegen.load("generated/<name>")`, and the CLI recording the request index so that a
later `fuse()` of the same request takes the fast path. Also the CLI's guard against
overwriting another op's folder, and its temporary folder for unnamed try-outs."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import fusegen
from conftest import seed_runtime
from fusegen import api
from fusegen.tools.cli import main
from fusegen.errors import BuildError, LoadError

AFTER_THE_CLI = """
import sys, torch, fusegen
name, folder = sys.argv[1], sys.argv[2]
op = fusegen.load(name)
from fusegen.ops import {name} as again
assert fusegen.ops.{name} is op and again is op
assert fusegen.fuse("a*b+c", name=name) is op       # the CLI's request, from the index
assert fusegen.load(folder) is op
print(op.library.cached, not any(m in sys.modules for m in ("sympy", "jinja2", "fusegen.ir.spec")))
a, b, c = (torch.randn(5, dtype=torch.float64) for _ in range(3))
assert torch.equal(op(a, b, c), a * b + c)
print(name in dir(fusegen.ops))
"""

FROM_THE_FOLDER = """
import sys, fusegen
op = fusegen.load(sys.argv[1])
print(op.name, op.library.cached, "sympy" not in sys.modules)
"""


@pytest.mark.slow
def test_an_op_built_by_the_cli_loads_in_a_new_process(tmp_path):
    name = f"cli_fma_{uuid.uuid4().hex[:8]}"
    seed_runtime(tmp_path / "cache")
    env = dict(os.environ, FUSEGEN_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "fusegen", "a*b+c", "--name", name, "-q"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    folder = str(tmp_path / "generated" / name)
    r = subprocess.run([sys.executable, "-c", AFTER_THE_CLI.replace("{name}", name), name, folder],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "True"] and r.stderr == ""  # cached: nothing printed
    r = subprocess.run([sys.executable, "-c", FROM_THE_FOLDER, folder], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.split() == [name, "True", "True"], r.stderr


def test_an_unknown_name_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "generated" / "nope").mkdir(parents=True)
    (tmp_path / "generated" / "nope" / "spec.json").write_text("{}")
    with pytest.raises(api.OpNotFound) as info:
        fusegen.load("nope")
    text = str(info.value)
    assert f"fusegen.load('nope'): no op named 'nope' in this process, nor in the request index {tmp_path}/empty/index/" in text
    assert "fusegen.load('generated/nope') loads it" in text and '`fusegen "EXPR" --name nope`' in text
    with pytest.raises(AttributeError, match=r"fusegen.ops.nope: fusegen.load\('nope'\): no op named") as info:
        fusegen.ops.nope
    assert not hasattr(fusegen.ops, "__wrapped__") and not hasattr(fusegen.ops, "nope")
    with pytest.raises(api.OpNotFound, match="missing/spec.json does not exist"):
        fusegen.load(tmp_path / "missing")
    with pytest.raises(LoadError, match="has no op name|cannot read"):
        fusegen.load("generated/nope")
    loaded = object()
    monkeypatch.setitem(api._OPS, "loaded_here", loaded)
    assert fusegen.load("loaded_here") is loaded  # loaded in this process: no index needed
    with pytest.raises(TypeError, match="expected an op name or a generated folder"):
        fusegen.load(3)


def test_the_cli_refuses_to_overwrite_another_expression(tmp_path, capsys):
    out = ["--out", str(tmp_path), "--no-build", "-q"]
    assert main(["a*b+c", "--name", "ow"] + out) == 0
    assert main(["a*b-c", "--name", "ow"] + out) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/ow/ holds op 'ow' for 'a*b+c' (its spec.json); this run makes 'ow' for 'a*b-c'" in err
    assert "--force" in err and '"a*b+c"' in (tmp_path / "ow" / "spec.json").read_text()
    assert main(["a*b + c", "--name", "ow"] + out) == 0  # the same op: rewritten, idempotent
    assert main(["a*b-c", "--name", "ow", "--force"] + out) == 0
    assert '"a*b-c"' in (tmp_path / "ow" / "spec.json").read_text()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert main(["a*b", "--name", "mine"] + out) == 2
    assert "files that are not a fusegen op" in capsys.readouterr().err


def test_an_unnamed_check_writes_into_a_temporary_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    written = []
    import fusegen.api
    real_write = __import__("fusegen.files", fromlist=["write"]).write
    monkeypatch.setattr("fusegen.files.write", lambda files, d: (Path(d).name == "_runtime" or written.append(Path(d)))
                        and None or real_write(files, d))  # the op's folder, not the runtime's beside it
    monkeypatch.setattr(fusegen.api, "load_generated", lambda g: (written.append(Path(written[0]).exists()),
                                                                  (_ for _ in ()).throw(BuildError("stopped"))))
    assert main(["x*y + 1", "--check"]) == 1
    folder, existed = written
    assert existed and not folder.exists()  # written, then removed with its temporary folder
    assert not (tmp_path / "generated").exists()
    assert "(temporary: pass --out DIR or --name to keep them)" in capsys.readouterr().out
    assert main(["x*y + 1", "--no-build", "-q"]) == 0  # no --check: the files are the point
    assert any((tmp_path / "generated").iterdir())

"""fusegen/files.py is the one place that writes files: atomic, umask-honouring, and it
leaves unchanged files alone. The build stage does not import the render stage."""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fusegen import files

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fusegen"


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask():
    """Set the process umask for one test, and put it back."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda value: os.umask(value)
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002, 0o077])
def test_new_files_honour_the_umask(tmp_path, umask, mask):
    umask(mask)
    paths = files.write({"a.cpp": "int a;\n", "spec.json": "{}\n"}, tmp_path / "op")
    for path in paths:
        assert mode(path) == 0o666 & ~mask, (path.name, oct(mode(path)))
    assert mode(tmp_path / "op") == 0o777 & ~mask


def test_cli_writes_files_with_the_umask(tmp_path):
    """The CLI's generated/<name>/ files are readable by the group and others under the
    usual umask 022 (they were 0600)."""
    r = subprocess.run([sys.executable, "-m", "fusegen", "a*b+c", "--name", "umask_fma", "--no-build",
                        "--out", str(tmp_path)], capture_output=True, text=True,
                       preexec_fn=lambda: os.umask(0o022))
    assert r.returncode == 0, r.stderr
    written = sorted((tmp_path / "umask_fma").iterdir())
    assert written and all(mode(p) == 0o644 for p in written), [(p.name, oct(mode(p))) for p in written]


def test_unchanged_files_are_untouched_and_changed_ones_replaced(tmp_path):
    first = files.write({"same.h": "same\n", "changes.h": "old\n"}, tmp_path)
    before = {p.name: os.stat(p) for p in first}
    os.utime(tmp_path / "same.h", ns=(1, 1))  # an mtime a rewrite would change
    files.write({"same.h": "same\n", "changes.h": "new\n"}, tmp_path)
    assert os.stat(tmp_path / "same.h").st_mtime_ns == 1
    assert os.stat(tmp_path / "same.h").st_ino == before["same.h"].st_ino
    assert (tmp_path / "changes.h").read_text() == "new\n"
    # replaced by a rename, not rewritten in place: a reader never sees half a file
    assert os.stat(tmp_path / "changes.h").st_ino != before["changes.h"].st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["changes.h", "same.h"]  # no temp files


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    files.write({"x.h": "old\n"}, tmp_path)

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", broken_replace)
    with pytest.raises(OSError):
        files.write({"x.h": "new\n"}, tmp_path)
    assert (tmp_path / "x.h").read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["x.h"]


def test_text_is_utf8_whatever_the_locale(tmp_path):
    files.write({"spec.json": '{"expression": "x\u00b2"}\n'}, tmp_path)
    assert (tmp_path / "spec.json").read_bytes() == '{"expression": "x\u00b2"}\n'.encode("utf-8")


def _imports(path: Path) -> set[str]:
    """Modules a fusegen source file imports, relative ones as `fusegen.<name>`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ("fusegen." if node.level else "") + (node.module or "")
            found.add(base.rstrip("."))
            if node.level and not node.module:
                found.update(f"fusegen.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_build_stage_does_not_import_the_render_stage():
    imports = _imports(PACKAGE / "build" / "builder.py")
    assert "fusegen.files" in imports
    assert not any(m == "fusegen.codegen.render" or m.startswith("fusegen.codegen.render.") for m in imports), imports


# Calls that write a file: Path.write_text (not fusegen.files.write_text), os.replace,
# json.dump, open for writing. The lock files builder.py opens with "a" hold no data.
_WRITERS = {"mkstemp", "NamedTemporaryFile", "write_text", "write_bytes", "replace", "dump"}


def _file_writes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        method = isinstance(func, ast.Attribute)
        if name in _WRITERS and (name != "replace" or owner == "os") and (name != "dump" or owner == "json") \
                and (name not in ("write_text", "write_bytes") or (method and owner != "files")):
            found.append(f"{path.name}:{node.lineno} {name}")
        if name == "open":
            modes = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
            modes += [k.value.value for k in node.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)]
            if any(isinstance(m, str) and ("w" in m or "x" in m or "+" in m) for m in modes):
                found.append(f"{path.name}:{node.lineno} open({modes[0]!r})")
    return found


def test_file_writing_lives_in_files_py():
    offenders = [w for p in sorted(PACKAGE.rglob("*.py")) if p.name != "files.py" for w in _file_writes(p)]
    assert not offenders, "write files through fusegen.files: " + ", ".join(offenders)
    assert _file_writes(PACKAGE / "files.py")  # the scan does see writes

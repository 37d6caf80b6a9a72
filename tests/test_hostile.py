"""The build cache under hostile input: a FUSEGEN_CACHE_DIR that is not fusegen's folder, and
a cache path that holds shell and ninja syntax.

- fusegen removes only what it made: the cache folder carries fusegen's CACHEDIR.TAG, and
  each entry has fusegen's name and its entry.json. `fusegen cache` and a build refuse a
  folder that is not a fusegen cache (`~/.cache`, `$HOME`), whatever it holds, and inside
  a cache they leave alone whatever fusegen did not make.
- No path from the cache reaches a command line: a cache folder whose name holds a space,
  quotes, `;touch PWNED;`, `$x` or `:` builds, loads and runs nothing; a relative
  FUSEGEN_CACHE_DIR is made absolute.

The removal tests use test_cache.py's fake compiler (milliseconds); the path tests compile
for real, in fresh processes, so that the loader resolves the runtime by itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils import cpp_extension

import test_cache
from conftest import TESTS, seed_runtime
from fusegen.build import builder as build
from fusegen.build import cache as fcache
from fusegen.tools.cli import main
from fusegen.errors import BuildError
from test_cache import OPS

cache = test_cache.cache  # the fake-compiler fixture: a fresh cache, compiles in milliseconds


def tree(root: Path) -> list[str]:
    """Every path under `root`, relative, symlinks not followed."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def users_folder(root: Path) -> Path:
    """A folder as a user's ~/.cache or $HOME is: other tools' caches, documents, and folders
    named like fusegen's own temp folders and entries."""
    for sub in ("pip/http", "torch/hub", "Documents/taxes", f".build-{'a' * 20}-k1ll3d_x",
                ".build-thing", f".trash-{'b' * 32}-0123abcd", "locks", "index", "templates"):
        (root / sub).mkdir(parents=True)
    (root / "templates" / f"__jinja2_{'e' * 40}.cache").write_bytes(b"another tool's")
    (root / "Documents" / "taxes" / "2026.pdf").write_bytes(b"%PDF")
    (root / "locks" / f"{'c' * 32}.lock").write_text("")
    entry = root / ("d" * 32)  # a fusegen-like entry, in a folder fusegen never made
    entry.mkdir()
    (entry / "entry.json").write_text(json.dumps({"kind": "op", "ops": ["x"]}))
    (root / "notes.txt").write_text("mine\n")
    return root


# -- a folder that is not a fusegen cache ----------------------------------------------------------

@pytest.mark.parametrize("args", [["clear"], ["trim", "--older-than", "0s"], ["list"], []])
def test_cache_commands_refuse_a_folder_fusegen_did_not_make(tmp_path, monkeypatch, capsys, args):
    home = users_folder(tmp_path / "home")
    before = tree(home)
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(home))
    status = main(["cache", *args])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.startswith(f"fusegen: error: {home} is not a fusegen cache: it has no CACHEDIR.TAG")
    assert "Documents" in err and "pip" in err and "expects FUSEGEN_CACHE_DIR to be a folder of its own" in err
    assert err.count("\n") == 1
    assert tree(home) == before  # not one folder, temp-like or entry-like, removed


def test_a_build_refuses_a_folder_fusegen_did_not_make(tmp_path, monkeypatch, cache):
    home = users_folder(tmp_path / "home")
    os.chmod(home, 0o700)  # passes the privacy checks: only the marker decides
    before = tree(home)
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(home))
    with pytest.raises(BuildError) as info:
        build.build(OPS)
    assert str(info.value).startswith(f"fusegen: {home} is not a fusegen cache")
    assert tree(home) == before and cache.calls == [] and cache.runtime_calls == []


def test_inside_a_cache_only_what_fusegen_made_is_removed(cache, capsys):
    lib = cache.build()
    root = cache.root
    assert (root / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
    mine = root / "mine"
    (mine / "sub").mkdir(parents=True)
    unmarked = root / ("e" * 32)  # an entry's name, but no entry.json
    unmarked.mkdir()
    (unmarked / "data").write_text("kept\n")
    outside = root.parent / "outside"
    outside.mkdir()
    (outside / "entry.json").write_text(json.dumps({"kind": "op", "ops": ["x"]}))
    (root / ("f" * 32)).symlink_to(outside)  # an entry's name and entry.json, through a link
    (root / ".build-notfusegen").mkdir()
    (root / ".trash-notfusegen").mkdir()
    (root / "index" / "notes.json").parent.mkdir(exist_ok=True)
    (root / "index" / "notes.json").write_text("{}")
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    for name in ("mine", "e" * 32, "f" * 32):
        assert f"other    {name}: not made by fusegen" in out
    assert main(["cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert "removed 2 entries" in out  # the op and the runtime
    assert not lib.path.parent.exists() and not lib.runtime.parent.exists()
    for kept in (mine / "sub", unmarked / "data", root / ("f" * 32), outside / "entry.json",
                 root / ".build-notfusegen", root / ".trash-notfusegen", root / "index" / "notes.json"):
        assert kept.exists(), kept


def test_an_empty_folder_becomes_a_cache_and_an_unmarked_cache_of_fusegen_is_kept(cache, capsys):
    cache.root.mkdir(mode=0o700)  # made by the user, empty: fusegen may use it
    lib = cache.build()
    assert (cache.root / "CACHEDIR.TAG").is_file()
    # A cache from before the marker (entries, locks, index only) is recognised and marked.
    (cache.root / "CACHEDIR.TAG").unlink()
    assert main(["cache"]) == 0 and lib.path.parent.name in capsys.readouterr().out
    assert cache.build().cached and (cache.root / "CACHEDIR.TAG").is_file()
    # A tag another tool wrote is not fusegen's.
    (cache.root / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n# by cargo\n")
    (cache.root / "theirs").mkdir()
    assert main(["cache", "clear"]) == 2 and lib.path.is_file()
    assert "not a fusegen cache" in capsys.readouterr().err


# -- a cache path with shell and ninja syntax ---------------------------------------------------------

HOSTILE = "my cache 'q\" ;touch PWNED; $x `touch PWNED2` :y"
SYNTAX = " '\";$`:|&<>()*?[]!#~\\\n"  # the shell's and ninja's


def test_the_compiler_sees_no_path_from_the_cache(tmp_path, monkeypatch):
    """What reaches cpp_extension (which writes it into build.ninja, run through /bin/sh)
    has only plain characters, for the runtime's build as for an op's, and the link flags
    name no cache path at all."""
    root = tmp_path / HOSTILE
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(root))
    monkeypatch.setattr(build, "_LOADED", set())
    seen = []

    def fake_load(name, sources, build_directory, extra_ldflags, **kwargs):
        seen.append((name, sources, build_directory, extra_ldflags, os.path.realpath(build_directory)))
        Path(build_directory, f"{name}.so").write_bytes(b"\x7fELF fake")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(build, "_host_load", fake_load)
    lib = build.build(OPS)
    assert [s[0].startswith("libfusegen_runtime_") for s in seen] == [True, False]
    for name, sources, directory, ldflags, real in seen:
        for text in sources + [directory] + ldflags:
            assert not set(text) & set(SYNTAX), text
        assert str(root) not in " ".join(ldflags)
        assert Path(real).parent == root and Path(real).name.startswith(".build-")  # a link into the cache
        assert not Path(directory).exists()  # the link is gone once the build is over
    rsp = (lib.path.parent / build.LINK_FLAGS).read_text()
    folder = lib.runtime.parent.name
    assert rsp == f"-L../{folder}\n-l{lib.runtime.stem[3:]}\n-Wl,-rpath,$ORIGIN/../{folder}\n"
    assert str(lib.path).startswith(str(root)) and lib.path.is_file()


BUILD_AND_RUN = r"""
import os, sys, torch, fusegen
op = fusegen.fuse("x*2.5 + y*y", name=sys.argv[1])
x, y = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
torch.testing.assert_close(op(x, y), x * 2.5 + y * y)
print(op.library.cached, op.library.path.is_absolute(), os.path.realpath(op.library.path), sep="\n")
"""


def run_op(cwd: Path, cache_dir: str, name: str, **env) -> list[str]:
    """A fresh process fuses, calls and checks the op: its loader finds the runtime through
    the op library's own rpath, not through a copy this process loaded."""
    r = subprocess.run([sys.executable, "-c", BUILD_AND_RUN, name], cwd=cwd, capture_output=True, text=True,
                       env=dict(os.environ, FUSEGEN_CACHE_DIR=cache_dir, PYTHONPATH=str(TESTS.parent), **env),
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.splitlines()


def test_a_cache_path_with_shell_and_ninja_syntax_builds_and_runs_nothing(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    root = tmp_path / HOSTILE
    seed_runtime(root)
    evil = {"x": "; touch PWNED3 ;"}
    assert run_op(work, str(root), "hostile_path", **evil)[:2] == ["False", "True"]  # built
    assert run_op(work, str(root), "hostile_path", **evil)[:2] == ["True", "True"]   # loaded from the cache
    assert not [p for p in tmp_path.rglob("PWNED*")], "a command ran"
    (entry,) = [p for p in root.iterdir() if re.fullmatch(fcache.ENTRY_NAME, p.name) and not p.name.startswith("runtime-")]
    assert fcache.verify(entry / f"fusegen_{entry.name}.so") is None


@pytest.mark.slow
def test_a_relative_cache_dir_is_made_absolute(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    seed_runtime(work / "rel cache")
    monkeypatch.chdir(work)
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", "rel cache/../rel cache")
    assert fcache.cache_dir() == work / "rel cache"
    built = run_op(work, "rel cache", "relative_cache")
    assert built[:2] == ["False", "True"] and built[2].startswith(str(work / "rel cache") + "/")
    # and found again from another folder, by its absolute path
    assert run_op(tmp_path, str(work / "rel cache"), "relative_cache")[:2] == ["True", "True"]


@pytest.mark.slow
def test_a_fresh_cache_with_a_hostile_path_builds_the_runtime_too(tmp_path):
    """The shared runtime's own build (11 s here) through the same path: nothing seeded."""
    work = tmp_path / "work"
    work.mkdir()
    root = tmp_path / HOSTILE / "fresh"
    assert run_op(work, str(root), "hostile_fresh", x="; touch PWNED ;")[:2] == ["False", "True"]
    assert not [p for p in tmp_path.rglob("PWNED*")]
    assert [e.kind for e in fcache.entries(root)] in (["op", "runtime"], ["runtime", "op"])


def test_the_own_ninja_file_quotes_the_compiler_and_refuses_unplain_flags(tmp_path, monkeypatch):
    """builder._host_load writes its ninja file itself: $CXX's words are quoted for the
    shell and `$` escaped for ninja; a flag or path that is not plain is refused before
    anything is written or run."""
    assert build._ninja_words("ccache g++ '-DX=a b$c'") == "ccache g++ '-DX=a b$$c'"
    with pytest.raises(build.BuildError, match="ninja file"):
        build._host_load(name="x", sources=[str(tmp_path / "unit0.cpp")], build_directory=str(tmp_path),
                         extra_cflags=["-DX=$(touch PWNED)"], extra_ldflags=[], extra_include_paths=[])
    assert not (tmp_path / "build.ninja").exists() and not Path("PWNED").exists()

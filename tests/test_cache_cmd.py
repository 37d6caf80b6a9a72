"""`fusegen cache`: list, trim, clear, and the cleanup of temp folders left by killed builds.

The rule under test: an entry or a `.build-*` temp folder is removed only by whoever holds
its build lock (`locks/<folder>.lock`, taken without waiting), so a build in progress never
loses its folder. Locks are held here by another open file description (a second open() in
this process conflicts with flock as another process would) or by a real subprocess that is
then killed with SIGKILL, as a killed build is. The builds use test_cache.py's fake compiler
(milliseconds, no real compile)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fusegen.build import builder as build
from fusegen.build import cache as fcache
from fusegen.tools.cli import main, parse_age
import test_cache
from test_cache import OPS, entries, runtime_entry

cache = test_cache.cache  # the fake-compiler fixture: a fresh cache, compiles in milliseconds

TWO = [("two_a", {"two_a.cpp": "// a\n"}), ("two_b", {"two_b.cpp": "// b\n"})]
DAY = 86400


def run(capsys, *args) -> tuple[int, str, str]:
    status = main(["cache", *args])
    out, err = capsys.readouterr()
    return status, out, err


def age(entry_dir: Path, seconds: float):
    """Pretend the entry was last used `seconds` ago."""
    when = time.time() - seconds
    os.utime(entry_dir / fcache.ENTRY_FILE, (when, when))


class HeldLock:
    """flock on a separate open file description: conflicts with any other open() of the
    same file, in this process or another, as a build's lock does."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(path, "a")
        fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def release(self):
        self.fh.close()


def fake_temp(root: Path, folder: str, owner: bool = True) -> Path:
    """A .build-* folder as _build_in makes it (optionally before its owner file exists), in
    a cache fusegen made."""
    root.mkdir(mode=0o700, exist_ok=True)
    fcache.mark_root(root)
    temp = root / f".build-{folder[:20]}-k1ll3d_x"
    (temp / "op").mkdir(parents=True)
    (temp / "op" / "op.cpp").write_text("// half-built\n")
    if owner:
        fcache.write_owner(temp, folder, "op(s) op")
    (root / "locks").mkdir(exist_ok=True)
    (root / "locks" / f"{folder}.lock").touch()
    return temp


# -- entry metadata and last use --------------------------------------------------------------------

def test_entries_record_what_they_hold(cache):
    lib = cache.build(TWO)
    meta = json.loads((lib.path.parent / "entry.json").read_text())
    assert meta["kind"] == "op" and meta["ops"] == ["two_a", "two_b"] and meta["cuda"] is False
    assert meta["torch"] and meta["fusegen"] and abs(meta["created"] - time.time()) < 60
    runtime = json.loads((lib.runtime.parent / "entry.json").read_text())
    assert runtime["kind"] == "runtime" and runtime["ops"] == []
    # the owner file of the temp folder is not published
    assert not (lib.path.parent / fcache.OWNER_FILE).exists()


def test_a_cache_hit_and_a_load_bump_last_use(cache):
    lib = cache.build()
    age(lib.path.parent, 10 * DAY)
    age(lib.runtime.parent, 10 * DAY)
    again = cache.build()  # a hit, for the op and the runtime
    assert again.cached
    assert time.time() - os.stat(lib.path.parent / "entry.json").st_mtime < 60
    age(lib.path.parent, 10 * DAY)
    age(lib.runtime.parent, 10 * DAY)
    build.load(lib)  # the index's fast path loads without build.build: load bumps both
    for entry in (lib.path.parent, lib.runtime.parent):
        assert time.time() - os.stat(entry / "entry.json").st_mtime < 60


def test_last_use_never_fails_a_load(cache, monkeypatch):
    lib = cache.build()

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(os, "utime", refuse)
    assert cache.build().cached
    build.load(lib)
    assert cache.loaded == [(str(lib.path), True)]


def test_an_entry_without_its_entry_json_is_not_listed_removed_or_loaded_but_rebuilt(cache, capsys, caplog):
    """entry.json is fusegen's mark on an entry and holds its library's size and sha256: a
    folder without it is not fusegen's to remove, nor a library to load; a build of its key
    replaces it."""
    lib = cache.build()
    (lib.path.parent / "entry.json").unlink()
    assert [e.kind for e in fcache.entries(cache.root)] == ["runtime"]
    status, out, _ = run(capsys)
    assert status == 0 and f"other    {lib.key}: not made by fusegen" in out
    with caplog.at_level(logging.WARNING, logger="fusegen"):
        again = cache.build()
    assert not again.cached and len(cache.calls) == 2
    assert f"the cache entry {lib.path.parent} is corrupt (its entry.json is missing" in caplog.text
    assert json.loads((lib.path.parent / "entry.json").read_text())["ops"] == ["fake"]


# -- list ----------------------------------------------------------------------------------------

def test_list_shows_names_size_and_last_use(cache, capsys):
    one = cache.build()
    two = cache.build(TWO)
    (two.path.parent / "padding.bin").write_bytes(b"\0" * 300_000)
    age(one.path.parent, 3 * DAY)
    status, out, err = run(capsys)
    assert status == 0 and err == ""
    assert "op fake" in out and "2 ops: two_a, two_b" in out
    assert f"shared runtime, torch {build.torch.__version__}" in out
    assert "last used 3 days ago (" in out and "last used just now (" in out
    stamp = time.strftime("%Y-%m-%dT", time.gmtime(time.time() - 3 * DAY))
    assert stamp in out  # ISO 8601, UTC
    size = float(out.split("two_b")[1].split("\n")[1].split("KiB")[0].split()[-1])
    assert size > 292  # 300 kB of padding (292.97 KiB) and the entry's own files
    assert f"cache    {cache.root}: 3 entries" in out
    lines = [line for line in out.splitlines() if line.startswith(("ops", "runtime"))]
    assert lines[-1].endswith("op fake")  # most recently used first
    assert status == 0 and main(["cache", "list"]) == 0


def test_list_of_a_cache_that_does_not_exist(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(tmp_path / "nothing"))
    status, out, _ = run(capsys)
    assert status == 0 and "empty" in out and not (tmp_path / "nothing").exists()


# -- trim and clear --------------------------------------------------------------------------------

def test_trim_removes_old_entries_and_keeps_recent_ones(cache, capsys):
    old = cache.build()
    new = cache.build(TWO)
    age(old.path.parent, 8 * DAY)
    age(new.path.parent, 6 * DAY)
    age(new.runtime.parent, 6 * DAY)
    status, out, err = run(capsys, "trim", "--older-than", "7d")
    assert status == 0 and err == ""
    assert not old.path.parent.exists() and new.path.is_file() and new.runtime.is_file()
    assert f"removed  {old.key} (op fake" in out and "removed 1 entry" in out and "2 left" in out
    assert not [p for p in cache.root.iterdir() if p.name.startswith(".")]  # no trash left
    # hours and minutes too; the runtime goes as well, and the op entry still works after
    status, out, _ = run(capsys, "trim", "--older-than", "1.5h")
    assert status == 0 and not new.path.parent.exists() and not new.runtime.parent.exists()
    assert entries(cache.root) == []
    again = cache.build(TWO)
    assert not again.cached and len(cache.runtime_calls) == 2 and again.runtime.is_file()


def test_an_op_entry_survives_its_runtime_being_trimmed(cache, capsys):
    lib = cache.build()
    age(lib.runtime.parent, 30 * DAY)
    assert run(capsys, "trim", "--older-than", "7d")[0] == 0
    assert lib.path.is_file() and not lib.runtime.parent.exists()
    again = cache.build()  # the op is a hit; its runtime is rebuilt where its rpath points
    assert again.cached and again.runtime == lib.runtime and lib.runtime.is_file()
    build.load(again)
    assert cache.loaded == [(str(lib.path), True)]


def test_clear_removes_every_entry(cache, capsys):
    cache.build()
    cache.build(TWO)
    (cache.root / "index").mkdir()
    (cache.root / "index" / f"{'1' * 32}.json").write_text('{"library": "gone", "runtime": "gone"}')
    status, out, _ = run(capsys, "clear")
    assert status == 0 and "removed 3 entries" in out and "0 left" in out
    assert sorted(p.name for p in cache.root.iterdir()) == ["CACHEDIR.TAG", "index", "locks"]  # locks stay: see cache.remove
    assert not list((cache.root / "index").iterdir())
    assert cache.build().cached is False  # and builds again


KEEP = f"{'1' * 32}.json"


def test_trim_prunes_index_entries_of_removed_libraries(cache, capsys):
    keep, old = cache.build(), cache.build(TWO)
    runtime = keep.runtime.parent.name.removeprefix("runtime-")
    index = cache.root / "index"
    index.mkdir()
    (index / KEEP).write_text(json.dumps({"library": keep.key, "runtime": runtime}))
    (index / f"{'2' * 32}.json").write_text(json.dumps({"library": old.key, "runtime": runtime}))
    age(old.path.parent, 9 * DAY)
    assert run(capsys, "trim", "--older-than", "7d")[0] == 0
    assert sorted(p.name for p in index.iterdir()) == [KEEP]


def test_an_entry_whose_lock_is_held_is_kept(cache, capsys):
    lib = cache.build()
    held = HeldLock(cache.root / "locks" / f"{lib.key}.lock")
    try:
        status, out, _ = run(capsys, "clear")
    finally:
        held.release()
    assert status == 0 and lib.path.is_file()
    assert f"kept     {lib.key}: a build in progress holds its lock" in out
    assert not lib.runtime.parent.exists()  # its lock was free


# -- temp folders of builds ------------------------------------------------------------------------

def test_a_stale_temp_folder_is_removed(cache, capsys):
    lib = cache.build()
    with_owner = fake_temp(cache.root, "a" * 32)
    # killed between mkdtemp and writing its owner file: found by its name's prefix
    without = fake_temp(cache.root, "b" * 32, owner=False)
    status, out, _ = run(capsys)
    assert status == 0
    assert not with_owner.exists() and not without.exists()
    assert out.count("the temp folder of a killed build") == 2 and lib.path.is_file()


def test_a_temp_folder_whose_lock_is_held_is_kept(cache, capsys):
    folder = "c" * 32
    temp = fake_temp(cache.root, folder)
    bare = fake_temp(cache.root, "d" * 32, owner=False)
    held = [HeldLock(cache.root / "locks" / f"{f}.lock") for f in (folder, "d" * 32)]
    try:
        for args in ([], ["clear"], ["trim", "--older-than", "0s"]):
            status, out, _ = run(capsys, *args)
            assert status == 0 and temp.is_dir() and bare.is_dir(), args
        assert "building op(s) op" in run(capsys)[1]  # listed as a build in progress
        assert build._clean_stale(cache.root) is None and temp.is_dir()  # nor does a build remove it
    finally:
        for h in held:
            h.release()
    run(capsys)
    assert not temp.exists() and not bare.exists()


def test_a_build_in_progress_keeps_its_folder_and_runtime_through_clear(cache, capsys):
    """`fusegen cache clear` and a listing, while the (fake) compiler runs inside the
    build's temp folder: the folder stays, so does the runtime the op links against, and
    the build publishes."""
    seen = []

    def clear_mid_build(call):
        (temp,) = [p for p in cache.root.iterdir() if p.name.startswith(".build-")]
        assert (temp / fcache.OWNER_FILE).is_file()
        assert main(["cache", "clear"]) == 0 and main(["cache"]) == 0
        seen.append((temp.is_dir(), (cache.root / runtime_entry()).is_dir()))

    cache.before = clear_mid_build
    lib = cache.build()
    assert seen == [(True, True)] and lib.path.is_file() and lib.runtime.is_file()
    out = capsys.readouterr().out
    assert "building op(s) fake" in out and f"kept     {runtime_entry()}: a build in progress" in out
    assert len(cache.runtime_calls) == 1
    # once the build is over, the runtime is no longer pinned
    assert main(["cache", "clear"]) == 0 and entries(cache.root) == []


KILLED_BUILD = """
import fcntl, os, sys, tempfile, time
from pathlib import Path
from fusegen.build import cache
root, folder = Path(sys.argv[1]), sys.argv[2]
(root / "locks").mkdir(parents=True, exist_ok=True)
fh = open(root / "locks" / f"{folder}.lock", "a")
fcntl.flock(fh, fcntl.LOCK_EX)
tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".build-{folder[:20]}-"))
cache.write_owner(tmp, folder, "op(s) killed")
print(tmp, flush=True)
time.sleep(600)
"""


def test_a_killed_build_leaves_a_folder_that_is_removed_only_once_it_is_dead(cache, capsys):
    """A real process holds the lock as a build does, and is then SIGKILLed mid-build."""
    cache.root.mkdir(mode=0o700)
    fcache.mark_root(cache.root)  # as the build that created it did
    proc = subprocess.Popen([sys.executable, "-c", KILLED_BUILD, str(cache.root), "e" * 32],
                            stdout=subprocess.PIPE, text=True)
    try:
        temp = Path(proc.stdout.readline().strip())
        assert temp.is_dir()
        assert run(capsys, "clear")[0] == 0 and temp.is_dir()  # alive: kept
    finally:
        proc.kill()
        proc.wait()
    status, out, _ = run(capsys)
    assert status == 0 and not temp.exists() and temp.name in out


def test_a_build_cleans_stale_temp_folders(cache):
    stale = fake_temp(cache.root, "f" * 32)
    cache.build()
    assert not stale.exists()
    assert not [p for p in cache.root.iterdir() if p.name.startswith(".")]


def test_leftover_trash_is_removed(cache, capsys):
    cache.build()
    trash = cache.root / f".trash-{'a' * 32}-0123abcd"
    (trash / "x").mkdir(parents=True)
    assert run(capsys)[0] == 0 and not trash.exists()


def test_a_build_waiting_for_another_says_so(cache, caplog):
    """Another process builds the same library: the build waits on the lock, and says so."""
    key = build.cache_key(OPS, build.cuda_enabled())
    build.runtime_library()  # not the op's lock: only the op's build waits
    held = HeldLock(cache.root / "locks" / f"{key}.lock")
    done = []
    with caplog.at_level(logging.INFO, logger="fusegen"):
        thread = threading.Thread(target=lambda: done.append(build.build(OPS)))
        thread.start()
        deadline = time.time() + 30
        while "waiting for another process building op(s) fake (giving up after 600 s" not in caplog.text:
            assert time.time() < deadline, caplog.text
            time.sleep(0.01)
        assert not done
        held.release()
        thread.join()
    assert done and done[0].path.is_file()


# -- bad arguments -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [("30s", 30), ("15m", 900), ("1.5h", 5400), ("7d", 7 * DAY),
                                           (" 2D ", 2 * DAY), ("0s", 0)])
def test_parse_age(text, seconds):
    assert parse_age(text) == seconds


@pytest.mark.parametrize("args, message", [
    (["trim", "--older-than", "banana"], "argument --older-than: expected an age: a number and a unit "
                                         "s, m, h or d (30s, 15m, 12h, 7d), got 'banana'"),
    (["trim", "--older-than", "7"], "got '7'"),
    (["trim", "--older-than", "-1d"], "argument --older-than: expected"),
    (["trim", "--older-than", "2w"], "got '2w'"),
    (["trim"], "the following arguments are required: --older-than"),
    (["purge"], "argument command: invalid choice: 'purge' (choose from 'list', 'clear', 'trim')"),
    (["list", "extra"], "unrecognized arguments: extra"),
])
def test_bad_arguments_are_one_line(cache, capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(["cache", *args])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == ""
    assert err.startswith("fusegen: error: ") and message in err and err.count("\n") == 1, err
    assert not cache.root.exists()  # nothing touched


def test_bad_age_in_a_subprocess(cache):
    r = subprocess.run([sys.executable, "-m", "fusegen", "cache", "trim", "--older-than", "banana"],
                       capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("fusegen: error: argument --older-than: expected an age")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_cache_as_an_expression_is_written_in_parentheses(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["cache", "--name", "c"])
    assert 'fusegen "(cache)"' in capsys.readouterr().err
    assert main(["(cache)", "--name", "cache_op", "--out", str(tmp_path), "--no-build"]) == 0
    assert "torch.ops.fusegen.cache_op(cache)" in capsys.readouterr().out


# -- Jinja's compiled templates (codegen/render.py) -------------------------------------------------

def _render_in_new_process(root: Path) -> str:
    """Render an op's files in a fresh process; print how many templates Jinja compiled
    from source there."""
    code = ("import jinja2, fusegen.api as api\n"
            "n = []\n"
            "compile = jinja2.Environment.compile\n"
            "jinja2.Environment.compile = lambda self, *a, **k: n.append(1) or compile(self, *a, **k)\n"
            "api.generate(api.Request('a*b+c', 'tpl_fma', None, ()))\n"
            "print(len(n))\n")
    env = dict(os.environ, FUSEGEN_CACHE_DIR=str(root))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_new_process_finds_the_templates_compiled(cache):
    cache.build()  # the cache exists and is fusegen's
    assert int(_render_in_new_process(cache.root)) > 0
    kept = sorted(p.name for p in (cache.root / fcache.TEMPLATES).iterdir())
    assert kept and all(re.fullmatch(r"__jinja2_[0-9a-f]{40}\.cache", n) for n in kept)
    assert stat.S_IMODE((cache.root / fcache.TEMPLATES).stat().st_mode) == 0o700
    assert _render_in_new_process(cache.root) == "0"


def test_templates_are_not_kept_in_a_cache_that_is_not_private_or_not_fusegens(cache, tmp_path):
    cache.build()
    os.chmod(cache.root, 0o770)
    assert fcache.template_folder() is None
    os.chmod(cache.root, 0o700)
    (cache.root / fcache.TEMPLATES).mkdir(mode=0o777)
    os.chmod(cache.root / fcache.TEMPLATES, 0o777)
    assert fcache.template_folder() is None  # Jinja would load code others can write
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.environ["FUSEGEN_CACHE_DIR"] = str(other)  # (the fixture's monkeypatch restores it)
    assert fcache.template_folder() is None and not (other / fcache.TEMPLATES).exists()


def test_list_and_clear_know_the_compiled_templates(cache, capsys):
    cache.build()
    folder = fcache.template_folder()
    (folder / f"__jinja2_{'a' * 40}.cache").write_bytes(b"x")
    (folder / f"__jinja2_{'b' * 40}.cachek1ll3d_x.tmp").write_bytes(b"x")
    status, out, _ = run(capsys, "list")
    assert status == 0 and "templates" not in out
    assert fcache.foreign(cache.root) is None
    status, out, _ = run(capsys, "clear")
    assert status == 0 and not list(folder.iterdir())


def test_a_stranger_in_the_templates_folder_makes_an_unmarked_folder_foreign(cache):
    cache.build()
    (fcache.template_folder() / "notes.txt").write_text("mine\n")
    (cache.root / fcache.ROOT_MARKER).unlink()
    assert fcache.foreign(cache.root) == [fcache.TEMPLATES]

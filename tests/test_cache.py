"""The cache is private and survives being deleted.

It holds shared libraries fusegen loads into the process, so whoever can write there can
run code in every process that loads from it: the cache directory is created 0700, and
fusegen refuses a cache directory, entry or library that another user owns or that group
or others can write. A cache deleted during a build gives a clean rebuild or a one-line
error. The same holds for the shared runtime's entry (runtime-<key>), which op libraries
link against: a cache deleted under an op's build has lost the runtime too, and the retry
rebuilds both. Most tests fake the compiler (cpp_extension.load writes a dummy library,
for the runtime as for the op), so they take milliseconds; one deletes the cache during a
real compile."""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from conftest import seed_runtime
from fusegen.build import builder as build
from fusegen.errors import BuildError, LoadError

OPS = [("fake", {"fake.cpp": "// fusegen test: never compiled\n", "fake.h": "\n"})]


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache path (not yet created) and a fake compiler: cpp_extension.load (and
    builder._host_load, which builds an op library of host code alone) writes
    a dummy <name>.so with the umask's mode, as the linker does. `fake.before` runs first
    (to delete the cache mid-build); `loaded` records what torch.ops.load_library gets.
    `calls` counts op builds (`before` sees only those); `runtime_calls` the runtime's."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(root))
    monkeypatch.setattr(build, "_LOADED", set())
    calls, runtime_calls = [], []

    def fake_load(name, sources, build_directory, **kwargs):
        if name.startswith("libfusegen_runtime_"):
            runtime_calls.append(build_directory)
        else:
            calls.append(build_directory)
            if fake.before:
                fake.before(len(calls))
        # what cpp_extension's FileBaton does first: fails when the folder is gone
        os.close(os.open(os.path.join(build_directory, "lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        os.unlink(os.path.join(build_directory, "lock"))
        fd = os.open(os.path.join(build_directory, f"{name}.so"), os.O_CREAT | os.O_WRONLY, 0o777)
        os.close(fd)

    class Fake:
        before = None

    def build_as_another_process(ops=OPS):
        """build.build, then forget the fake compile 'loaded' it (as cpp_extension.load
        does), so build.load goes through the checks, as in a process that found it."""
        library = build.build(ops)
        build._LOADED.discard(library.key)
        return library

    fake = Fake()
    fake.root, fake.calls, fake.runtime_calls, fake.loaded = root, calls, runtime_calls, []
    fake.build = build_as_another_process
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(build, "_host_load", fake_load)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: fake.loaded.append(
        (path, os.path.isfile(path))))
    return fake


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name not in ("locks", "CACHEDIR.TAG"))


def runtime_entry() -> str:
    return f"runtime-{build.runtime_key(build.cuda_enabled())}"


# -- a private cache ------------------------------------------------------------------------------

def test_default_cache_dir_is_created_0700(tmp_path, monkeypatch, cache):
    monkeypatch.delenv("FUSEGEN_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    old = os.umask(0o022)
    try:
        lib = build.build(OPS)
    finally:
        os.umask(old)
    root = tmp_path / "home" / ".cache" / "fusegen"
    assert build.cache_dir() == root and lib.path.parent.parent == root
    assert mode(root) == 0o700
    assert mode(tmp_path / "home" / ".cache") == 0o755  # parents as mkdir -p makes them
    assert entries(root) == sorted([lib.key, runtime_entry()]) and lib.runtime.parent.parent == root


def test_a_library_built_under_umask_002_is_not_group_writable(cache):
    old = os.umask(0o002)
    try:
        lib = cache.build()
    finally:
        os.umask(old)
    assert mode(cache.root) == 0o700
    assert not mode(lib.path) & 0o022, oct(mode(lib.path))
    assert not mode(lib.runtime) & 0o022, oct(mode(lib.runtime))  # the runtime is sealed too
    build.load(lib)  # passes the checks: our own build, shared between our own processes
    assert cache.loaded == [(str(lib.path), True)]


@pytest.mark.parametrize("bits", [0o020, 0o002, 0o777])
def test_refuses_a_cache_dir_others_can_write(cache, bits):
    lib = cache.build()
    os.chmod(cache.root, 0o700 | bits)
    with pytest.raises(LoadError) as info:
        build.load(lib)
    message = str(info.value)
    assert str(cache.root) in message and f"chmod 700 {cache.root}" in message
    assert "group or others can write" in message and "\n" not in message
    with pytest.raises(BuildError) as info:  # nor builds there
        build.build([("other", {"other.cpp": "\n"})])
    assert f"chmod 700 {cache.root}" in str(info.value)
    assert cache.loaded == []


def test_refuses_an_entry_or_library_others_can_write(cache):
    lib = cache.build()
    os.chmod(lib.path.parent, 0o770)
    with pytest.raises(LoadError, match="cache entry") as info:
        build.load(lib)
    assert str(lib.path.parent) in str(info.value) and "chmod 700" in str(info.value)
    os.chmod(lib.path.parent, 0o700)
    os.chmod(lib.path, 0o757)
    with pytest.raises(LoadError, match="cached library") as info:
        build.load(lib)
    assert str(lib.path) in str(info.value) and f"chmod go-w {lib.path}" in str(info.value)
    assert cache.loaded == []
    os.chmod(lib.path, 0o755)
    # the runtime the op library pulls in is checked as well
    os.chmod(lib.runtime.parent, 0o770)
    with pytest.raises(LoadError, match="cache entry") as info:
        build.load(lib)
    assert str(lib.runtime.parent) in str(info.value)
    os.chmod(lib.runtime.parent, 0o700)
    os.chmod(lib.runtime, 0o757)
    with pytest.raises(LoadError, match="cached library") as info:
        build.load(lib)
    assert str(lib.runtime) in str(info.value)
    os.chmod(lib.runtime, 0o755)
    assert cache.loaded == []
    build.load(lib)
    assert cache.loaded == [(str(lib.path), True)]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_refuses_a_cache_owned_by_another_user(cache):
    lib = cache.build()
    os.chown(lib.path, 65534, 65534)
    with pytest.raises(LoadError, match="owned by uid 65534") as info:
        build.load(lib)
    assert str(lib.path) in str(info.value) and "directory you own" in str(info.value)
    os.chown(lib.path, 0, 0)
    os.chown(cache.root, 65534, 65534)
    with pytest.raises(BuildError, match="owned by uid 65534"):
        build.build([("other", {"other.cpp": "\n"})])
    with pytest.raises(LoadError, match="owned by uid 65534"):
        build.load(lib)
    assert cache.loaded == []


# -- a cache deleted under a build ------------------------------------------------------------------

def test_cache_deleted_mid_build_rebuilds_cleanly(cache):
    cache.before = lambda call: shutil.rmtree(cache.root) if call == 1 else None
    lib = cache.build()
    assert len(cache.calls) == 2 and not lib.cached
    assert len(cache.runtime_calls) == 2  # the deleted cache took the runtime with it: rebuilt
    assert lib.path.is_file() and lib.runtime.is_file() and mode(cache.root) == 0o700
    assert entries(cache.root) == sorted([lib.key, runtime_entry()])  # published; no .build-* left
    build.load(lib)
    assert cache.loaded == [(str(lib.path), True)]


def test_retry_outlasts_a_removal_in_progress(cache):
    """`rm -rf` of the cache is not atomic: the build that lost its folder retries while the
    removal still runs, and the retry loses its folder too (CI saw this once). The third
    attempt, after the removal has ended, builds and publishes."""
    cache.before = lambda call: shutil.rmtree(cache.root) if call <= 2 else None
    lib = cache.build()
    assert len(cache.calls) == 3 and lib.path.is_file() and lib.runtime.is_file()
    assert entries(cache.root) == sorted([lib.key, runtime_entry()])


def test_cache_deleted_at_every_try_is_a_one_line_error(cache):
    cache.before = lambda call: shutil.rmtree(cache.root)
    with pytest.raises(BuildError) as info:
        build.build(OPS)
    message = str(info.value)
    assert "\n" not in message and "deleted" in message and str(cache.root) in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_cache_deleted_after_the_library_was_loaded_keeps_the_loaded_ops(cache, monkeypatch):
    """cpp_extension loads the library from the temp folder; if the cache goes before the
    rename, this process still has its ops and the next process builds again."""
    real = cpp_extension.load

    def load_then_delete(**kwargs):
        real(**kwargs)
        if not kwargs["name"].startswith("libfusegen_runtime_"):  # the op's build
            shutil.rmtree(cache.root)

    monkeypatch.setattr(cpp_extension, "load", load_then_delete)
    monkeypatch.setattr(build, "_host_load", load_then_delete)
    lib = build.build(OPS)
    assert not lib.cached and len(cache.calls) == 1
    build.load(lib)  # already loaded in this process: nothing to do, no error
    assert cache.loaded == []


def test_cache_deleted_between_build_and_load_is_a_one_line_error(cache):
    lib = cache.build()
    shutil.rmtree(cache.root)
    with pytest.raises(LoadError) as info:
        build.load(lib)
    message = str(info.value)
    assert "\n" not in message and "deleted" in message and "run again" in message
    assert cache.loaded == []


def test_runtime_deleted_between_build_and_load_is_a_one_line_error(cache):
    lib = cache.build()
    shutil.rmtree(lib.runtime.parent)
    with pytest.raises(LoadError) as info:
        build.load(lib)
    message = str(info.value)
    assert "\n" not in message and str(lib.runtime.parent) in message and "run again" in message
    assert cache.loaded == []


def test_a_cache_that_lost_its_runtime_rebuilds_it(cache):
    lib = cache.build()
    shutil.rmtree(lib.runtime.parent)
    again = cache.build()
    assert again.cached and len(cache.calls) == 1 and len(cache.runtime_calls) == 2
    assert again.runtime.is_file()


@pytest.mark.slow
def test_cache_deleted_during_a_real_compile(tmp_path, monkeypatch):
    """A real build (two compiles of the op): the cache, seeded with the runtime as a user's
    would be, is removed with rm -rf while the compiler runs on the op; fusegen recreates it,
    rebuilds the runtime it lost and the op, publishes both and the op works."""
    from fusegen.tools.cli import main

    name = "cache_deleted_mid_build"
    assert main(["x*2.5 + y*y", "--name", name, "--out", str(tmp_path / "src"), "--no-build"]) == 0
    ops = [(name, {p.name: p.read_text() for p in (tmp_path / "src" / name).iterdir()})]
    root = tmp_path / "cache"
    seed_runtime(root)
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(root))
    stop = threading.Event()
    deleted = []

    def remover():
        while not stop.is_set():
            # ninja starts the compiler on the op now (not the runtime's rebuild)
            if any(p for p in root.glob(".build-*/build.ninja") if not p.parent.name.startswith(".build-runtime-")):
                # Moved aside in one step, then removed: an `rm -rf` in place races the
                # retry (its own case, test_retry_outlasts_a_removal_in_progress); here the
                # deletion happens once, at a known point.
                trash = root.with_name("cache-deleted")
                os.rename(root, trash)
                shutil.rmtree(trash, ignore_errors=True)
                deleted.append(time.perf_counter())
                return
            time.sleep(0.01)

    thread = threading.Thread(target=remover)
    thread.start()
    try:
        lib = build.build(ops)
    finally:
        stop.set()
        thread.join()
    assert deleted, "the cache was never deleted: the build finished first?"
    assert lib.path.is_file() and lib.runtime.is_file()
    assert entries(root) == sorted([lib.key, lib.runtime.parent.name])
    build.load(lib)
    x, y = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(torch.ops.fusegen.cache_deleted_mid_build(x, y), x * 2.5 + y * y)


# -- a cache that cannot be written ---------------------------------------------------------------

READ_ONLY = """
from fusegen.build import builder as build
from fusegen.errors import BuildError
hit = build.build([("fake", {"fake.cpp": "// fusegen test: never compiled\\n", "fake.h": "\\n"})])
print("hit", hit.cached, hit.runtime.is_file())
try:
    build.build([("other", {"other.cpp": "\\n"})])
except BuildError as err:
    print(err)
"""


def _read_only_command(root: Path) -> list[str] | None:
    """How to run READ_ONLY with `root` read-only: permission bits for a user; for root,
    whom they do not stop, a read-only bind mount in a mount namespace of its own (None
    where that is not allowed)."""
    import shutil as _shutil
    import subprocess
    import sys
    if os.geteuid() != 0:
        for path in [root, *root.rglob("*")]:
            os.chmod(path, 0o500 if path.is_dir() else 0o400)
        return [sys.executable, "-c", READ_ONLY]
    mount = ['unshare', '-m', 'sh', '-c', 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && '
             'exec "$1" -c "$2"', str(root), sys.executable]
    if _shutil.which("unshare") is None or subprocess.run(mount + ["pass"], capture_output=True).returncode:
        return None
    return mount + [READ_ONLY]


def test_a_read_only_cache_loads_and_says_which_folder_it_cannot_build_in(cache):
    """A cache that cannot be written (a read-only mount, a shared copy): a hit still works;
    a build is one line naming the read-only folder, not a bare OSError."""
    import subprocess
    cache.build()  # the fake op and the runtime, published
    command = _read_only_command(cache.root)
    if command is None:
        pytest.skip("running as root, and no mount namespace to make the cache read-only in")
    try:
        r = subprocess.run(command, capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, FUSEGEN_CACHE_DIR=str(cache.root)))
    finally:
        for path in [cache.root, *cache.root.rglob("*")]:
            os.chmod(path, 0o700)
    assert r.returncode == 0, r.stderr
    hit, message = r.stdout.splitlines()
    assert hit == "hit True True"
    assert message.startswith(f"fusegen: cannot build op(s) other: the cache folder {cache.root / 'locks'} "
                              "is read-only (")
    assert "still loads the libraries it holds" in message and "FUSEGEN_CACHE_DIR" in message

"""A corrupt cache entry is found before it is loaded, and rebuilt.

Every entry's entry.json records its library's size and sha256 when it is published; a
cache hit, the request index and build.load check them before the library is opened (a
truncated library is a SIGBUS in dlopen, random bytes a load error forever, a patched code
section anything). A bad entry is rebuilt with a warning naming it; the shared runtime's
entry as well as an op library's. Most tests use test_cache.py's fake compiler (its
"library" is a few bytes); one corrupts a real library and runs the CLI."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

import test_cache
from conftest import seed_runtime
from fusegen.build import builder as build
from fusegen.build import cache as fcache
from fusegen.errors import LoadError

cache = test_cache.cache


@pytest.fixture
def fake_bytes(cache, monkeypatch):
    """The fake compiler, writing 4 KiB of library instead of an empty file."""
    real = test_cache.cpp_extension.load

    def load(name, sources, build_directory, **kwargs):
        real(name=name, sources=sources, build_directory=build_directory, **kwargs)
        with open(os.path.join(build_directory, f"{name}.so"), "wb") as fh:
            fh.write(b"\x7fELF" + bytes(range(256)) * 16)

    monkeypatch.setattr(test_cache.cpp_extension, "load", load)
    monkeypatch.setattr(test_cache.build, "_host_load", load)
    return cache


def truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


def randomize(path):
    path.write_bytes(os.urandom(os.path.getsize(path)))


def patch(path):
    """One byte changed in the middle, size and mtime kept (what a bit flip does)."""
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(st.st_size // 2)
        byte = fh.read(1)
        fh.seek(st.st_size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_published_entries_record_size_and_sha256(fake_bytes):
    import hashlib
    lib = fake_bytes.build()
    for path in (lib.path, lib.runtime):
        meta = json.loads((path.parent / "entry.json").read_text())
        data = path.read_bytes()
        assert meta["library"] == path.name and meta["size"] == len(data) == 4100
        assert meta["sha256"] == hashlib.sha256(data).hexdigest()
        assert fcache.verify(path) is None


@pytest.mark.parametrize("damage", [truncate, randomize, patch])
@pytest.mark.parametrize("which", ["op", "runtime"])
def test_a_corrupt_entry_is_rebuilt_with_a_warning(fake_bytes, caplog, damage, which):
    lib = fake_bytes.build()
    path = lib.path if which == "op" else lib.runtime
    fcache._VERIFIED.clear()  # a new process: nothing checked yet
    damage(path)
    with caplog.at_level(logging.WARNING, logger="fusegen"):
        again = fake_bytes.build()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"the cache entry {path.parent} is corrupt (" in warnings[0]
    assert warnings[0].endswith("; rebuilding it") and "\n" not in warnings[0]
    assert fcache.verify(path) is None and os.path.getsize(path) == 4100
    calls = fake_bytes.calls if which == "op" else fake_bytes.runtime_calls
    assert len(calls) == 2 and again.path == lib.path
    assert not [p for p in fake_bytes.root.iterdir() if p.name.startswith((".trash-", ".build-"))]
    build.load(again)
    assert fake_bytes.loaded == [(str(lib.path), True)]


def test_a_corrupt_library_is_never_loaded(fake_bytes):
    lib = fake_bytes.build()
    for path in (lib.path, lib.runtime):
        fcache._VERIFIED.clear()
        saved = path.read_bytes()
        patch(path)
        with pytest.raises(LoadError) as info:
            build.load(lib)
        message = str(info.value)
        assert f"the cache entry {path.parent} is corrupt (the sha256 of {path.name} differs" in message
        assert "run again" in message and "\n" not in message
        path.write_bytes(saved)
    (lib.path.parent / "entry.json").unlink()
    fcache._VERIFIED.clear()  # a new process (this one checked the library against it already)
    with pytest.raises(LoadError, match="entry.json is missing"):
        build.load(lib)
    assert fake_bytes.loaded == []  # dlopen never saw a corrupt library


def test_the_index_does_not_hand_back_a_corrupt_library(fake_bytes, monkeypatch):
    from fusegen.build import index
    from fusegen.api import Request
    from fusegen.ir.family import Member
    lib = fake_bytes.build()
    request = Request("a*b", name="fake")
    entry = index.Entry("fake", ("a", "b"), (), "a*b", True, "d", lib,
                        (Member("fake", 2, True, False),))
    index.record(request, entry)
    assert index.lookup(request).library.path == lib.path
    fcache._VERIFIED.clear()
    truncate(lib.runtime)
    assert index.lookup(request) is None  # the long way, which rebuilds it


def test_verification_is_cheap_and_checked_once_per_process(fake_bytes):
    lib = fake_bytes.build()
    big = lib.path.with_name("big.so")
    big.write_bytes(os.urandom(4 << 20))
    fcache.write_entry_json(lib.path.parent, "op", ["fake"], False, "v", "t", "big.so")
    fcache._VERIFIED.clear()
    start = time.perf_counter()
    assert fcache.verify(big) is None
    first = time.perf_counter() - start
    start = time.perf_counter()
    assert fcache.verify(big) is None
    again = time.perf_counter() - start
    assert first < 0.5 and again < first  # 4 MiB hashed once; then one stat
    patch(big)  # a change keeps the size and mtime, not the ctime: checked again
    assert "sha256" in fcache.verify(big)


def test_a_later_process_hashes_a_library_only_when_it_or_its_record_changed(fake_bytes, monkeypatch):
    """The stamp a verification leaves survives the loads that bump entry.json's mtime
    (mark_used), and nothing else: a changed library or a changed record is hashed again."""
    lib = fake_bytes.build()
    hashed = []
    real = fcache._digest
    monkeypatch.setattr(fcache, "_digest", lambda path: hashed.append(path.name) or real(path))
    for path in (lib.path, lib.runtime):
        fcache._VERIFIED.clear()  # a new process
        assert fcache.verify(path) is None and (path.parent / fcache.VERIFIED_FILE).is_file()
        fcache.mark_used(path.parent)
        time.sleep(0.01)
        fcache.mark_used(path.parent)
        fcache._VERIFIED.clear()
        hashed.clear()
        assert fcache.verify(path) is None and hashed == []
        meta = json.loads((path.parent / "entry.json").read_text())
        (path.parent / "entry.json").write_text(json.dumps(dict(meta, sha256="0" * 64)))
        fcache._VERIFIED.clear()
        assert "sha256" in fcache.verify(path) and hashed == [path.name]
        (path.parent / "entry.json").write_text(json.dumps(meta))
        patch(path)
        fcache._VERIFIED.clear()
        assert "sha256" in fcache.verify(path) and hashed == [path.name] * 2


CLI = [sys.executable, "-m", "fusegen", "x*3.5 - y", "--name", "corrupt_op"]


def test_a_truncated_real_library_is_rebuilt_not_a_bus_error(tmp_path):
    """A real op library cut in half (as by a full disk or a killed copy): the next run
    says which entry it rebuilds, and the op works."""
    root = tmp_path / "cache"
    seed_runtime(root)
    env = dict(os.environ, FUSEGEN_CACHE_DIR=str(root))
    first = subprocess.run(CLI + ["--out", str(tmp_path / "g")], capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr
    (lib,) = root.glob("[0-9a-f]*/fusegen_*.so")
    truncate(lib)
    again = subprocess.run(CLI + ["--out", str(tmp_path / "g")], capture_output=True, text=True, env=env,
                           timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"warning: the cache entry {lib.parent} is corrupt ({lib.name} is " in again.stdout
    assert "built in" in again.stdout and fcache.verify(lib) is None

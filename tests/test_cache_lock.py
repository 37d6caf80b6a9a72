"""A build lock held by a process that is alive but stuck (stopped with SIGSTOP, hung) is
waited for a bounded time (FUSEGEN_LOCK_TIMEOUT), with a line naming the holder's pid, and
then given up with an error that names it; the holder keeps its lock and its build. The
holder writes its pid into the lock file while it holds it. Builds use test_cache.py's
fake compiler."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import test_cache
from fusegen.build import builder as build
from fusegen.build import cache as fcache
from fusegen.errors import BuildError, FusegenError
from test_cache import OPS

cache = test_cache.cache

# Takes the lock as a build does (fusegen.build.cache.build_lock: no torch import), says so, and
# stops itself, as a build suspended with Ctrl-Z or `kill -STOP` is.
HOLDER = """
import os, signal, sys
from pathlib import Path
from fusegen.build import cache
with cache.build_lock(Path(sys.argv[1]), "op(s) fake"):
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    sys.stdin.readline()
"""


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def stopped_holder(cache):
    """A process holding the op's build lock, stopped. The runtime is built first (not the
    lock under test)."""
    build.runtime_library()
    lock = fcache.lock_path(cache.root, build.cache_key(OPS, build.cuda_enabled()))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert proc.stdout.readline() == "held\n"
        deadline = time.time() + 30
        while state(proc.pid) not in ("T", "t"):
            assert time.time() < deadline
            time.sleep(0.01)
        yield proc, lock
    finally:
        proc.kill()
        proc.wait()


def test_a_stopped_holder_is_named_and_given_up_on(stopped_holder, monkeypatch, caplog):
    proc, lock = stopped_holder
    assert lock.read_text() == f"{proc.pid}\n"
    monkeypatch.setenv("FUSEGEN_LOCK_TIMEOUT", "1")
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="fusegen"):
        with pytest.raises(BuildError) as info:
            build.build(OPS)
    waited = time.monotonic() - start
    assert 1.0 <= waited < 10
    waiting = f"waiting for another process (pid {proc.pid}, stopped: `kill -CONT {proc.pid}` resumes it) " \
              "building op(s) fake (giving up after 1 s: FUSEGEN_LOCK_TIMEOUT)"
    assert waiting in caplog.text
    message = str(info.value)
    assert message.startswith("fusegen: gave up building op(s) fake after waiting 1 s for its lock ")
    assert f"held by another process (pid {proc.pid}, stopped" in message and str(lock) in message
    assert "set FUSEGEN_LOCK_TIMEOUT" in message and "\n" not in message
    # The holder's lock and pid are untouched, and so is whatever it builds.
    with open(lock) as fh:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert lock.read_text() == f"{proc.pid}\n"
    assert not [p for p in cache_root(lock).iterdir() if p.name.startswith(".build-")]


def cache_root(lock: Path) -> Path:
    return lock.parent.parent


def test_a_holder_that_resumes_and_finishes_lets_the_build_through(stopped_holder, monkeypatch):
    proc, lock = stopped_holder
    monkeypatch.setenv("FUSEGEN_LOCK_TIMEOUT", "60")
    os.kill(proc.pid, signal.SIGCONT)
    proc.stdin.write("\n")
    proc.stdin.flush()  # it leaves the lock
    assert proc.wait(timeout=30) == 0
    assert lock.read_text() == ""  # a released lock names nobody
    lib = build.build(OPS)
    assert lib.path.is_file() and lock.read_text() == ""


def test_a_build_holds_the_lock_with_its_pid(cache):
    seen = []
    cache.before = lambda call: seen.append(
        (fcache.lock_path(cache.root, build.cache_key(OPS, False)).read_text()))
    cache.build()
    assert seen == [f"{os.getpid()}\n"]


@pytest.mark.parametrize("value", ["abc", "-1", "nan"])
def test_a_bad_lock_timeout_is_one_line(monkeypatch, value):
    monkeypatch.setenv("FUSEGEN_LOCK_TIMEOUT", value)
    with pytest.raises(FusegenError) as info:
        fcache.lock_timeout()
    assert str(info.value) == ("fusegen: FUSEGEN_LOCK_TIMEOUT must be a number of seconds (0 or more), "
                               f"got {value!r}")


def test_the_lock_timeout_defaults_to_minutes(monkeypatch):
    monkeypatch.delenv("FUSEGEN_LOCK_TIMEOUT", raising=False)
    assert fcache.lock_timeout() == 600
    monkeypatch.setenv("FUSEGEN_LOCK_TIMEOUT", "2.5")
    assert fcache.lock_timeout() == 2.5

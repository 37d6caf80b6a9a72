"""Shared fixtures. The expensive one is `corpus_ops`: the whole numeric corpus built once
per test run into one library (one compile instead of one per op)."""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # `import corpus` from every test module

# A private cache per test run unless CI (or the user) chose one: tests must not depend on,
# or pollute, ~/.cache/fusegen. Set at import time, before anything can build; subprocesses
# (the CLI tests) inherit it.
if not os.environ.get("FUSEGEN_CACHE_DIR"):
    os.environ["FUSEGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="fusegen-test-cache-")
# Nor on a runtime `fusegen setup` installed: the run builds its own into its cache (the
# cache's tests see what a user without `fusegen setup` sees); test_setup.py installs one.
if not os.environ.get("FUSEGEN_RUNTIME_DIR"):
    os.environ["FUSEGEN_RUNTIME_DIR"] = os.path.join(os.environ["FUSEGEN_CACHE_DIR"], "no-installed-runtime")

BUILD_SECONDS: dict[str, float] = {}


@functools.cache
def _corpus_ops() -> dict:
    from corpus import CORPUS
    from fusegen.api import Request, fuse_many

    start = time.perf_counter()
    ops = fuse_many([Request(c.expr, c.name, c.inputs, c.scalars) for c in CORPUS])
    BUILD_SECONDS["corpus"] = time.perf_counter() - start
    return {c.name: op for c, op in zip(CORPUS, ops)}


@pytest.fixture(scope="module")
def corpus_ops():
    """name -> FusedOp for every corpus case, all in one library, built once per test run
    (at the first test that asks for it)."""
    return _corpus_ops()


def seed_runtime(cache: Path) -> Path:
    """Copy the shared runtime (built once in the test run's cache) into another cache
    folder, so a test with a fresh cache compiles only its ops, as a user's would."""
    import shutil
    from fusegen.build import builder as build
    lib = build.runtime_library()
    target = Path(cache) / lib.path.parent.name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(lib.path.parent, target)
    return target


# The tests this run will execute, after -k/-m deselection (which pytest's own hook makes).
_SELECTED: list = []


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    _SELECTED[:] = items


def selected_params(request, param: str) -> list:
    """The values of the parametrized argument `param` of the tests of this run that use the
    requesting fixture (after -m/-k deselection), so that a fixture building one library for
    a whole table builds only the rows that will run (the rest may be marked slow)."""
    values = []
    for item in _SELECTED:
        callspec = getattr(item, "callspec", None)
        if request.fixturename in getattr(item, "fixturenames", ()) and callspec and param in callspec.params:
            if callspec.params[param] not in values:
                values.append(callspec.params[param])
    return values


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def pytest_terminal_summary(terminalreporter):
    if BUILD_SECONDS:
        terminalreporter.write_line(
            "fusegen corpus build: " + ", ".join(f"{k} {v:.1f} s" for k, v in BUILD_SECONDS.items())
            + f" (cache {os.environ.get('FUSEGEN_CACHE_DIR')})")


@pytest.fixture(autouse=True)
def _no_waiting_fused_functions_leak():
    """A @fused function a test defines but never calls waits to be built with the next
    one called anywhere; drop what a test left waiting, so that each test builds only its
    own functions (tests/test_index.py counts them)."""
    from fusegen.frontend import decorator
    with decorator._PENDING_LOCK:
        before = list(decorator._PENDING)
    yield
    with decorator._PENDING_LOCK:
        decorator._PENDING[:] = [f for f in decorator._PENDING if any(f is b for b in before)]

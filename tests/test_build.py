"""The build stage: a failed build leaves nothing behind, the cache key names what changes
the binary, and another process loads a built library without compiling."""

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import seed_runtime
from fusegen.build import builder as build
from fusegen.errors import BuildError, FusegenError

TESTS = Path(__file__).resolve().parent


def test_failed_build_raises_with_log_and_leaves_no_trace(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    runtime = seed_runtime(cache)
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(cache))
    broken = {"broken.cpp": '#error "fusegen test: this op does not compile"\n',
              "broken.cu": '#error "fusegen test: this op does not compile"\n'}
    with pytest.raises(BuildError) as info:
        build.build([("broken", broken)])
    message = str(info.value)
    assert isinstance(info.value, FusegenError)
    assert "broken" in message and "this op does not compile" in message
    assert "broken.cpp" in message  # the sources are named
    # No published entry, no temp build folder: only the (unheld) lock file, the runtime
    # and the cache's marker.
    assert sorted(p.name for p in cache.iterdir()) == sorted(["CACHEDIR.TAG", "locks", runtime.name])
    (lock,) = (cache / "locks").iterdir()
    with open(lock) as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if a lock were left held


def test_cache_key_names_sources_and_flags(monkeypatch):
    ops = [("k", {"k.cpp": "int x;\n", "k.h": "\n"})]
    key = build.cache_key(ops, cuda=False)
    runtime = build.runtime_key(cuda=False)
    assert build.cache_key(ops, cuda=False) == key
    assert build.cache_key([("k", {"k.cpp": "int y;\n", "k.h": "\n"})], cuda=False) != key
    assert build.cache_key([("k2", {"k.cpp": "int x;\n", "k.h": "\n"})], cuda=False) != key
    monkeypatch.setattr(build, "runtime_key", lambda cuda: "another runtime")
    assert build.cache_key(ops, cuda=False) != key  # a new runtime relinks every op
    monkeypatch.undo()
    from fusegen.build import toolchain
    monkeypatch.setattr(toolchain, "CXX_FLAGS", toolchain.CXX_FLAGS + ["-DSOMETHING"])
    assert build.cache_key(ops, cuda=False) != key
    assert build.runtime_key(cuda=False) != runtime  # the runtime's flags changed too


def test_another_process_loads_the_corpus_without_compiling(corpus_ops):
    script = (
        "import sys, time; sys.path.insert(0, sys.argv[1])\n"
        "from corpus import CORPUS\n"
        "from fusegen.api import Request, generate, load_generated\n"
        "gen = [generate(Request(c.expr, c.name, c.inputs, c.scalars)) for c in CORPUS]\n"
        "t = time.perf_counter(); ops = load_generated(gen); dt = time.perf_counter() - t\n"
        "print(ops[0].library.cached, ops[0].library.key, round(dt, 3))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(TESTS)], capture_output=True, text=True,
                         env=dict(os.environ), check=True).stdout.split()
    library = next(iter(corpus_ops.values())).library
    assert out[0] == "True" and out[1] == library.key
    assert float(out[2]) < 5.0  # load, not compile (a compile takes tens of seconds)


def test_two_processes_building_one_op_compile_it_once(tmp_path):
    """Both start cold on the same new op; the flock makes one compile and the other wait
    and load what it published."""
    script = ("import fusegen\n"
              "op = fusegen.fuse('x*1.5 + y*y', name='lock_race')\n"
              "print(op.library.cached)\n")
    runtime = seed_runtime(tmp_path / "cache")
    env = dict(os.environ, FUSEGEN_CACHE_DIR=str(tmp_path / "cache"))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert sorted(out.strip() for out, _ in outs) == ["False", "True"]
    entries = [p for p in (tmp_path / "cache").iterdir()
               if p.name not in ("locks", "index", "templates", "CACHEDIR.TAG", runtime.name)]
    assert len(entries) == 1 and not entries[0].name.startswith(".build-")


def test_the_runtime_is_built_once_and_op_libraries_link_to_it(corpus_ops):
    """One runtime per toolchain, built once (here by the corpus fixture) and then cached;
    the op library needs it by soname and finds it through its rpath, relative to its own
    folder (so no cache path is on the link line, and a moved cache still loads)."""
    assert build.runtime_key(cuda=False) == build.runtime_key(cuda=False)
    runtime = build.runtime_library()
    assert runtime.cached and runtime.path.name == f"libfusegen_runtime_{runtime.key}.so"
    library = next(iter(corpus_ops.values())).library
    dynamic = subprocess.run(["readelf", "-d", str(library.path)], capture_output=True, text=True).stdout
    if dynamic:  # binutils present
        assert f"[{runtime.path.name}]" in dynamic
        assert f"[$ORIGIN/../{runtime.path.parent.name}]" in dynamic and str(runtime.path.parent) not in dynamic


@pytest.mark.parametrize("route, suffix", [("nvcc", "_kernels.cu"), ("nvrtc", "_launch.cpp")])
def test_translation_units_spread_cuda_sources_over_the_cores(monkeypatch, route, suffix):
    """A new op (its .cpp/.cu and its auxiliary ops') is one C++ unit, and its three .cu
    files are three compiler runs in parallel on a machine with the cores for it: nvcc's,
    or on the NVRTC route the host compiler's, of the launchers alone."""
    monkeypatch.setenv("FUSEGEN_CUDA_COMPILER", route)
    files = {f"op{s}.{ext}": "" for s in ("", "_grad2", "_jvp") for ext in ("cpp", "cu", "h")}
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    units = build._units([("op", files)], cuda=True)
    assert sorted(units) == ["unit0.cpp"] + [f"unit{k}{suffix}" for k in range(3)]
    assert units["unit0.cpp"].count("#include") == 3 and "fusegen-" not in units["unit0.cpp"]
    many = build._units([(f"op{k}", {"a.cu": "", "a.cpp": ""}) for k in range(40)], cuda=True)
    assert sum(1 for u in many if u.endswith(suffix)) == 14  # 40 files, 3 per unit on 16 cores
    assert sum(u.count("#include") for n, u in many.items() if n.endswith(suffix)) == 40
    if route == "nvrtc":  # each .cu's path, once, for its rtc_source()
        assert sum(u.count("#define FUSEGEN_RTC_FILE") for u in many.values()) == 40
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert sum(1 for u in build._units([("op", files)], cuda=True) if u.endswith(suffix)) == 2

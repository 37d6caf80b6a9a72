"""The cache key names the compilers by their real identity and the environment that
changes a build, and the request index's key is built from the same list (keys.key_parts).

The compilers here are small shell scripts standing in for g++ (their `--version` ends in
g++'s warranty line, which the key once took for the version); nothing is compiled."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fusegen.build import builder as build
from fusegen.build import keys as fkeys
from fusegen.api import Request

OPS = [("k", {"k.cpp": "int x;\n"})]
WARRANTY = ("This is free software; see the source for copying conditions.  There is NO\n"
            "warranty; not even for MERCHANTABILITY or FITNESS FOR A PARTICULAR PURPOSE.")


def compiler(folder: Path, first_line: str, machine: str = "x86_64-linux-gnu") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "g++"
    script.write_text("#!/bin/sh\n"
                      f'if [ "$1" = -dumpmachine ]; then echo {machine}; exit 0; fi\n'
                      f"cat <<'EOF'\n{first_line}\nCopyright (C) 2022 Free Software Foundation, Inc.\n"
                      f"{WARRANTY}\n\nEOF\n")
    script.chmod(0o755)
    return script


def keys() -> tuple[str, str, str]:
    return (build.cache_key(OPS, cuda=False), build.runtime_key(cuda=False),
            fkeys.request_key(Request("a*b", name="k")))


def cxx_part() -> str:
    return next(p for p in fkeys.key_parts(False) if p.startswith("c++: "))


@pytest.fixture
def clean_env(monkeypatch):
    for name in fkeys.KEY_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_two_compilers_with_the_same_last_line_have_different_keys(tmp_path, clean_env):
    gcc12 = compiler(tmp_path / "a", "g++ (Debian 12.2.0-14) 12.2.0")
    gcc13 = compiler(tmp_path / "b", "g++ (Debian 13.1.0-1) 13.1.0")
    clean_env.setenv("CXX", str(gcc12))
    first = keys()
    clean_env.setenv("CXX", str(gcc13))
    second = keys()
    assert all(a != b for a, b in zip(first, second))
    assert cxx_part() == f"c++: {gcc13}\ng++ (Debian 13.1.0-1) 13.1.0\nx86_64-linux-gnu"


def test_a_compiler_upgraded_in_place_changes_the_keys(tmp_path, clean_env):
    path = compiler(tmp_path / "bin", "g++ (Debian 12.2.0-14) 12.2.0")
    clean_env.setenv("CXX", str(path))
    before = keys()
    compiler(tmp_path / "bin", "g++ (Debian 12.3.0-1) 12.3.0")  # same path, new version
    os.utime(path, ns=(0, 10**18))  # a new file: a new mtime, whatever the clock's resolution
    after = keys()
    assert all(a != b for a, b in zip(before, after))


def test_the_compiler_is_found_as_the_build_finds_it(tmp_path, clean_env):
    """`c++` on the PATH, resolved through its symlinks: the same key by either name, a
    different one when the PATH finds another compiler."""
    real = compiler(tmp_path / "real", "g++ (Debian 12.2.0-14) 12.2.0")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "c++").symlink_to(real)
    clean_env.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    via_path = keys()
    assert cxx_part() == f"c++: {real}\ng++ (Debian 12.2.0-14) 12.2.0\nx86_64-linux-gnu"
    clean_env.setenv("CXX", str(tmp_path / "bin" / "c++"))
    assert cxx_part() == f"c++: {real}\ng++ (Debian 12.2.0-14) 12.2.0\nx86_64-linux-gnu"
    clean_env.delenv("CXX")
    other = compiler(tmp_path / "other", "clang version 16.0.6")
    (tmp_path / "bin" / "c++").unlink()
    (tmp_path / "bin" / "c++").symlink_to(other)
    assert all(a != b for a, b in zip(via_path, keys()))


@pytest.mark.parametrize("name", fkeys.KEY_ENV)
def test_every_variable_that_changes_a_build_changes_both_keys(clean_env, name):
    if name in ("CXX", "CC", "PYTORCH_NVCC", "NVCC_CCBIN", "CUDA_HOME", "CUDA_PATH"):
        value = "/usr/bin/c++" if name == "CXX" else "/nonexistent/tool"
    else:
        value = "/opt/include:-DX"
    before = keys()
    clean_env.setenv(name, value)
    assert all(a != b for a, b in zip(before, keys())), name
    clean_env.setenv(name, "")  # set but empty is another environment than unset
    assert keys()[0] != before[0]


def test_the_key_lists_the_variables_the_compilers_read():
    assert {"CXX", "CC", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "TORCH_CUDA_ARCH_LIST", "CPATH",
            "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "CUDA_HOME"} <= set(fkeys.KEY_ENV)


def test_the_index_key_is_built_from_the_cache_keys_list(monkeypatch):
    """One list (keys.key_parts) for both keys; the index's asks it not to run anything."""
    request = Request("a*b", name="k")
    calls = []
    real = fkeys.key_parts

    def spy(cuda, probe=True):
        calls.append(probe)
        return real(cuda, probe) + (["changed"] if probe is False else [])

    before = fkeys.request_key(request)
    monkeypatch.setattr(fkeys, "key_parts", spy)
    assert fkeys.request_key(request) != before and calls == [False]
    monkeypatch.setattr(fkeys, "_run", lambda *a: pytest.fail("the index key ran a compiler"))
    fkeys._identity.cache_clear()
    fkeys.request_key(request)


def test_the_cuda_compiler_route_keys_op_libraries_and_the_index_not_the_runtime(monkeypatch):
    """FUSEGEN_CUDA_COMPILER (nvrtc, nvcc) decides what an op library holds (launchers only,
    or every kernel), so it is part of an op library's key and of the request index's key
    on a machine with CUDA; the runtime serves both routes and keeps one key. Another value
    is refused, naming the variable and the values it takes."""
    from fusegen.build import toolchain
    from fusegen.errors import BuildError

    # Key parts as on a CUDA machine, without probing nvcc or a GPU (this machine may have none).
    monkeypatch.setattr(fkeys, "key_parts", lambda cuda, probe=True: ["parts", str(cuda)])
    monkeypatch.setattr(toolchain, "cuda_enabled", lambda: True)
    found = {}
    for route in ("nvrtc", "nvcc"):
        monkeypatch.setenv("FUSEGEN_CUDA_COMPILER", route)
        found[route] = (fkeys.cache_key(OPS, True, "runtime"), fkeys.runtime_key(True, {"r.cpp": ""}),
                        fkeys.request_key(Request("a*b", name="k")))
    assert found["nvrtc"][0] != found["nvcc"][0] and found["nvrtc"][2] != found["nvcc"][2]
    assert found["nvrtc"][1] == found["nvcc"][1]
    monkeypatch.delenv("FUSEGEN_CUDA_COMPILER")
    assert toolchain.cuda_compiler() == "nvrtc"  # the default
    monkeypatch.setenv("FUSEGEN_CUDA_COMPILER", "clang")
    with pytest.raises(BuildError, match=r"FUSEGEN_CUDA_COMPILER must be one of nvrtc, nvcc, got 'clang'"):
        fkeys.cache_key(OPS, True, "runtime")

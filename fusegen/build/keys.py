"""Every key fusegen hashes, in one place: an op library's cache key, the shared runtime's
key, the request index's key and the digest of an op's generated files.

The two kinds of library key hash their sources and `key_parts`, the one list of what else
decides a library's bytes: fusegen's version, torch, CUDA, Python, the environment the
compilers read (KEY_ENV), the GPU architectures, the compilers' identities and the flags.
The request index's key (index.py) hashes the request, fusegen's own sources and templates
(so editing the generator never finds a stale library) and the same list, except that a
compiler is named by its resolved file and that file's stat rather than by running it: a
cached load runs no process. A compiler replaced or upgraded is then a miss of the index,
and the cache key, which asks the compiler, decides whether to rebuild.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import torch

from fusegen.build import toolchain
from fusegen.files import templates_dir
from fusegen.version import FUSEGEN_VERSION

INDEX_FORMAT = 7  # of a request index entry: bump when its fields change (a new key, a miss)

# The environment variables that change what the compilers make (read by gcc/clang, nvcc or
# torch.utils.cpp_extension): part of every cache key, and of the request index's key.
KEY_ENV = ("CXX", "CC", "NVCC_CCBIN", "PYTORCH_NVCC", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS",
           "TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "CUDA_PATH", "CPATH", "C_INCLUDE_PATH",
           "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "GCC_EXEC_PREFIX", "COMPILER_PATH", "LD_RUN_PATH",
           "FUSEGEN_CPU_ONLY")


def _binary(command: str) -> tuple[str, tuple]:
    """A compiler command's binary, resolved (PATH, symlinks: `c++` -> /usr/bin/x86_64-linux-gnu-g++-12),
    and its stat (size, mtime, inode): what changes when it is replaced or upgraded."""
    words = shlex.split(command) or [command]
    found = shutil.which(words[0])
    path = os.path.realpath(found) if found else words[0]
    try:
        st = os.stat(path)
        return path, (st.st_size, st.st_mtime_ns, st.st_ino)
    except OSError:
        return path, ()


def _run(command: str, *args: str) -> str:
    try:
        words = shlex.split(command) or [command]
        out = subprocess.run(words + list(args), capture_output=True, text=True, timeout=60).stdout
    except (OSError, ValueError, subprocess.SubprocessError):
        return "unavailable"
    return out.strip()


@lru_cache(maxsize=None)
def _identity(role: str, command: str, binary: str, stamp: tuple) -> str:
    """What a compiler is, asked once per process and binary (`stamp` is in the memo's key:
    a compiler replaced in place is asked again). Not the last line of `--version`, which
    for g++ is its warranty notice, the same for every version: for gcc/clang the first line
    (name and version) and the target (-dumpmachine); for nvcc the whole `--version` (its
    release and build lines); always the resolved binary."""
    if role == "nvcc":
        return f"{binary}\n{_run(command, '--version')}"
    first = (_run(command, "--version").splitlines() or ["unknown"])[0]
    return f"{binary}\n{first}\n{_run(command, '-dumpmachine')}"


def key_parts(cuda: bool, probe: bool = True) -> list[str]:
    """Everything besides the sources that decides a library's bytes, in one list for every
    key. The cache key (probe=True) names each compiler by its identity (running it, once
    per process); the request index's key (probe=False) by its resolved binary and that
    file's stat, since a cached load must run no process: a compiler replaced in place then
    misses the index, and the cache key, which asks it, decides whether to rebuild."""
    parts = [FUSEGEN_VERSION, torch.__version__, str(torch.version.cuda), sys.version, sys.platform, str(cuda)]
    parts += [f"{name}={os.environ.get(name)!r}" for name in KEY_ENV]  # unset and "" differ
    if cuda:
        parts.append(repr(toolchain.cuda_arch_flags()))
    for role, command in toolchain.compilers(cuda):
        binary, stamp = _binary(command)
        parts.append(f"{role}: {_identity(role, command, binary, stamp) if probe else (binary, stamp)}")
    if probe:
        parts.append(repr(toolchain.build_flags(cuda)))  # libmvec's presence: asks ldconfig
    return parts


def _hash(parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def _named(files: dict[str, str]) -> list[str]:
    return [text for name in sorted(files) for text in (name, files[name])]


def _route(cuda: bool) -> list[str]:
    """How an op library's CUDA kernels are compiled (toolchain.cuda_compiler): part of an op
    library's key and the request index's, not the runtime's, which serves both routes."""
    return [f"cuda kernels: {toolchain.cuda_compiler()}"] if cuda else []


def runtime_key(cuda: bool, sources: dict[str, str]) -> str:
    """The shared runtime's key: its sources and key_parts."""
    return _hash(["runtime"] + key_parts(cuda) + _named(sources))


def cache_key(ops: list[tuple[str, dict[str, str]]], cuda: bool, runtime: str) -> str:
    """An op library's key: key_parts, the runtime's key (a new runtime relinks every op)
    and each op's name and files."""
    parts = key_parts(cuda) + [runtime] + _route(cuda)
    for name, files in sorted(ops):
        parts += [name] + _named(files)
    return _hash(parts)


def files_digest(files: dict[str, str]) -> str:
    """Of an op's generated files: one name, one expression."""
    return _hash(_named(files))


@lru_cache(maxsize=None)
def generator_digest() -> str:
    """fusegen's Python sources and templates, as they are on disk: each file's path, size,
    mtime, ctime and inode, hashed once per process (stat calls, no reads: a cached load
    starts in a few ms). Any write to a file, or a file copied or replaced (`cp -p` and
    `git checkout` included), changes its ctime, which nothing can set back; a digest that
    changed only misses the index, and the cache key, which hashes the generated sources,
    decides whether to rebuild."""
    h = hashlib.sha256()
    package = str(Path(__file__).resolve().parent.parent)
    for folder in (package, str(templates_dir())):
        found = []
        for top, dirs, files in os.walk(folder):
            # Not the bytecode, nor the runtime `fusegen setup` built (many files, none ours).
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "_installed")]
            rel = os.path.relpath(top, folder)
            found += [(os.path.join(top, f), f if rel == "." else f"{rel}/{f}") for f in files
                      if f.endswith((".py", ".j2", ".h", ".cuh", ".cpp"))]
        for path, rel in sorted(found, key=lambda pair: pair[1]):
            st = os.stat(path)
            stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
            h.update(rel.encode() + b"\0" + repr(stamp).encode() + b"\0")
    return h.hexdigest()


def request_key(request) -> str:
    """The index key of a Request (api.Request: a frozen dataclass of strings and tuples)."""
    cuda = toolchain.cuda_enabled()
    return _hash([f"index-{INDEX_FORMAT}", generator_digest(), repr(request)]
                 + key_parts(cuda, probe=False) + _route(cuda))

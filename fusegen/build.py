"""The only place that touches the compiler and the cache.

One library holds one or more ops (tests build a whole corpus into one). The cache key
names everything that changes the binary: the sources, the flags, torch, CUDA, the
compilers, the GPU architectures and fusegen's version. A build runs in a private temp
directory under an flock (released by the kernel if the process dies, so no stale
locks) and is published with one atomic rename; a failed build leaves nothing behind.

The cache holds shared libraries that are loaded into the process, so it must be private:
fusegen creates it 0700 and refuses to build in, or load from, a cache directory, entry or
library that another user owns or that group or others can write. A cache deleted while a
build runs is recreated and the build runs again, once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from .errors import BuildError, FusegenError, LoadError
from .files import write
from .spec import FUSEGEN_VERSION

CXX_FLAGS = ["-O3", "-Wall"]
# Accurate math by default: no --use_fast_math, so results match eager PyTorch.
NVCC_FLAGS = ["-O3"]  # cpp_extension adds the -std= that matches torch
OPS_PER_UNIT = 6  # ops per translation unit: two units build in parallel on two cores


@dataclass(frozen=True)
class Library:
    path: Path          # the shared library in the cache
    key: str
    seconds: float      # time spent building (0.0 on a cache hit)
    cached: bool


def cache_dir() -> Path:
    return Path(os.environ.get("FUSEGEN_CACHE_DIR") or Path.home() / ".cache" / "fusegen")


def _check_private(path: Path, what: str, fix: str, error: type[FusegenError]):
    """Raise `error` unless `path` is owned by this user and not writable by group or others:
    whoever can write there can put code into every process that loads from the cache."""
    st = os.stat(path)
    me = os.geteuid()
    if st.st_uid != me:
        raise error(f"fusegen: refusing to use the {what} {path}: it is owned by uid {st.st_uid}, "
                    f"not by you (uid {me}), and fusegen loads the libraries in it into this "
                    f"process. Set FUSEGEN_CACHE_DIR to a directory you own.")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise error(f"fusegen: refusing to use the {what} {path}: group or others can write to it "
                    f"(mode {stat.S_IMODE(st.st_mode):o}), and fusegen loads the libraries in it "
                    f"into this process. Fix: {fix}, or set FUSEGEN_CACHE_DIR to a directory "
                    f"only you can write.")


def _cache_root(error: type[FusegenError]) -> Path:
    """The cache directory, created 0700 when missing, checked private when it exists."""
    root = cache_dir()
    try:
        root.mkdir(mode=0o700, parents=True)
        os.chmod(root, 0o700)  # exactly 0700, whatever the umask
    except FileExistsError:
        pass
    except OSError as err:
        raise error(f"fusegen: cannot create the cache directory {root}: {err.strerror}. "
                    "Set FUSEGEN_CACHE_DIR to a directory you can write.") from None
    if not root.is_dir():
        raise error(f"fusegen: the cache directory {root} is not a directory. Set "
                    "FUSEGEN_CACHE_DIR to a directory you own.")
    _check_private(root, "cache directory", f"chmod 700 {root}", error)
    return root


def _check_entry(library: Path, error: type[FusegenError]):
    """The cache directory, the entry and the library itself, before loading the library."""
    entry = library.parent
    _check_private(entry.parent, "cache directory", f"chmod 700 {entry.parent}", error)
    _check_private(entry, "cache entry", f"chmod 700 {entry} (or delete it: it is rebuilt)", error)
    _check_private(library, "cached library", f"chmod go-w {library} (or delete {entry}: it is "
                   "rebuilt)", error)


def cuda_enabled() -> bool:
    """Build the CUDA impls when torch sees a GPU and nvcc is there. FUSEGEN_CPU_ONLY=1
    forces the CPU-only build (the same generated files, without FUSEGEN_WITH_CUDA)."""
    if os.environ.get("FUSEGEN_CPU_ONLY") == "1":
        return False
    from torch.utils.cpp_extension import CUDA_HOME
    return torch.cuda.is_available() and CUDA_HOME is not None


@lru_cache(maxsize=None)
def _tool_version(*command: str) -> str:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "unavailable"
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def cuda_arch_flags() -> list[str]:
    """-gencode for every visible GPU's architecture (e.g. sm_90 on an H200), or for
    TORCH_CUDA_ARCH_LIST when set ("9.0;8.0")."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        archs = sorted({a.replace("+PTX", "").strip() for a in env.replace(",", ";").split(";") if a.strip()})
    else:
        archs = sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    flags = []
    for arch in archs:
        num = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


def build_flags(cuda: bool) -> dict[str, list[str]]:
    cflags = list(CXX_FLAGS) + (["-DFUSEGEN_WITH_CUDA"] if cuda else [])
    return {"cflags": cflags, "cuda_cflags": (NVCC_FLAGS + cuda_arch_flags()) if cuda else []}


def cache_key(ops: list[tuple[str, dict[str, str]]], cuda: bool) -> str:
    from torch.utils.cpp_extension import CUDA_HOME
    h = hashlib.sha256()
    parts = [
        FUSEGEN_VERSION, torch.__version__, str(torch.version.cuda), sys.version, sys.platform,
        _tool_version(os.environ.get("CXX", "c++"), "--version"),
        repr(build_flags(cuda)), str(cuda),
        _tool_version(os.path.join(CUDA_HOME, "bin", "nvcc"), "--version") if cuda else "",
    ]
    for part in parts:
        h.update(part.encode() + b"\0")
    for name, files in sorted(ops):
        h.update(name.encode() + b"\0")
        for fname in sorted(files):
            h.update(fname.encode() + b"\0" + files[fname].encode() + b"\0")
    return h.hexdigest()[:32]


@contextmanager
def _locked(path: Path):
    """An exclusive flock: the kernel drops it when the process dies, so it never goes stale."""
    path.parent.mkdir(exist_ok=True)  # not parents=True: a deleted cache is not recreated here
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _units(ops: list[tuple[str, dict[str, str]]], cuda: bool) -> dict[str, str]:
    """Translation units that #include the ops' sources, OPS_PER_UNIT ops each."""
    units = {}
    for start in range(0, len(ops), OPS_PER_UNIT):
        chunk = ops[start:start + OPS_PER_UNIT]
        index = start // OPS_PER_UNIT
        units[f"unit{index}.cpp"] = "".join(f'#include "{n}/{n}.cpp"\n' for n, _ in chunk)
        if cuda:
            units[f"unit{index}_kernels.cu"] = "".join(f'#include "{n}/{n}.cu"\n' for n, _ in chunk)
    return units


class _CacheDeleted(Exception):
    """The cache directory, or the build's temp folder in it, vanished during the build."""


def build(ops: list[tuple[str, dict[str, str]]], verbose: bool = False) -> Library:
    """Compile the ops into one shared library in the cache (or find it there). A cache
    deleted during the build is recreated and the build runs again, once."""
    cuda = cuda_enabled()
    key = cache_key(ops, cuda)
    for attempt in (1, 2):
        root = _cache_root(BuildError)
        try:
            return _build_in(root, ops, cuda, key, verbose)
        except _CacheDeleted:
            if attempt == 2:
                raise BuildError(f"fusegen: the cache directory {root} was deleted twice while "
                                 f"building op(s) {', '.join(n for n, _ in ops)}; stop whatever "
                                 "removes it, or set FUSEGEN_CACHE_DIR to another directory") from None
    raise AssertionError("unreachable")


def _build_in(root: Path, ops, cuda: bool, key: str, verbose: bool) -> Library:
    final = root / key
    lib = final / f"fusegen_{key}.so"
    if lib.is_file():
        return Library(lib, key, 0.0, True)
    start = time.perf_counter()
    try:
        with _locked(root / "locks" / f"{key}.lock"):
            if lib.is_file():  # another process built it while we waited
                return Library(lib, key, 0.0, True)
            start = time.perf_counter()  # the build, not the wait
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".build-{key[:12]}-"))
            try:
                _compile(ops, cuda, tmp, key, verbose)
                _seal(tmp / lib.name)
                if final.exists():  # a leftover from a crash between rename and now: replace it
                    shutil.rmtree(final)
                os.rename(tmp, final)
            except BaseException as err:
                vanished = not tmp.is_dir()
                shutil.rmtree(tmp, ignore_errors=True)
                if vanished and isinstance(err, (OSError, BuildError)):
                    raise _CacheDeleted from err
                raise
    except OSError as err:
        if root.is_dir():
            raise
        raise _CacheDeleted from err
    except _CacheDeleted:
        if key in _LOADED:
            # Built and loaded into this process; only publishing it failed. The ops work
            # here; the next process builds again.
            return Library(lib, key, time.perf_counter() - start, False)
        raise
    return Library(lib, key, time.perf_counter() - start, False)


def _seal(library: Path):
    """The linker honours the umask (0o775 under umask 002): make the library writable by
    its owner only, as the checks before loading require."""
    mode = stat.S_IMODE(os.stat(library).st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.chmod(library, mode & ~(stat.S_IWGRP | stat.S_IWOTH))


def _compile(ops, cuda: bool, tmp: Path, key: str, verbose: bool):
    from torch.utils import cpp_extension

    for name, files in ops:
        write(files, tmp / name)
    units = _units(ops, cuda)
    write(units, tmp)
    flags = build_flags(cuda)
    name = f"fusegen_{key}"
    sources = [str(tmp / u) for u in units]
    try:
        # cpp_extension writes the ninja file and runs it; the library it loads from `tmp`
        # is this process's copy (the rename keeps the same inode), so nothing loads twice.
        cpp_extension.load(
            name=name,
            sources=sources,
            extra_cflags=flags["cflags"],
            extra_cuda_cflags=flags["cuda_cflags"],
            build_directory=str(tmp),
            with_cuda=cuda,
            is_python_module=False,
            verbose=verbose,
        )
    except (RuntimeError, subprocess.CalledProcessError, OSError) as err:
        ninja = tmp / "build.ninja"
        log = str(err)
        if ninja.is_file():
            log += "\n--- build.ninja ---\n" + ninja.read_text()
        names = ", ".join(n for n, _ in ops)
        raise BuildError(f"fusegen: building op(s) {names} failed", log,
                         tuple(str(tmp / n / f) for n, files in ops for f in files)) from None
    _LOADED.add(key)
    # A second build of one name in a process (a retry after a failed or deleted build) is
    # named <name>_v1.so by cpp_extension's versioner; the cache entry holds <name>.so.
    if not (tmp / f"{name}.so").exists():
        for built in tmp.glob(f"{name}_v*.so"):
            os.rename(built, tmp / f"{name}.so")


# Libraries this process has loaded, by key: a library must never be loaded twice
# (its TORCH_LIBRARY_FRAGMENT would register the same ops again).
_LOADED: set[str] = set()


def load(library: Library):
    """Load a library from the cache, after checking that nobody else can have written it."""
    if library.key in _LOADED:
        return
    try:
        _check_entry(library.path, LoadError)
    except FileNotFoundError:
        raise LoadError(f"fusegen: the cache entry {library.path.parent} was deleted before it "
                        "could be loaded; run again to rebuild it") from None
    try:
        torch.ops.load_library(str(library.path))
    except (OSError, RuntimeError) as err:
        raise LoadError(f"fusegen: could not load {library.path}: {err}") from None
    _LOADED.add(library.key)

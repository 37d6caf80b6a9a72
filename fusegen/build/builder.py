"""The only place that touches the compiler and the cache.

Two kinds of library live in the cache. The shared runtime (templates/runtime/: argument
checks, promotion, broadcasting, allocation, the CPU loop, CUDA guard, Meta impl, autograd,
torch registration) includes the heavy torch headers; it is compiled once per
torch/CUDA/compiler version into `runtime-<key>/libfusegen_runtime_<key>.so`, from a few
translation units that compile in parallel. An op library holds one or more ops (tests
build a whole corpus into one); its sources include no torch header (only the runtime's
own headers, from `_runtime/` in its build folder), so it compiles in about a second, and
it links against the runtime (-l and an
rpath relative to its own folder, `$ORIGIN/../runtime-<key>`), whose key is part of the
op's key. The cache key (keys.py) names everything that changes the binary: the sources,
the flags, torch, CUDA, the compilers' real identities, the GPU architectures, fusegen's
version and the environment variables the compilers read. A build runs in a private temp
directory under an flock (released by the kernel if the process dies, so no stale locks;
a stuck holder is waited for a bounded time) and is published with one atomic rename; a
failed build leaves nothing behind. The entry records its library's size and sha256, and
every load checks them first: a corrupt entry is rebuilt, with a warning, never loaded.
No path from the cache reaches a command line as it is (_compiler_view): the cache may
live in a folder whose name holds spaces, quotes, `;` or `$`.

The cache holds shared libraries that are loaded into the process, so it must be private:
fusegen creates it 0700 and refuses to build in, or load from, a cache directory, entry or
library that another user owns or that group or others can write (the runtime's entry
as well as the op's). A cache deleted while a build runs is recreated and the build runs
again, once; both kinds of library are built by the one function that does this, `_cached`.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from fusegen.build import cache as _cache
from fusegen.build import keys as _keys
from fusegen.build.cache import cache_dir
from fusegen.build.toolchain import build_flags, cuda_compiler, cuda_enabled, libmvec
from fusegen.errors import BuildError, CompilerError, FusegenError, LoadError
from fusegen.files import RUNTIME_FOLDER, runtime_files, write, write_text
from fusegen.version import FUSEGEN_VERSION

# Build messages (INFO: building, built, waiting for another process's build) go to the
# "fusegen" logger. A first build takes seconds to a minute, so they show by default: the
# logger is at INFO and DEFAULT_HANDLER prints the build lines on stderr. Silence them with
# logging.getLogger("fusegen").setLevel(logging.WARNING) or FUSEGEN_QUIET=1; an application
# that configures logging (a handler on the root logger) gets them through its own
# handlers instead, once. The CLI replaces the handler with its progress line (or nothing,
# with --quiet).
QUIET_ENV = "FUSEGEN_QUIET"


class _BuildLines(logging.Handler):
    """`fusegen: building op(s) fma for CPU...` when a build starts, `fusegen: built op(s) fma
    in 21.3 s` when it ends (and why nothing happens while another process builds it), on
    the stderr of the moment. Cached loads log nothing, so they print nothing. Other INFO
    records of the logger (which derivative runs unfused) are left to logging's users."""

    def __init__(self):
        super().__init__(logging.INFO)

    def emit(self, record: logging.LogRecord):
        event = getattr(record, "fusegen_build", None)
        if event is None and record.levelno < logging.WARNING:
            return
        if logging.getLogger().handlers or os.environ.get(QUIET_ENV, "") not in ("", "0"):
            return  # the application's logging shows it (propagation), or it asked for quiet
        try:
            text = record.getMessage().removeprefix("fusegen: ")
            sys.stderr.write(f"fusegen: {text}{'...' if event == 'start' else ''}\n")
            sys.stderr.flush()
        except Exception:  # a closed stderr must not fail the build
            self.handleError(record)


log = logging.getLogger("fusegen")
DEFAULT_HANDLER = _BuildLines()
log.addHandler(DEFAULT_HANDLER)
if log.level == logging.NOTSET:  # a level the application set before importing fusegen stays
    log.setLevel(logging.INFO)

# The macros that compile only the forward or only the backward launchers of an op's .cu
# (templates/op_kernels.cu.j2), one nvcc run each, when a build has cores to spare.
SPLIT_MACROS = ("FUSEGEN_FORWARD_ONLY", "FUSEGEN_BACKWARD_ONLY")
# And, with four cores per .cu, each of those as two: fp32/fp64 and fp16/bf16 kernels; an
# op's own .cu as three where the cores allow six for it: fp32/fp64, fp16 and bf16 (its
# fp16/bf16 backward unit was a cold op's longest, 2.5 s on the CPU machine). An auxiliary
# op's .cu (`<name>_grad2`, `<name>_jvp`) has the contiguous and strided kernels only
# (Kernels::kPlain), and stays at two dtype units.
DTYPE_MACROS = (("FUSEGEN_WIDE_ONLY",), ("FUSEGEN_16BIT_ONLY",))
HALF_MACROS = (("FUSEGEN_WIDE_ONLY",), ("FUSEGEN_16BIT_ONLY", "FUSEGEN_FP16_ONLY"),
               ("FUSEGEN_16BIT_ONLY", "FUSEGEN_BF16_ONLY"))
# The NVRTC route's launch units are host code that runs once per call (layout tests and
# launch sizes): GCC compiles them at -O1, in three quarters of the time -O3 takes (0.55 s
# against 0.71 s for a backward's fp32/fp64 launchers on the CPU machine).
RTC_HOST_PRELUDE = '#if defined(__GNUC__) && !defined(__clang__)\n#pragma GCC optimize("O1")\n#endif\n'
# C++ sources per translation unit: an op's .cpp compiles in about 0.3 s, mostly headers, so
# a few share one unit (a batch of ops; a new op's auxiliary ops, built on first use).
CPP_PER_UNIT = 6
# The runtime's translation units (templates/runtime/*.cpp), compiled in parallel: each
# includes only the torch headers of its own concern.
RUNTIME_UNITS = ("fusegen-autograd.cpp", "fusegen-layout.cpp", "fusegen-registration.cpp", "fusegen-rtc.cpp",
                 "fusegen-step.cpp", "fusegen-launch.cpp")
# The NVRTC route's launchers of elementwise ops (fusegen-launch.cpp, host code at -O1, empty
# without CUDA): about 19 s of the host compiler in all, so a CUDA build compiles it as one
# unit per part (FUSEGEN_LAUNCH_PART: the dispatcher, then one per storage type), beside the
# others and never in the shared unit.
RUNTIME_LAUNCH_UNIT = "fusegen-launch.cpp"
RUNTIME_LAUNCH_PARTS = 5
# With fewer cores than units, the runtime's torch headers dominate: about 3 s of every
# unit's 5-7 s is ATen's Tensor and the dispatcher's stack. There every unit but the
# longest (autograd, 13 s alone) shares one (RUNTIME_SHARED_UNIT), which parses them once:
# on the 2-core CPU machine the runtime took 15.2 s instead of 19.4 s. With a core per
# unit, each is its own and the longest sets the time.
RUNTIME_SPLIT_CORES = 4
RUNTIME_SHARED_UNIT = "fusegen-runtime-shared.cpp"
LINK_FLAGS = "fusegen-link.rsp"  # an op library's link flags for the runtime (see _compile)


@dataclass(frozen=True)
class Library:
    path: Path          # the shared library in the cache
    key: str
    seconds: float      # time spent building (0.0 on a cache hit)
    cached: bool
    runtime: Path | None = None  # an op library: the runtime library it links against


def _check_private(path: Path, what: str, fix: str, error: type[FusegenError], root_ok: bool = False):
    """Raise `error` unless `path` is owned by this user (or, `root_ok`, by root: an
    installed runtime) and not writable by group or others: whoever can write there can put
    code into every process that loads from the cache."""
    st = os.stat(path)
    me = os.geteuid()
    if st.st_uid != me and not (root_ok and st.st_uid == 0):
        raise error(f"fusegen: refusing to use the {what} {path}: it is owned by uid {st.st_uid}, "
                    f"not by you (uid {me}), and fusegen loads the libraries in it into this "
                    f"process. Set FUSEGEN_CACHE_DIR to a directory you own.")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise error(f"fusegen: refusing to use the {what} {path}: group or others can write to it "
                    f"(mode {stat.S_IMODE(st.st_mode):o}), and fusegen loads the libraries in it "
                    f"into this process. Fix: {fix}, or set FUSEGEN_CACHE_DIR to a directory "
                    f"only you can write.")


def _cache_root(error: type[FusegenError]) -> Path:
    """The cache directory, created 0700 when missing, checked private and fusegen's own
    (its marker, see cache.adopt) when it exists."""
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
    _cache.adopt(root, error)
    return root


def _check_entry(library: Path, error: type[FusegenError]):
    """The cache directory, the entry and the library itself, before loading the library
    (an installed runtime's may be root's)."""
    entry = library.parent
    root_ok = entry.parent == installed_dir()
    _check_private(entry.parent, "cache directory", f"chmod 700 {entry.parent}", error, root_ok)
    _check_private(entry, "cache entry", f"chmod 700 {entry} (or delete it: it is rebuilt)", error, root_ok)
    _check_private(library, "cached library", f"chmod go-w {library} (or delete {entry}: it is "
                   "rebuilt)", error, root_ok)


def installed_dir() -> Path:
    """Where `fusegen setup` builds the shared runtime once, at install time: beside the
    package (`fusegen/_installed/`), or $FUSEGEN_RUNTIME_DIR. The first op in an empty cache
    then builds the op alone."""
    where = os.environ.get("FUSEGEN_RUNTIME_DIR")
    return Path(os.path.abspath(where)) if where else Path(__file__).resolve().parent.parent / "_installed"


def _installed_runtime(key: str, folder: str, filename: str) -> Library | None:
    """The runtime `fusegen setup` built for this key, when it is there whole and nobody
    but its owner (this user or root) can have written it; else None (the cache's then)."""
    lib = installed_dir() / folder / filename
    if not _PLAIN_PATH.fullmatch(str(lib.parent)) or not _intact(lib):
        return None  # an op links against its folder by a plain path (the link's response file)
    try:
        _check_entry(lib, LoadError)
    except (LoadError, OSError) as err:
        log.warning("%s; building the runtime in the cache instead", err)
        return None
    return Library(lib, key, 0.0, True)


def published_runtime(key: str) -> Path | None:
    """The runtime of `key` that op libraries load against, as runtime_library() finds it
    without building: the installed one, else the cache's, when it is there whole; else None."""
    folder, filename = f"runtime-{key}", f"libfusegen_runtime_{key}.so"
    installed = _installed_runtime(key, folder, filename)
    if installed is not None:
        return installed.path
    lib = cache_dir() / folder / filename
    return lib if _cache.verify(lib) is None else None


def install_runtime(verbose: bool = False) -> Library:
    """Build the shared runtime for this torch/CUDA/compiler into installed_dir() (`fusegen
    setup`), or find it there."""
    cuda = cuda_enabled()
    key = runtime_key(cuda)
    root = installed_dir()
    try:
        root.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as err:
        raise BuildError(f"fusegen: cannot create {root} for the runtime: {err.strerror}. Set "
                         "FUSEGEN_RUNTIME_DIR to a directory you can write.") from None
    _check_private(root, "runtime directory", f"chmod go-w {root}", BuildError)
    _cache.adopt(root, BuildError)
    return _build_in(root, key, f"runtime-{key}", f"libfusegen_runtime_{key}.so",
                     _runtime_compile(cuda, key, verbose), "the fusegen runtime", _Meta("runtime", (), cuda))


def runtime_sources() -> dict[str, str]:
    """The shared runtime's sources (templates/runtime/), as written to generated/_runtime/."""
    return runtime_files()


def runtime_key(cuda: bool) -> str:
    return _keys.runtime_key(cuda, runtime_sources())


def cache_key(ops: list[tuple[str, dict[str, str]]], cuda: bool, cpu_later: bool = False) -> str:
    return _keys.cache_key(ops, cuda, runtime_key(cuda) + (CPU_LATER_MARK if cpu_later else ""))


def cpu_later(cuda: bool) -> bool:
    """Whether an op's library leaves its CPU kernels for later (OpDef::cpu_later): on the
    NVRTC route with CUDA, where a new op's build is then its descriptor alone (about 0.12 s
    of host compiler instead of 0.5-0.7 s); its first CPU call builds the op whole
    (load_cpu_kernels)."""
    return cuda and cuda_compiler() != "nvcc"


def _defers_cpu(ops: list[tuple[str, dict[str, str]]], cuda: bool) -> bool:
    """Whether a library of `ops` leaves their CPU kernels for later: every op can."""
    return cpu_later(cuda) and all(LAUNCHED_MARK in files[f] for _, files in ops for f in _own(files, ".cpp"))


_locked = _cache.build_lock  # taken by builds; `fusegen cache` takes it without waiting


def _own(files: dict[str, str], suffix: str) -> list[str]:
    """An op's own translation units of one kind: `<name>.cpp` and its auxiliary ops'
    (`<name>_grad2.cpp`, `<name>_jvp.cpp`)."""
    return [f for f in files if f.endswith(suffix)]


def _units(ops: list[tuple[str, dict[str, str]]], cuda: bool, later: bool = False) -> dict[str, str]:
    """Translation units that #include the ops' sources: CPP_PER_UNIT .cpp files each, and
    the .cu files spread over as many units as there are cores (nvcc is the long pole of a
    CUDA build: the .cu files of a batch then compile in parallel); with at least two cores
    per .cu, each .cu's forward and backward kernels are two units (SPLIT_MACROS), with
    four, each of those two again, by dtype (DTYPE_MACROS), and an op's own .cu by three
    dtype groups where that leaves a core per unit (HALF_MACROS)."""
    def chunks(paths: list[str], size: int) -> list[list[str]]:
        return [paths[i:i + size] for i in range(0, len(paths), size)]

    def include(paths: list[str]) -> str:
        return "".join(f'#include "{p}"\n' for p in paths)

    units = {}
    rtc = cuda and cuda_compiler() != "nvcc"
    # On the NVRTC route an op whose .cpp runs its kernels through the runtime's launchers
    # (run_launched, fusegen-launch.cpp) has no launch unit: its .cpp names its .cu
    # (FUSEGEN_RTC_FILE), from which the runtime compiles the kernels.
    launched = {f"{n}/{f}" for n, files in ops for f in _own(files, ".cpp")
                if rtc and LAUNCHED_MARK in files[f]}
    cpp = [f"{n}/{f}" for n, files in ops for f in _own(files, ".cpp")]
    for index, chunk in enumerate(chunks(cpp, CPP_PER_UNIT)):
        text = "".join(_rtc_file(p[:-len(".cpp")] + ".cu", include([p])) if p in launched
                       else include([p]) for p in chunk)
        # `later`: the CPU kernels are left to the ops built whole (_defers_cpu).
        units[f"unit{index}.cpp"] = "#define FUSEGEN_CPU_LATER\n" + text if later else text
    if not cuda:
        return units
    # Each unit of .cu files: (the paths it includes, the macros that select its part).
    parts: list[tuple[list[str], tuple[str, ...]]] = []
    cu = [(f"{n}/{f}", files[f]) for n, files in ops for f in _own(files, ".cu")
          if f"{n}/{f[:-len('.cu')]}.cpp" not in launched]
    cores = os.cpu_count() or 1
    if 2 * len(cu) <= cores:
        # Cores to spare (a new op on the GPU machine): each .cu that has a backward is
        # compiled twice, forward kernels and backward kernels, in parallel, which cuts
        # the longest nvcc run by about a third (op_kernels.cu.j2).
        # With four cores per .cu each of those is two again, by dtype (DTYPE_MACROS):
        # the longest unit of a cold op went from 2.9 to 1.9 s of nvcc (2-core CPU machine).
        own = {f"{n}/{n}.cu" for n, _ in ops}  # an op's own .cu, beside its auxiliary ops
        by_dtype = 4 * len(cu) <= cores
        by_half = by_dtype and 2 * len(own) + 4 * len(cu) <= cores
        for path, text in cu:
            directions = SPLIT_MACROS if f"#ifndef {SPLIT_MACROS[0]}" in text else (None,)
            groups = ((),)
            if by_dtype and DTYPE_MACROS[1][0] in text:
                groups = HALF_MACROS if by_half and path in own and HALF_MACROS[1][1] in text else DTYPE_MACROS
            for direction, group in itertools.product(directions, groups):
                parts.append(([path], ((direction,) if direction else ()) + group))
    else:
        paths = [path for path, _ in cu]
        per_unit = -(-len(paths) // max(1, min(len(paths), cores)))
        parts += [(chunk, ()) for chunk in chunks(paths, per_unit)]
    if cuda_compiler() == "nvcc":
        for index, (paths, macros) in enumerate(parts):
            units[f"unit{index}_kernels.cu"] = "".join(f"#define {m}\n" for m in macros) + include(paths)
        return units
    # The NVRTC route: the same parts, compiled by the host compiler as the launchers alone
    # (FUSEGEN_RTC_HOST); the first unit of each .cu also defines its rtc_source(), the
    # file's path in the library's folder (names.py allows only [A-Za-z0-9_] in an op name).
    defined = set()
    for index, (paths, macros) in enumerate(parts):
        text = RTC_HOST_PRELUDE + "".join(f"#define {m}\n" for m in ("FUSEGEN_RTC_HOST",) + macros)
        for path in paths:
            if path in defined:
                text += include([path])
                continue
            defined.add(path)
            text += _rtc_file(path, include([path]))
        units[f"unit{index}_launch.cpp"] = text
    return units


# Ops loaded from a library that left their CPU kernels for later: name -> the sources of
# that library's ops (its build's, or those in its entry).
_CPU_LATER: dict[str, object] = {}
_CPU_LATER_LOCK = threading.Lock()


def _later(names, sources):
    with _CPU_LATER_LOCK:
        for name in names:
            _CPU_LATER.setdefault(name, sources)


def _entry_sources(entry: Path) -> list[tuple[str, dict[str, str]]]:
    """The ops of an op library's entry with their files, as its build wrote them."""
    return [(n, {f.name: f.read_text() for f in sorted((entry / n).iterdir()) if f.is_file()})
            for n in _cache.entry_ops(entry)]


def load_cpu_kernels(name: str):
    """The CPU kernels of op `name`, whose library left them for later, on its first CPU
    call (the runtime asks through fusegen::__cpu_kernels, cpu_kernels_of): the ops of that
    library built whole and loaded; their register_op hands the runtime their CPU kernels.
    Nothing for an op that has them."""
    with _CPU_LATER_LOCK:
        sources = _CPU_LATER.get(name)
        if sources is None:
            return
        try:
            ops = sources()
        except OSError:
            ops = []
        if not ops:  # the entry went (fusegen cache clear) after the library loaded
            raise LoadError(f"fusegen: the CPU kernels of {name} are built from the sources in its cache "
                            "entry, which cannot be read (removed since it was loaded?); run "
                            "fusegen.fuse again in a new process to rebuild it")
        load(build(ops, whole=True))
        for n, _ in ops:
            _CPU_LATER.pop(n, None)


# What an op's .cpp holds when the runtime's launchers run its kernels (op.cpp.j2); such an
# op can leave its CPU kernels for later (FUSEGEN_CPU_LATER).
LAUNCHED_MARK = "run_launched("
# An op library's entry that left its ops' CPU kernels for later (a file in it), and the
# part of its key that says so.
CPU_LATER_MARK = "cpu-later"


def _rtc_file(path: str, text: str) -> str:
    """`text` (an #include) with FUSEGEN_RTC_FILE defined as the kernel source's path in the
    library's folder (names.py allows only [A-Za-z0-9_] in an op name)."""
    if not _PLAIN_PATH.fullmatch(path):
        raise BuildError(f"fusegen: a kernel source's path {path!r} holds characters a C string "
                         "cannot take as they are")
    return f'#define FUSEGEN_RTC_FILE "{path}"\n' + text + "#undef FUSEGEN_RTC_FILE\n"


@contextmanager
def _pinned(entry: Path):
    """A shared flock on an entry's folder while a build depends on its files (an op build
    links against the runtime's library): `fusegen cache` takes it exclusively, without
    waiting, before it removes the entry, and keeps the entry while it is pinned. The folder
    itself, not its lock file, so that pinning creates nothing. A folder already gone
    pins nothing: the caller checks the file it needs after pinning."""
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # drops the lock


class _CacheDeleted(Exception):
    """The cache directory, or the build's temp folder in it, vanished during the build."""


@dataclass(frozen=True)
class _Meta:
    """What entry.json records of a library, and what the progress line says."""
    kind: str                  # "op" or "runtime"
    ops: tuple[str, ...]
    cuda: bool

    def targets(self) -> str:
        return "CPU+CUDA" if self.cuda else "CPU"


def _cached(key: str, folder: str, filename: str, compile_into, what: str, meta: _Meta) -> Library:
    """The library `folder/filename` of the cache, built by `compile_into(tmp)` under an
    flock in a private temp folder and published by one atomic rename when missing (the
    runtime and op libraries alike). A cache deleted during the build is recreated and the
    build runs again. Three attempts, not two: an `rm -rf` of the cache is not atomic, so the
    build that lost its folder can retry while the removal is still under way and lose the
    new folder as well; a third loss means something keeps deleting it."""
    for attempt in (1, 2, 3):
        root = _cache_root(BuildError)
        try:
            return _build_in(root, key, folder, filename, compile_into, what, meta)
        except _CacheDeleted:
            if attempt == 3:
                raise BuildError(f"fusegen: the cache directory {root} was deleted three times while "
                                 f"building {what}; stop whatever removes it, or set "
                                 "FUSEGEN_CACHE_DIR to another directory") from None
            log.info("the cache %s was deleted while building %s; building again", root, what)
    raise AssertionError("unreachable")


def _build_in(root: Path, key: str, folder: str, filename: str, compile_into, what: str,
              meta: _Meta) -> Library:
    final = root / folder
    lib = final / filename
    if _intact(lib):
        _cache.mark_used(final)
        return Library(lib, key, 0.0, True)
    start = time.perf_counter()
    try:
        with _locked(_cache.lock_path(root, folder), what):
            if _intact(lib, warn=True):  # another process built it while we waited
                _cache.mark_used(final)
                return Library(lib, key, 0.0, True)
            _clean_stale(root)
            log.info("building %s for %s", what, meta.targets(), extra={"fusegen_build": "start"})
            start = time.perf_counter()  # the build, not the wait
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".build-{folder[:20]}-"))
            try:
                # First thing in the folder: the lock that guards it, for `fusegen cache`'s
                # stale-folder cleanup (a SIGKILLed build leaves the folder; its lock is freed).
                _cache.write_owner(tmp, folder, what)
                compile_into(tmp)
                _seal(tmp / filename)
                os.unlink(tmp / _cache.OWNER_FILE)
                _cache.write_entry_json(tmp, meta.kind, list(meta.ops), meta.cuda, FUSEGEN_VERSION,
                                        torch.__version__, filename)
                _cache.publish(root, tmp, final)  # replaces a corrupt entry, or a crash's leftover
            except BaseException as err:
                vanished = not tmp.is_dir()
                shutil.rmtree(tmp, ignore_errors=True)
                outcome = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
                log.info("building %s %s after %.1f s", what, outcome, time.perf_counter() - start,
                         extra={"fusegen_build": outcome})
                if vanished and isinstance(err, (OSError, BuildError)):
                    raise _CacheDeleted from err
                raise
    except OSError as err:
        if not root.is_dir():
            raise _CacheDeleted from err
        raise _unwritable(root, what, err) from None
    except _CacheDeleted:
        if key in _LOADED:
            # An op library built and loaded into this process; only publishing it failed.
            # The ops work here; the next process builds again. (The runtime is never in
            # _LOADED: op libraries link against its file, so a lost runtime is rebuilt.)
            return Library(lib, key, time.perf_counter() - start, False)
        raise
    seconds = time.perf_counter() - start
    log.info("built %s in %.1f s", what, seconds, extra={"fusegen_build": "done"})
    return Library(lib, key, seconds, False)


def _intact(lib: Path, warn: bool = False) -> bool:
    """A cache hit: the library is there and is the one published (cache.verify). A
    corrupt one (truncated, overwritten, patched) is reported once, under the lock, and
    rebuilt; an entry without the record (from before it) is rebuilt as well."""
    if not lib.is_file():
        return False
    why = _cache.verify(lib)
    if why is None:
        return True
    if warn:
        log.warning("fusegen: warning: the cache entry %s is corrupt (%s); rebuilding it", lib.parent, why)
    return False


def _unwritable(root: Path, what: str, err: OSError) -> BuildError:
    """A build that cannot write in the cache: which folder, and what still works."""
    where = Path(err.filename) if err.filename else root
    folder = where if where.is_dir() else where.parent
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return BuildError(f"fusegen: cannot build {what}: the cache folder {folder} is read-only "
                          f"({err.strerror}: {where}). A read-only cache still loads the libraries it "
                          "holds; to build, make it writable or set FUSEGEN_CACHE_DIR to a directory "
                          "you can write")
    return BuildError(f"fusegen: cannot build {what} in the cache {root}: {err.strerror or err}: {where}")


def _clean_stale(root: Path):
    """Opportunistic, before a build: remove temp folders of killed builds (one listdir when
    there are none). Their locks are taken without waiting, so a live build's folder stays."""
    try:
        for temp in _cache.clean_stale(root):
            log.info("removed the temp folder of a killed build: %s", temp.path)
    except OSError:
        pass  # cleanup is a courtesy; the build does not depend on it


def _seal(library: Path):
    """The linker honours the umask (0o775 under umask 002): make the library writable by
    its owner only, as the checks before loading require."""
    mode = stat.S_IMODE(os.stat(library).st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.chmod(library, mode & ~(stat.S_IWGRP | stat.S_IWOTH))


def runtime_library(verbose: bool = False) -> Library:
    """The shared runtime for this torch/CUDA/compiler: the one `fusegen setup` installed,
    or built once into the cache."""
    cuda = cuda_enabled()
    key = runtime_key(cuda)
    name = f"libfusegen_runtime_{key}"
    installed = _installed_runtime(key, f"runtime-{key}", f"{name}.so")
    if installed is not None:
        return installed
    return _cached(key, f"runtime-{key}", f"{name}.so", _runtime_compile(cuda, key, verbose),
                   "the fusegen runtime (once per torch version)", _Meta("runtime", (), cuda))


def _runtime_compile(cuda: bool, key: str, verbose: bool):
    """The runtime's build into a temp folder (for _build_in)."""
    name = f"libfusegen_runtime_{key}"

    def compile_into(tmp: Path):
        write(runtime_sources(), tmp)
        units = _runtime_units(os.cpu_count() or 1, cuda)
        write({u: text for u, text in units.items() if text is not None}, tmp)
        flags = build_flags(cuda)
        # The soname is what op libraries record (DT_NEEDED): the dynamic loader then finds
        # the copy already loaded, and the runtime is loaded once per process.
        _cpp_extension(name, list(units), flags["cflags"], [], [f"-Wl,-soname,{name}.so"],
                       tmp, cuda, verbose, "the fusegen runtime", [str(tmp / f) for f in runtime_sources()])

    return compile_into


def _runtime_units(cores: int, cuda: bool = False) -> dict[str, str | None]:
    """The runtime's translation units for a machine of `cores`: unit -> its text, or None
    for a source compiled as it is (RUNTIME_SPLIT_CORES); with CUDA, the launchers' parts
    (RUNTIME_LAUNCH_PARTS)."""
    units = [u for u in RUNTIME_UNITS if not (cuda and u == RUNTIME_LAUNCH_UNIT)]
    if cores >= RUNTIME_SPLIT_CORES:
        found: dict[str, str | None] = dict.fromkeys(units)
    else:
        longest, *rest = units
        found = {longest: None, RUNTIME_SHARED_UNIT: "".join(f'#include "{u}"\n' for u in rest)}
    if cuda:
        for part in range(RUNTIME_LAUNCH_PARTS):
            found[f"fusegen-launch-{part}.cpp"] = \
                f'#define FUSEGEN_LAUNCH_PART {part}\n#include "{RUNTIME_LAUNCH_UNIT}"\n'
    return found


def _runtime_function(name: str, restype, argtypes):
    """One of the runtime's C entry points (fusegen-rtc.cpp), from the copy loaded already."""
    import ctypes
    function = getattr(ctypes.CDLL(str(runtime_library().path)), name)
    function.restype, function.argtypes = restype, argtypes
    return function


def load_errors(loaded: Path) -> list[str]:
    """The registrations that failed in the libraries loaded since the last call
    (templates/runtime/fusegen-registration.cpp, fusegen_load_errors), one per line, asked
    of the runtime through `loaded`, an op library loaded by that very path string (dlopen
    then finds the loaded copy by its name and reads no file: the file may have changed
    since)."""
    import ctypes
    try:
        errors = ctypes.CDLL(str(loaded)).fusegen_load_errors
    except (OSError, AttributeError):
        return []  # a runtime without the entry point cannot have kept an error
    errors.restype, errors.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]
    size = errors(None, 0) + 1
    text = ctypes.create_string_buffer(size)
    errors(text, size)
    return text.value.decode().splitlines()


def rtc_events() -> list[str]:
    """What the NVRTC route did in this process (templates/runtime/fusegen-rtc.cpp), one
    entry per kernel in order: "compiled <kernel>", or "loaded <kernel>" from its cubin in
    the cache. Empty in a build without CUDA."""
    if not cuda_enabled():
        return []
    import ctypes
    events = _runtime_function("fusegen_rtc_events", ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t])
    size = events(None, 0) + 1
    text = ctypes.create_string_buffer(size)
    events(text, size)
    return text.value.decode().splitlines()


def build(ops: list[tuple[str, dict[str, str]]], verbose: bool = False, whole: bool = False) -> Library:
    """Compile the ops into one shared library in the cache (or find it there). A cache
    deleted during the build is recreated and the build runs again, once. `whole`: with
    their CPU kernels even where a library may leave them for later (_defers_cpu)."""
    cuda = cuda_enabled()
    later = not whole and _defers_cpu(ops, cuda)
    key = cache_key(ops, cuda, later)
    # Also for a cached op: its library needs the runtime's (found through its rpath), which
    # a trimmed cache may have lost. A cache hit costs one stat.
    runtime = [runtime_library(verbose)]

    def compile_into(tmp: Path):
        # Again inside the op's build: a cache deleted since (and recreated for this retry)
        # has lost the runtime too, and the op links against its file. Pinned while the op
        # compiles and links, so that `fusegen cache trim/clear` in another process cannot
        # remove it under the linker; removed between the check and the pin: build it again.
        for _ in range(3):
            runtime[0] = runtime_library(verbose)
            with _pinned(runtime[0].path.parent):
                if runtime[0].path.is_file():
                    _compile(ops, cuda, tmp, key, verbose, runtime[0], later)
                    return
        raise BuildError(f"fusegen: the shared runtime {runtime[0].path.parent} was removed three times "
                         "while an op was being built; stop whatever removes it")

    lib = _cached(key, key, f"fusegen_{key}.so", compile_into, "op(s) " + ", ".join(n for n, _ in ops),
                  _Meta("op", tuple(n for n, _ in ops), cuda))
    _published(key, lib.path.parent)
    return Library(lib.path, lib.key, lib.seconds, lib.cached, runtime[0].path)


# What a path handed to the compiler may hold. cpp_extension writes the sources' paths into
# build.ninja as they are, where `$`, `:` and spaces are ninja's syntax, and ninja runs each
# command through /bin/sh, where quotes, `;`, `$` and spaces are the shell's.
_PLAIN_PATH = re.compile(r"[A-Za-z0-9_./+-]+")
# A flag in fusegen's own ninja file: a plain path, or a flag like -DNAME=1 or @file.rsp.
_PLAIN_FLAG = re.compile(r"[A-Za-z0-9_./+=@,-]+")


@contextmanager
def _compiler_view(tmp: Path):
    """The path under which the compilers see the build folder `tmp`: `tmp` itself when its
    path is plain, else a symlink to it, `fusegen-build-XXXX/build` in a plain temp folder
    (private: mkdtemp makes it 0700, so nobody else can change where the link points). So
    no path from the cache reaches a command line, whatever FUSEGEN_CACHE_DIR holds. The
    link-time paths are relative (see _compile), so the library does not depend on it."""
    if _PLAIN_PATH.fullmatch(str(tmp)):
        yield tmp
        return
    for base in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"):
        if _PLAIN_PATH.fullmatch(base) and os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            break
    else:
        raise BuildError(f"fusegen: the cache path {tmp.parent} holds characters a build command cannot "
                         "take as they are, and there is no temp folder with a plain path (letters, "
                         "digits, ._+-/) to build through; set TMPDIR to one, or FUSEGEN_CACHE_DIR to a "
                         "plain path")
    farm = Path(tempfile.mkdtemp(prefix="fusegen-build-", dir=base))
    link = farm / "build"
    try:
        os.symlink(tmp, link, target_is_directory=True)
        yield link
    finally:
        for remove in (lambda: os.unlink(link), lambda: os.rmdir(farm)):  # the link, never its target
            try:
                remove()
            except OSError:
                pass


# The C++ of an op's own sources, which include no torch header (test_generated_code holds
# them to it): an op library of host code alone is compiled by fusegen's own ninja file
# (_host_load) with this standard, whatever torch's is.
OP_CXX_STD = "-std=c++17"


def _ninja_words(command: str) -> str:
    """A command for a ninja rule, run by /bin/sh: each word quoted for the shell, then `$`
    escaped for ninja."""
    return " ".join(shlex.quote(w) for w in shlex.split(command)).replace("$", "$$")


def _host_load(name: str, sources: list[str], build_directory: str, extra_cflags: list[str],
               extra_ldflags: list[str], extra_include_paths: list[str], verbose: bool = False, **_):
    """An op library of host code alone (its kernels come from NVRTC, or it is built for the
    CPU), compiled and loaded as cpp_extension.load would, by a ninja file of fusegen's own:
    the sources include no torch header, so the library links against the runtime alone,
    not torch's and CUDA's libraries (0.15 s of a new op's link on the GPU machine), and
    importing cpp_extension (setuptools, about 0.1 s) is left out. Raises RuntimeError with
    the compilers' output, as cpp_extension does."""
    folder = Path(build_directory)
    rel = [os.path.relpath(s, folder) for s in sources]
    include = [os.path.relpath(i, folder) for i in extra_include_paths]
    flags = ["-fPIC", OP_CXX_STD, *extra_cflags, *(f"-I{i}" for i in include)]
    for text in rel + flags + extra_ldflags:  # plain already (_compiler_view, build_flags)
        if not _PLAIN_FLAG.fullmatch(text):
            raise BuildError(f"fusegen: a build argument {text!r} holds characters a ninja file cannot take")
    objects = [r.rsplit(".", 1)[0] + ".o" for r in rel]
    lines = ["ninja_required_version = 1.3",
             f"cxx = {_ninja_words(os.environ.get('CXX') or 'c++')}",
             f"cflags = {' '.join(flags)}",
             f"ldflags = -shared {' '.join(extra_ldflags)}",
             "rule compile",
             "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
             "  depfile = $out.d",
             "  deps = gcc",
             "rule link",
             "  command = $cxx $in $ldflags -o $out",
             *(f"build {o}: compile {r}" for o, r in zip(objects, rel)),
             f"build {name}.so: link {' '.join(objects)}",
             f"default {name}.so", ""]
    write_text(folder / "build.ninja", "\n".join(lines))
    ninja = shutil.which("ninja")
    if ninja is None:
        raise BuildError("fusegen: ninja is not on the PATH; pip install ninja")
    jobs = os.environ.get("MAX_JOBS", "")
    command = [ninja, "-C", str(folder)] + (["-j", jobs] if jobs.isdigit() else []) + (["-v"] if verbose else [])
    run = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if verbose:
        sys.stderr.write(run.stdout)
    if run.returncode != 0:
        raise RuntimeError(f"Error building extension '{name}': {run.stdout}")
    torch.ops.load_library(str(folder / f"{name}.so"))


def _cpp_extension(name, sources, cflags, cuda_cflags, ldflags, tmp: Path, cuda: bool, verbose: bool,
                   what: str, files, include: tuple[str, ...] = (), host_only: bool = False):
    """Compile `sources` (paths relative to the build folder `tmp`, as are the `include`
    folders) into `tmp/<name>.so`: by cpp_extension, or, `host_only` (an op library without
    CUDA sources), by _host_load."""
    if host_only:
        load = _host_load
    else:
        from torch.utils import cpp_extension
        load = cpp_extension.load
    with _compiler_view(tmp) as view:
        try:
            # The ninja file written and run (the C++ and CUDA compilers in parallel); the
            # library loaded from `view` is this process's copy (the rename keeps the same
            # inode), so nothing loads twice.
            load(
                name=name,
                sources=[str(view / s) for s in sources],
                extra_cflags=cflags,
                extra_cuda_cflags=cuda_cflags,
                extra_ldflags=ldflags,
                extra_include_paths=[str(view / i) for i in include],
                build_directory=str(view),
                with_cuda=cuda,
                is_python_module=False,
                verbose=verbose,
            )
        except (RuntimeError, subprocess.CalledProcessError, OSError) as err:
            log_text = str(err) if view == tmp else str(err).replace(str(view), str(tmp))
            if not tmp.is_dir():  # the cache was deleted under the build: _build_in retries
                raise BuildError(f"fusegen: building {what} failed", log_text, tuple(files)) from None
            raise _failed_build(tmp, what, log_text, files) from None
    # A second build of one name in a process (a retry after a failed or deleted build) is
    # named <name>_v1.so by cpp_extension's versioner; the cache entry holds <name>.so, for
    # the runtime (libfusegen_runtime_<key>) as for an op library (fusegen_<key>).
    if not (tmp / f"{name}.so").exists():
        for built in tmp.glob(f"{name}_v*.so"):
            os.rename(built, tmp / f"{name}.so")
    # The folder the library was loaded from: torch.ops.load_library resolves the path, so
    # the dynamic loader knows it by the build folder's real path, not by `view`.
    return os.path.realpath(tmp)


def _compile(ops, cuda: bool, tmp: Path, key: str, verbose: bool, runtime: Library, later: bool = False):
    for name, files in ops:
        write(files, tmp / name)
    # The runtime's headers, which the ops' sources include (-I_runtime), as in generated/.
    write({f: text for f, text in runtime_sources().items() if not f.endswith(".cpp")}, tmp / RUNTIME_FOLDER)
    units = _units(ops, cuda, later)
    write(units, tmp)
    if later:
        write_text(tmp / CPU_LATER_MARK, "the CPU kernels: the library of these ops built whole\n")
    flags = build_flags(cuda)
    # The runtime by relative paths, never the cache's own: the linker runs in the build
    # folder, beside the runtime's entry (-L../runtime-<key>), and the loader finds the
    # runtime beside the op's entry ($ORIGIN/../runtime-<key>), wherever the cache is, even
    # moved. In a response file (gcc and clang read it themselves), because `$ORIGIN`
    # written among the flags would be expanded by ninja and again by the shell.
    folder = runtime.path.parent.name
    installed = "" if runtime.path.parent.parent == tmp.parent else str(runtime.path.parent)
    # The installed runtime (fusegen setup) by its absolute path (a plain one: _installed_runtime)
    # and the cache's copy after it, where it is found once the installed one is gone.
    write_text(tmp / LINK_FLAGS, (f"-L{installed}\n-Wl,-rpath,{installed}\n" if installed else f"-L../{folder}\n")
               + f"-l{runtime.path.stem[3:]}\n-Wl,-rpath,$ORIGIN/../{folder}\n")
    ldflags = [f"@{LINK_FLAGS}"] + (["-lmvec"] if libmvec() else [])
    names = ", ".join(n for n, _ in ops)
    if later:
        _later([n for n, _ in ops], lambda: ops)
    _LOADED_FROM[key] = _cpp_extension(f"fusegen_{key}", list(units), flags["cflags"], flags["cuda_cflags"], ldflags,
                   tmp, any(u.endswith(".cu") for u in units), verbose, f"op(s) {names}",
                   [str(tmp / n / f) for n, files in ops for f in files], (RUNTIME_FOLDER,),
                   host_only=not any(u.endswith(".cu") for u in units))
    _LOADED.add(key)


# Libraries this process has loaded, by key: a library must never be loaded twice
# (its static initializers would call fusegen::register_op and define the same ops again).
_LOADED: set[str] = set()
# The build folder an op library was loaded from when this process built it (the entry's
# name once published): the NVRTC route finds an op's kernel sources beside its library.
_LOADED_FROM: dict[str, str] = {}
# Called after each op library a cached load brings in: fusegen/pytorch/autograd.py adds
# the registration of auxiliary ops an earlier process built into it (the build stage
# imports no later stage).
AFTER_LOAD: list[Callable[[], None]] = []


def _published(key: str, entry: Path):
    """Tells the runtime's NVRTC route (fusegen-rtc.cpp) that the library this process built
    and loaded from its build folder now lives in `entry`, where its kernel sources are."""
    built_in = _LOADED_FROM.pop(key, None)
    if built_in is None or not cuda_enabled():
        return
    import ctypes
    moved = _runtime_function("fusegen_rtc_moved", None, [ctypes.c_char_p, ctypes.c_char_p])
    moved(os.fsencode(built_in), os.fsencode(str(entry)))


def load(library: Library):
    """Load a library from the cache, after checking that nobody else can have written it
    and that it is the library published (its size and sha256: a truncated library would
    crash the process)."""
    if library.key in _LOADED:
        return
    # The op library and the runtime it pulls in (DT_NEEDED, through its rpath) alike.
    for path in (library.path,) + ((library.runtime,) if library.runtime else ()):
        try:
            _check_entry(path, LoadError)
        except FileNotFoundError:
            raise LoadError(f"fusegen: the cache entry {path.parent} was deleted before it "
                            "could be loaded; run again to rebuild it") from None
        why = _cache.verify(path)
        if why is not None:
            raise LoadError(f"fusegen: the cache entry {path.parent} is corrupt ({why}); run again "
                            "to rebuild it")
    try:
        torch.ops.load_library(str(library.path))
    except (OSError, RuntimeError) as err:
        raise LoadError(f"fusegen: could not load {library.path}: {err}") from None
    _LOADED.add(library.key)
    for hook in AFTER_LOAD:  # autograd's: auxiliary ops an earlier process built into it
        hook()
    failed = load_errors(library.path) if library.runtime else []
    if failed:  # an op of the library did not register (its static initializer kept the error)
        raise FusegenError(f"fusegen: loading {library.path} left op(s) unregistered: " + "; ".join(failed)
                           + " (an op of that name from another expression is already in this process: "
                           "rename one of them, or run them in separate processes)")
    if (library.path.parent / CPU_LATER_MARK).is_file():
        _later(_cache.entry_ops(library.path.parent), lambda entry=library.path.parent: _entry_sources(entry))
    # Last use, for `fusegen cache trim`: the runtime is used by every op library loaded, so
    # it is never older than the ops that need it. One utime each; never fails the load.
    for path in (library.path,) + ((library.runtime,) if library.runtime else ()):
        _cache.mark_used(path.parent)


# The first error in a compiler log: g++/clang `file:line:col: error: msg` (also `fatal
# error:`), nvcc `file(line): error: msg` (also `catastrophic error`, `error #20-D:`). Patterns
# for re, compiled on a failed build's first use, not by every cached load (0.6 ms).
_GCC_ERROR = r"^(?P<file>[^\s:(][^:]*):(?P<line>\d+):(?:(?P<col>\d+):)?\s*(?:fatal )?error:\s*(?P<msg>.*)$"
_NVCC_ERROR = r"^(?P<file>[^\s(][^(]*)\((?P<line>\d+)\):\s*(?:catastrophic )?error(?: #[\w-]+)?:\s*(?P<msg>.*)$"
# Without a file and line: the linker (`undefined reference to`, `ld: cannot find -l...`).
_OTHER_ERROR = r"undefined reference|cannot find -l|\berror:"


def first_compiler_error(log_text: str) -> tuple[str | None, int | None, int | None, str] | None:
    """(file, line, column, message) of the first error in a compiler log, or None."""
    lines = log_text.splitlines()
    for line in lines:
        m = re.match(_GCC_ERROR, line) or re.match(_NVCC_ERROR, line)
        if m:
            col = m.groupdict().get("col")
            return m["file"], int(m["line"]), int(col) if col else None, m["msg"].strip()
    for line in lines:
        # cpp_extension's own first line ("Error building extension 'x': [1/2] c++ ...") is
        # not an error message.
        if re.search(_OTHER_ERROR, line) and not line.startswith("Error building extension"):
            return None, None, None, line.strip()
    return None


def _failed_build(tmp: Path, what: str, log_text: str, files) -> BuildError:
    """A BuildError naming the first compiler error and its source line, with the full log
    and the failed build's sources kept in a private temp folder (the build folder itself is
    deleted: a failed build leaves nothing in the cache)."""
    ninja = tmp / "build.ninja"
    full = log_text
    if ninja.is_file():
        full += "\n--- build.ninja ---\n" + ninja.read_text(errors="replace")
    try:
        kept = Path(tempfile.mkdtemp(prefix="fusegen-failed-"))  # 0700, in $TMPDIR
        # The sources, so that the file:line of the message can be opened (and the build
        # rerun with ninja once the paths in build.ninja are adjusted).
        for path in sorted(tmp.rglob("*")):
            if path.is_file() and path.suffix in (".cpp", ".cu", ".h", ".cuh", ".ninja"):
                rel = path.relative_to(tmp)
                write({rel.name: path.read_text(errors="replace")}, kept / rel.parent)
        log_path = str(write_text(kept / "build.log", full))
    except OSError:  # no room to keep it: the message still has the first error
        kept, log_path = tmp, None
    first = None
    found = first_compiler_error(log_text)
    if found:
        file, line, col, message = found
        shown, source_line = file, None
        if file is not None:
            where = Path(file) if Path(file).is_absolute() else tmp / file
            try:
                shown = str(kept / where.relative_to(tmp))  # the copy that outlives the build
            except ValueError:
                shown = str(where)  # a header outside the build folder (torch's, the system's)
            try:
                text = where.read_text(errors="replace").splitlines()
                source_line = text[line - 1] if 0 < line <= len(text) else None
            except OSError:
                pass
        first = CompilerError(shown, line, col, message, source_line)
    kept_sources = tuple(str(kept / Path(f).relative_to(tmp)) if Path(f).is_relative_to(tmp) else str(f)
                         for f in files)
    return BuildError(f"fusegen: building {what} failed", log_text, kept_sources, first, log_path)

"""The cache on disk: what is in it, when each entry was last used, and removing entries and
the temp folders of killed builds without ever breaking a build in progress.

Layout of `$FUSEGEN_CACHE_DIR` (default `~/.cache/fusegen`), written by `build.py`:

    <key>/                      an op library: fusegen_<key>.so, the ops' sources, entry.json
    runtime-<key>/              the shared runtime: libfusegen_runtime_<key>.so, its sources, entry.json
    locks/<folder>.lock         the flock a build of <folder> holds from start to publish
    index/<request key>.json    which library a request was built into (fusegen/index.py)
    .build-<folder[:20]>-XXXX/  a build in progress (or killed), holding fusegen-owner
    .trash-<folder>-XXXX/       an entry being removed (renamed aside first, then deleted)

`entry.json` says what an entry holds (kind, op names, fusegen/torch versions, CUDA or not,
creation time); its mtime is the entry's last use, bumped by every cache hit and load.

The rule that keeps removal safe: a build takes `locks/<folder>.lock` before it creates its
temp folder and holds it until the entry is published. So an entry or a temp folder may be
removed only by whoever holds that lock, taken without waiting (LOCK_NB): if it is held, a
build is using it and it is left alone. flock locks belong to an open file description, so
a lock held by this very process (on another open()) also counts as held.

This module imports neither torch nor the build stage: `fusegen cache` stays fast.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from .files import write_text

ENTRY_FILE = "entry.json"
OWNER_FILE = "fusegen-owner"  # not "lock": cpp_extension's FileBaton uses that name in the build folder
LOCKS = "locks"
INDEX = "index"
TEMP_PREFIX = ".build-"
TRASH_PREFIX = ".trash-"


def cache_dir() -> Path:
    return Path(os.environ.get("FUSEGEN_CACHE_DIR") or Path.home() / ".cache" / "fusegen")


def lock_path(root: Path, folder: str) -> Path:
    return root / LOCKS / f"{folder}.lock"


# -- metadata written by builds --------------------------------------------------------------------

def write_entry_json(folder: Path, kind: str, ops: list[str], cuda: bool, fusegen_version: str,
                     torch_version: str) -> None:
    """What `fusegen cache` shows for an entry; written into the temp folder before the
    atomic rename, so a published entry always has it."""
    meta = {"kind": kind, "ops": list(ops), "cuda": cuda, "fusegen": fusegen_version,
            "torch": torch_version, "created": time.time()}
    write_text(folder / ENTRY_FILE, json.dumps(meta, indent=1) + "\n")


def write_owner(temp: Path, folder: str, what: str) -> None:
    """Right after mkdtemp: which lock guards this temp folder, so cleanup tests exactly that
    one (and the listing can say what is being built)."""
    write_text(temp / OWNER_FILE, json.dumps({"lock": f"{LOCKS}/{folder}.lock", "what": what,
                                              "pid": os.getpid()}) + "\n")


def mark_used(entry: Path) -> bool:
    """Bump the entry's last use: one utime. Never fails a load: a read-only or foreign cache,
    or an entry built before entry.json existed, simply keeps its old date. False when
    entry.json is missing (the caller may write one)."""
    try:
        os.utime(entry / ENTRY_FILE)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return True


# -- locks ---------------------------------------------------------------------------------------

@contextmanager
def _try_lock(path: Path, create: bool):
    """Yield True while holding `path`'s flock (taken without waiting), False if someone holds
    it. A lock file that does not exist is held by nobody: yield True without creating it,
    unless `create` (removing an entry takes the lock a build of it would take)."""
    flags = os.O_RDONLY | os.O_CLOEXEC  # flock needs no write access
    if create:
        path.parent.mkdir(exist_ok=True)
        flags |= os.O_CREAT
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _remove_aside(root: Path, path: Path, name: str) -> bool:
    """Rename `path` to a .trash- folder in one step, then delete that: a reader never sees a
    half-deleted entry (it is there, whole, or gone), and a removal cut short leaves only
    trash, which nothing reads. False if it was already gone."""
    trash = root / f"{TRASH_PREFIX}{name}-{secrets.token_hex(4)}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


# -- what is in the cache -------------------------------------------------------------------------

@dataclass
class Entry:
    path: Path
    kind: str              # "op" or "runtime"
    ops: list[str]         # op names (an op library); [] for the runtime
    size: int              # bytes, every file in the folder
    last_use: float        # epoch seconds
    torch: str | None      # torch version it was built for, when recorded
    cuda: bool | None

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class TempFolder:
    path: Path
    size: int
    what: str | None       # what the build was building, from its owner file
    stale: bool            # its build is gone (its lock is free)


def size(path: Path) -> int:
    """Bytes in the files under `path` (0 if it is gone)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for f in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:  # removed while we walk: a build or a cleanup of its own
                pass
    return total


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _entry(path: Path) -> Entry | None:
    meta = _read_json(path / ENTRY_FILE)
    kind = meta.get("kind") or ("runtime" if path.name.startswith("runtime-") else "op")
    ops = meta.get("ops")
    if not isinstance(ops, list):
        # An entry built before entry.json: each op's sources are in <name>/<name>.cpp.
        ops = sorted(p.parent.name for p in path.glob("*/*.cpp") if p.stem == p.parent.name)
    try:
        # entry.json's mtime is the last use; without it, when the library was written
        last_use = os.stat(path / ENTRY_FILE).st_mtime
    except OSError:
        libs = list(path.glob("*.so"))
        try:
            last_use = max(os.stat(p).st_mtime for p in libs) if libs else os.stat(path).st_mtime
        except OSError:
            return None  # removed while we looked
    return Entry(path, kind, [str(o) for o in ops] if kind == "op" else [], size(path), last_use,
                 meta.get("torch"), meta.get("cuda"))


def entries(root: Path | None = None) -> list[Entry]:
    """The published entries, most recently used first."""
    root = cache_dir() if root is None else root
    found = []
    for path in _children(root):
        if path.name.startswith(".") or path.name in (LOCKS, INDEX) or not path.is_dir():
            continue
        entry = _entry(path)
        if entry is not None:
            found.append(entry)
    return sorted(found, key=lambda e: -e.last_use)


def _children(root: Path) -> list[Path]:
    try:
        return sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _temp_locks(root: Path, temp: Path) -> tuple[list[Path], str | None]:
    """The lock(s) that guard a .build- folder: the one its owner file names, or, for a folder
    whose build died before writing that file (or a fusegen that did not write it), every
    lock whose name starts with the folder's prefix (`.build-<folder[:20]>-XXXX`)."""
    owner = _read_json(temp / OWNER_FILE)
    lock = owner.get("lock")
    what = owner.get("what") if isinstance(owner.get("what"), str) else None
    if isinstance(lock, str):
        path = (root / lock)
        # only a lock file directly in locks/: the owner file is data, not a path to trust
        if path.parent == root / LOCKS and path.name.endswith(".lock") and "/" not in lock[len(LOCKS) + 1:]:
            return [path], what
    prefix = temp.name[len(TEMP_PREFIX):].rsplit("-", 1)[0]  # mkdtemp's suffix has no "-"
    return sorted(p for p in (root / LOCKS).glob("*.lock") if p.name.startswith(prefix)), what


def temp_folders(root: Path | None = None) -> list[TempFolder]:
    """The .build- folders, each marked stale (its build is gone) or live."""
    root = cache_dir() if root is None else root
    found = []
    for path in _children(root):
        if not path.name.startswith(TEMP_PREFIX) or not path.is_dir():
            continue
        locks, what = _temp_locks(root, path)
        with ExitStack() as stack:
            free = all(stack.enter_context(_try_lock(lock, create=False)) for lock in locks)
        found.append(TempFolder(path, size(path), what, free))
    return found


def clean_stale(root: Path | None = None) -> list[TempFolder]:
    """Remove the temp folders of builds that are gone (killed mid-build) and leftover trash;
    return the temp folders removed. A folder is removed while holding its lock(s), taken
    without waiting, so a live build (which holds its lock throughout) keeps its folder, and
    no new build of that key can start while it goes."""
    root = cache_dir() if root is None else root
    removed = []
    for path in _children(root):
        if path.name.startswith(TRASH_PREFIX):
            shutil.rmtree(path, ignore_errors=True)  # a removal cut short; nothing reads trash
            continue
        if not path.name.startswith(TEMP_PREFIX) or not path.is_dir():
            continue
        locks, what = _temp_locks(root, path)
        with ExitStack() as stack:
            if not all(stack.enter_context(_try_lock(lock, create=False)) for lock in locks):
                continue  # a live build
            nbytes = size(path)
            if _remove_aside(root, path, path.name.lstrip(".")):
                removed.append(TempFolder(path, nbytes, what, True))
    return removed


def remove(entry: Entry, root: Path | None = None) -> bool:
    """Remove one published entry, under its build lock (taken without waiting): False, and
    the entry kept, while a build of it holds that lock, or while builds pin the entry's
    folder (a shared flock on the folder: op builds linking against the runtime, see
    build._pinned). A process that already loaded the library keeps it (the file stays
    mapped); one that finds the entry gone rebuilds it."""
    root = cache_dir() if root is None else root
    with _try_lock(lock_path(root, entry.name), create=True) as free, \
            _try_lock(entry.path, create=False) as unpinned:
        if not (free and unpinned):
            return False
        _remove_aside(root, entry.path, entry.name)
        return True


def index_files(root: Path | None = None) -> list[Path]:
    root = cache_dir() if root is None else root
    return sorted((root / INDEX).glob("*.json"))


def prune_index(root: Path | None = None, everything: bool = False) -> int:
    """Remove the request index's entries whose library or runtime is gone (or all of them):
    such an entry is already ignored (a lookup checks both files), so this only frees the
    folder of dead names. Each file is replaced atomically by its writer, so deleting one
    under a writer loses at most that one fast lookup. Returns how many were removed."""
    root = cache_dir() if root is None else root
    removed = 0
    for path in index_files(root):
        data = {} if everything else _read_json(path)
        library, runtime = data.get("library"), data.get("runtime")
        if not everything and isinstance(library, str) and isinstance(runtime, str) \
                and (root / library).is_dir() and (root / f"runtime-{runtime}").is_dir():
            continue
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed

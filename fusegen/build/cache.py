"""The cache on disk: what is in it, when each entry was last used, and removing entries and
the temp folders of killed builds without ever breaking a build in progress, or touching
anything fusegen did not make.

Layout of `$FUSEGEN_CACHE_DIR` (default `~/.cache/fusegen`), written by `builder.py`:

    CACHEDIR.TAG                the cache's marker (a cache directory tag naming fusegen)
    <key>/                      an op library: fusegen_<key>.so, the ops' sources, entry.json
    runtime-<key>/              the shared runtime: libfusegen_runtime_<key>.so, its sources, entry.json
    locks/<folder>.lock         the flock a build of <folder> holds from start to publish (its pid inside)
    index/<request key>.json    which library a request was built into (fusegen/build/index.py)
    templates/__jinja2_<sha1>.cache  Jinja's compiled templates (codegen/render.py): a new op's
                                process then skips compiling them (0.1 s of its build)
    .build-<folder[:20]>-XXXX/  a build in progress (or killed), holding fusegen-owner
    .trash-<folder>-XXXX/       an entry being removed (renamed aside first, then deleted)

`entry.json` says what an entry holds (kind, op names, fusegen/torch versions, CUDA or not,
creation time) and the size and sha256 of its library, checked before every load; its
mtime is the entry's last use, bumped by every cache hit and load.

What fusegen removes is only what it made, recognised twice: the cache folder carries
fusegen's CACHEDIR.TAG (written when fusegen creates the folder, or adopts an empty one), and
each thing in it has one of fusegen's names (32 hex digits, `runtime-` and 32 hex digits,
`.build-...`, `.trash-...`, `index/<32 hex>.json`) and, for an entry, its entry.json. A
folder that is not a fusegen cache (`~/.cache`, `$HOME`) is refused, whatever it holds.

The rule that keeps removal safe: a build takes `locks/<folder>.lock` before it creates its
temp folder and holds it until the entry is published. So an entry or a temp folder may be
removed only by whoever holds that lock, taken without waiting (LOCK_NB): if it is held, a
build is using it and it is left alone. flock locks belong to an open file description, so
a lock held by this very process (on another open()) also counts as held.

This module imports neither torch nor the build stage: `fusegen cache` stays fast.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from fusegen.errors import BuildError, FusegenError
from fusegen.files import write_text

log = logging.getLogger("fusegen")

ENTRY_FILE = "entry.json"
# In an entry: the stat of its library and entry.json when a load last found them intact.
VERIFIED_FILE = "verified"
OWNER_FILE = "fusegen-owner"  # not "lock": cpp_extension's FileBaton uses that name in the build folder
LOCKS = "locks"
INDEX = "index"
TEMPLATES = "templates"
TEMP_PREFIX = ".build-"
TRASH_PREFIX = ".trash-"
# The cache's own marker: a cache directory tag (https://bford.info/cachedir/), so backup
# tools skip the cache too; fusegen recognises only a tag whose comment names fusegen.
ROOT_MARKER = "CACHEDIR.TAG"
_TAG_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"
_TAG_TEXT = (f"{_TAG_SIGNATURE}\n# This file is a cache directory tag created by fusegen.\n"
             "# fusegen lists and removes only what it made in this folder (fusegen cache).\n")
# The names fusegen gives what it makes in the cache (mkdtemp's suffixes: [a-z0-9_]), as
# patterns for re.fullmatch, which compiles each on its first use (re's own cache): a
# cached load matches none of them, and compiling them all is 0.8 ms.
ENTRY_NAME = r"(?:runtime-)?[0-9a-f]{32}"
_TEMP_NAME = r"\.build-(?:[0-9a-f]{20}|runtime-[0-9a-f]{12})-[a-z0-9_]+"
_TRASH_NAME = (r"\.trash-(?:(?:runtime-)?[0-9a-f]{32}|build-(?:[0-9a-f]{20}|runtime-[0-9a-f]{12})-[a-z0-9_]+)"
                         r"-[0-9a-f]{8}")
_INDEX_NAME = r"[0-9a-f]{32}\.json"
_LOCK_NAME = r"(?:runtime-)?[0-9a-f]{32}\.lock"
# Jinja's FileSystemBytecodeCache names, and its temp file (NamedTemporaryFile: the name, a
# random part, .tmp) left by a crash mid-write.
_TEMPLATE_NAME = r"__jinja2_[0-9a-f]{40}\.cache(?:[a-z0-9_]+\.tmp)?"
_FOLDER_NAMES = {LOCKS: _LOCK_NAME, INDEX: _INDEX_NAME, TEMPLATES: _TEMPLATE_NAME}
KINDS = ("op", "runtime")


def cache_dir() -> Path:
    """`$FUSEGEN_CACHE_DIR` (default `~/.cache/fusegen`), made absolute: the build runs the
    compiler in another folder, and a relative path would point elsewhere there."""
    return Path(os.path.abspath(os.environ.get("FUSEGEN_CACHE_DIR") or Path.home() / ".cache" / "fusegen"))


# -- is this a fusegen cache? ----------------------------------------------------------------------

def _tagged(root: Path) -> bool:
    try:
        with open(root / ROOT_MARKER, "rb") as fh:
            text = fh.read(4096).decode("utf-8", "replace")
    except OSError:
        return False
    return text.startswith(_TAG_SIGNATURE) and "created by fusegen" in text


def is_entry(path: Path) -> bool:
    """One of fusegen's entries: its name, and the entry.json it wrote at publish."""
    if not re.fullmatch(ENTRY_NAME, path.name) or path.is_symlink() or not path.is_dir():
        return False
    return _read_json(path / ENTRY_FILE).get("kind") in KINDS


def foreign(root: Path) -> list[str] | None:
    """None when `root` is a fusegen cache; else the names in it that fusegen did not make
    ([] when there are none, and no entry either). A folder without the marker that holds
    fusegen's entries and nothing but its locks and index (a cache from before the marker)
    is one."""
    if _tagged(root):
        return None
    others, entries_seen = [], 0
    for path in _children(root):
        name = path.name
        if is_entry(path):
            entries_seen += 1
        elif name in _FOLDER_NAMES and path.is_dir() and not path.is_symlink():
            pattern = _FOLDER_NAMES[name]
            if not all(re.fullmatch(pattern, p.name) or p.name.startswith(".") for p in _children(path)):
                others.append(name)
        elif not (re.fullmatch(_TEMP_NAME, name) or re.fullmatch(_TRASH_NAME, name)):
            others.append(name)
    return None if entries_seen and not others else others


def not_a_cache_message(root: Path, others: list[str]) -> str:
    if others:
        shown = ", ".join(others[:6]) + (f", ... ({len(others) - 6} more)" if len(others) > 6 else "")
        holds = f"and it holds what fusegen did not make: {shown}"
    else:
        holds = "and no entry fusegen made"
    return (f"fusegen: {root} is not a fusegen cache: it has no {ROOT_MARKER} written by fusegen, "
            f"{holds}. fusegen expects FUSEGEN_CACHE_DIR to be a folder of its own (default "
            "~/.cache/fusegen), which it creates, and touches nothing else; set it to a new or "
            "empty folder")


def mark_root(root: Path) -> None:
    """Write the marker (best effort for a read-only cache: it still loads)."""
    try:
        write_text(root / ROOT_MARKER, _TAG_TEXT)
    except OSError:
        pass


def adopt(root: Path, error: type[FusegenError]) -> None:
    """Before a build: make sure `root` is fusegen's cache. An empty folder, or a cache from
    before the marker, gets the marker; anything else is refused with `error`."""
    if _tagged(root):
        return
    if _children(root):
        others = foreign(root)
        if others is not None:
            raise error(not_a_cache_message(root, others))
    mark_root(root)


def lock_path(root: Path, folder: str) -> Path:
    return root / LOCKS / f"{folder}.lock"


# -- metadata written by builds --------------------------------------------------------------------

def write_entry_json(folder: Path, kind: str, ops: list[str], cuda: bool, fusegen_version: str,
                     torch_version: str, library: str) -> None:
    """What `fusegen cache` shows for an entry, and the size and sha256 of its library
    (`library`, a file in `folder`), which every load checks first; written into the temp
    folder after the library is final and before the atomic rename, so a published entry
    always has it. It is also fusegen's marker of the entry."""
    size, digest = _digest(folder / library)
    meta = {"kind": kind, "ops": list(ops), "cuda": cuda, "fusegen": fusegen_version,
            "torch": torch_version, "created": time.time(),
            "library": library, "size": size, "sha256": digest}
    write_text(folder / ENTRY_FILE, json.dumps(meta, indent=1) + "\n")


def _digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


# Libraries found intact in this process, by path, with the stat that was checked: a second
# check of an unchanged file (an op library's runtime, each time an op library loads) is
# one stat. ctime is in it: writing a file, or resetting its mtime, changes its ctime.
_VERIFIED: dict[str, tuple] = {}


def verify(library: Path) -> str | None:
    """Why the cache entry holding `library` must not be loaded (its entry.json or library
    missing, their size or sha256 not the ones recorded at publish), or None when it is
    intact. A truncated library would crash the process at load (SIGBUS), and a changed one
    could run anything: every load is checked first. About 1.5 ms per MB, once per
    library and entry as they are (VERIFIED_FILE)."""
    try:
        st = os.stat(library)
    except FileNotFoundError:
        return "its library is missing"
    stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if _VERIFIED.get(str(library)) == stamp:
        return None
    meta = _read_json(library.parent / ENTRY_FILE)
    if not meta:
        return f"its {ENTRY_FILE} is missing or unreadable"
    size, digest = meta.get("size"), meta.get("sha256")
    if not isinstance(size, int) or not isinstance(digest, str) or meta.get("library") != library.name:
        return f"its {ENTRY_FILE} records no size and sha256 for {library.name}"
    if st.st_size != size:
        return f"{library.name} is {st.st_size} bytes, {ENTRY_FILE} records {size}"
    # Verified by an earlier process: the stamp it left names the library as it is (any
    # write to it changes its ctime, which nothing can set back) and the size and sha256
    # entry.json records now. Not entry.json's own stat: every load bumps its mtime
    # (mark_used), which would make each process hash the library again.
    both = repr(stamp + (size, digest))
    try:
        with open(library.parent / VERIFIED_FILE) as fh:
            if fh.read(512) == both:
                _VERIFIED[str(library)] = stamp
                return None
    except OSError:
        pass  # none yet (or unreadable): hashed, then written
    if _digest(library) != (size, digest):
        return f"the sha256 of {library.name} differs from the one recorded when it was built"
    _VERIFIED[str(library)] = stamp
    try:  # for the next process (a read-only entry, an installed runtime's, hashes each time)
        write_text(library.parent / VERIFIED_FILE, both)
    except OSError:
        pass
    return None


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

DEFAULT_LOCK_TIMEOUT = 600.0  # seconds: a cold CUDA build of many ops takes minutes


def lock_timeout() -> float:
    """How long a build waits for another process's build of the same library:
    FUSEGEN_LOCK_TIMEOUT seconds (default 600)."""
    text = os.environ.get("FUSEGEN_LOCK_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise FusegenError(f"fusegen: FUSEGEN_LOCK_TIMEOUT must be a number of seconds (0 or more), "
                           f"got {text!r}")
    return value


def lock_holder(path: Path) -> str:
    """Who holds a build lock, from the pid its holder wrote into it: "another process (pid
    123)", "... (pid 123, stopped: ...)", or "another process" when it says nothing (a
    `fusegen cache` command, which holds it for a moment, writes nothing)."""
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    if not text.isdigit():
        return "another process"
    pid = int(text)
    try:
        # /proc/<pid>/stat: "pid (comm) state ...", comm may hold spaces and parentheses
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        state = ""
    if state in ("T", "t"):
        return f"another process (pid {pid}, stopped: `kill -CONT {pid}` resumes it)"
    return f"another process (pid {pid})"


@contextmanager
def build_lock(path: Path, what: str = ""):
    """The exclusive flock a build holds from its start to its publish, with this process's
    pid written into the lock file for whoever waits. The kernel drops the lock when the
    process dies, so it never goes stale; a process that is alive but stuck (stopped,
    hung) holds it, so waiting for it is bounded (lock_timeout()), and the holder's own
    build is never disturbed. `fusegen cache` takes the same lock (without waiting) before
    it removes the entry or the temp folder it guards."""
    path.parent.mkdir(exist_ok=True)  # not parents=True: a deleted cache is not recreated here
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait_for(fd, path, what)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            try:
                os.ftruncate(fd, 0)  # no holder: a waiter reads nothing stale
            except OSError:
                pass
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _wait_for(fd: int, path: Path, what: str):
    timeout = lock_timeout()
    # Say why nothing happens: another process builds the same library (it may be the
    # runtime's one-time build, a minute on a small machine).
    log.info("waiting for %s building %s (giving up after %.0f s: FUSEGEN_LOCK_TIMEOUT)",
             lock_holder(path), what or path.stem, timeout, extra={"fusegen_build": "wait"})
    deadline = time.monotonic() + timeout
    pause = 0.02
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            raise BuildError(f"fusegen: gave up building {what or path.stem} after waiting {timeout:.0f} s "
                             f"for its lock {path}, held by {lock_holder(path)}. If that build is "
                             "stuck, end it; to wait longer, set FUSEGEN_LOCK_TIMEOUT (seconds)")
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.5)

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
    trash = root / f"{TRASH_PREFIX}{name}-{os.urandom(4).hex()}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename a finished temp folder to its entry. An entry already there (a corrupt one
    being rebuilt, or the leftover of a crash) is renamed aside first and deleted after:
    a reader finds the old entry or the new one whole (or, in between, none, and builds or
    waits on the lock the publisher holds), never a mixture."""
    trash = None
    if os.path.lexists(final):
        trash = root / f"{TRASH_PREFIX}{final.name}-{os.urandom(4).hex()}"
        os.rename(final, trash)
    os.rename(tmp, final)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


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


def entry_ops(path: Path) -> list[str]:
    """The op names an op library's entry.json lists ([] for anything else)."""
    ops = _read_json(path / ENTRY_FILE).get("ops")
    return [str(o) for o in ops] if isinstance(ops, list) else []


def _entry(path: Path) -> Entry | None:
    meta = _read_json(path / ENTRY_FILE)
    kind = meta.get("kind")
    ops = meta.get("ops")
    if kind not in KINDS:
        return None  # not one of fusegen's entries
    try:
        last_use = os.stat(path / ENTRY_FILE).st_mtime  # entry.json's mtime is the last use
    except OSError:
        return None  # removed while we looked
    ops = [str(o) for o in ops] if kind == "op" and isinstance(ops, list) else []
    return Entry(path, kind, ops, size(path), last_use, meta.get("torch"), meta.get("cuda"))


def entries(root: Path | None = None) -> list[Entry]:
    """The published entries (fusegen's names and entry.json), most recently used first."""
    root = cache_dir() if root is None else root
    found = []
    for path in _children(root):
        if not is_entry(path):
            continue
        entry = _entry(path)
        if entry is not None:
            found.append(entry)
    return sorted(found, key=lambda e: -e.last_use)


def others(root: Path | None = None) -> list[Path]:
    """What is in the cache folder that fusegen did not make (or cannot recognise as its
    own): listed, never removed."""
    root = cache_dir() if root is None else root
    return [p for p in _children(root)
            if not (is_entry(p) or p.name in (*_FOLDER_NAMES, ROOT_MARKER) or re.fullmatch(_TEMP_NAME, p.name)
                    or re.fullmatch(_TRASH_NAME, p.name) or _is_own_temp_file(p.name))]


def _is_own_temp_file(name: str) -> bool:
    """files.write_text's temp file of the marker, left by a crash mid-write."""
    return name.startswith(f".{ROOT_MARKER}.") and name.endswith(".tmp")


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
        if path.parent == root / LOCKS and re.fullmatch(_LOCK_NAME, path.name) and "/" not in lock[len(LOCKS) + 1:]:
            return [path], what
    prefix = temp.name[len(TEMP_PREFIX):].rsplit("-", 1)[0]  # mkdtemp's suffix has no "-"
    return sorted(p for p in _children(root / LOCKS) if re.fullmatch(_LOCK_NAME, p.name) and p.name.startswith(prefix)), what


def _is_temp(path: Path) -> bool:
    return bool(re.fullmatch(_TEMP_NAME, path.name)) and not path.is_symlink() and path.is_dir()


def temp_folders(root: Path | None = None) -> list[TempFolder]:
    """The .build- folders, each marked stale (its build is gone) or live."""
    root = cache_dir() if root is None else root
    found = []
    for path in _children(root):
        if not _is_temp(path):
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
        if re.fullmatch(_TRASH_NAME, path.name) and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)  # a removal cut short; nothing reads trash
            continue
        if not _is_temp(path):
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
    return [p for p in _children(root / INDEX) if re.fullmatch(_INDEX_NAME, p.name)]


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
        removed += _unlink(path)
    return removed


def _unlink(path: Path) -> int:
    """Remove one file fusegen made; 1 if it went, 0 if another process removed it first."""
    try:
        path.unlink()
        return 1
    except FileNotFoundError:
        return 0


# -- compiled templates ----------------------------------------------------------------------------

def template_folder() -> Path | None:
    """Where render.py keeps Jinja's compiled templates: `templates/` in a cache that is
    fusegen's (its marker) and private (this user's, written by nobody else, for Jinja loads
    the code in it), created 0700; None otherwise (the templates are compiled from source)."""
    root = cache_dir()
    folder = root / TEMPLATES
    me = os.geteuid()
    try:
        if not _tagged(root) or not _private(os.stat(root), me):
            return None
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass
        st = os.lstat(folder)
        return folder if stat.S_ISDIR(st.st_mode) and _private(st, me) else None
    except OSError:
        return None


def _private(st: os.stat_result, me: int) -> bool:
    return st.st_uid == me and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def clear_templates(root: Path | None = None) -> int:
    """Remove the compiled templates (recompiled on the next new op); how many went."""
    root = cache_dir() if root is None else root
    folder = root / TEMPLATES
    if folder.is_symlink():
        return 0
    removed = 0
    for path in _children(folder):
        if re.fullmatch(_TEMPLATE_NAME, path.name) and not path.is_symlink():
            removed += _unlink(path)
    return removed

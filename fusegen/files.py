"""The only place that writes files: the sources the CLI writes to `generated/<name>/`, the
sources a build writes into its temp folder in the cache, the benchmark's JSON and plot. It also
finds templates/ (`templates_dir()`), which the render stage reads and the build stage
reads the shared runtime's sources from, so the build stage need not import render.

Each file is written through a temp file in the same folder and renamed over the target,
so a reader (or a crash) never sees half a file. New files get the usual mode,
0o666 & ~umask (the kernel applies the umask, as for `open(path, "w")`), and a file whose
bytes are already the ones to write is left untouched (same inode, same mtime).
"""

from __future__ import annotations

import os
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Mapping


def write(files: Mapping[str, str], directory: str | os.PathLike) -> list[Path]:
    """Write `files` (name -> text) into `directory`, creating it; return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return [write_text(directory / name, text) for name, text in files.items()]


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write one UTF-8 text file atomically; leave it alone when it already holds `text`."""
    return write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write one file atomically (the benchmark's PNG); leave it alone when it holds `data`."""
    path = Path(path)
    try:
        if path.read_bytes() == data:
            return path
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        pass
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new temp file beside `path`, open for writing, created 0o666 & ~umask (mkstemp
    would make it 0o600, and the rename would keep that)."""
    for _ in range(100):
        # os.urandom as secrets.token_hex does it: importing secrets (hmac) is 0.5 ms of a cached load
        tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temp file beside {path}")


# The hand-written runtime: templates/runtime/ in fusegen, `_runtime/` beside the op
# folders it writes (generated/_runtime/), one copy for all of them.
RUNTIME_TEMPLATES = "runtime"
RUNTIME_FOLDER = "_runtime"  # no op may be called so (ir/names.py, check_op_name)


@lru_cache(maxsize=None)
def runtime_files() -> dict[str, str]:
    """The runtime's sources, file name -> text, in name order."""
    folder = templates_dir() / RUNTIME_TEMPLATES
    return {p.name: p.read_text() for p in sorted(folder.iterdir()) if p.suffix in (".h", ".cuh", ".cpp")}


@lru_cache(maxsize=None)
def templates_dir() -> Path:
    """templates/ beside the package in a checkout (editable install, PYTHONPATH=.);
    the `fusegen.templates` package data in a wheel (pip install .)."""
    source = Path(__file__).resolve().parent.parent / "templates"
    if (source / "op.cpp.j2").is_file():
        return source
    # templates/ has no __init__.py, so this is a namespace package: ask for a file in it
    # (str() of the folder itself would be a MultiplexedPath's repr).
    return Path(str(resources.files("fusegen.templates") / "op.cpp.j2")).parent

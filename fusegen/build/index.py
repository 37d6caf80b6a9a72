"""The request index: what makes a cached load cheap.

A library's cache key is a hash of its generated sources, so finding it the long way means
parsing, differentiating (sympy, about a second to import) and rendering (Jinja) the
expression again. The index remembers the answer: `index/<request key>.json` in the cache
names the library a request was built into and what a FusedOp needs to exist without its
spec (the op's name, parameters, whether it has a backward kernel, a digest of its files).
A cached `fuse("a*b+c")` in a new process is then a hash, a small JSON read and a dlopen.

The request key (keys.request_key) hashes the request (all its fields), fusegen's own
sources and templates and the cache key's own list of what decides a library besides its
sources (keys.key_parts), naming a compiler by its file rather than by running it: a cached
load runs no process.
A miss, a corrupt entry or an entry whose library was trimmed from the cache, or whose
library or runtime is not the one published (cache.verify), falls back to the long way,
which then rewrites (or rebuilds) it. The index holds keys, never paths: the library is
always looked for under the current cache directory and goes through build.load's checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fusegen.build import builder as build
from fusegen.build import cache as _cache
from fusegen.build import keys
from fusegen.ir.family import Member
from fusegen.files import write_text


@dataclass(frozen=True)
class Entry:
    """One request's op in its library: what a FusedOp needs before (or without) its spec."""

    name: str
    inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    text: str                 # the expression in the user's notation (repr, messages)
    backward_kernel: bool     # whether <name>_backward exists
    digest: str               # of the generated files: one name, one expression
    library: build.Library | None
    family: tuple = ()        # family.Member per op of the family (the op, its auxiliary ops)
    auxiliary: tuple = ()     # (auxiliary op, its library's key): those built so far (on first use)


def _path(key: str) -> Path:
    return build.cache_dir() / "index" / f"{key}.json"


def _library(data: dict) -> build.Library | None:
    """The library an entry names, when it is the one published in the cache and its runtime
    (the one `fusegen setup` installed, or the cache's) is there whole."""
    key = data["library"]
    runtime = build.published_runtime(data["runtime"])
    library = build.Library(build.cache_dir() / key / f"fusegen_{key}.so", key, 0.0, True, runtime)
    if runtime is None or _cache.verify(library.path) is not None:
        return None
    return library


def lookup(request) -> Entry | None:
    """The request's op and library when the index knows them and the library (and the
    runtime it links against) are still in the cache; None otherwise."""
    try:
        data = json.loads(_path(keys.request_key(request)).read_text())
        if data.get("format") != keys.INDEX_FORMAT:
            return None
        library = _library(data)
        if library is None:
            return None  # gone, or not the library published: the long way rebuilds it
        family = tuple(Member(str(n), int(t), bool(b), bool(c), int(o), bool(j), bool(r), bool(u))
                       for n, t, b, c, o, j, r, u in data["family"])
        if not family or family[0].name != data["name"]:
            return None
        auxiliary = tuple((str(n), str(k)) for n, k in sorted(data.get("auxiliary", {}).items()))
        return Entry(data["name"], tuple(data["inputs"]), tuple(data["scalars"]), data["text"],
                     bool(data["backward_kernel"]), data["digest"], library, family, auxiliary)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no entry, or one we cannot read: the long way, which rewrites it


def record(request, entry: Entry):
    """Remember where `request` was built. Best effort: a cache we cannot write loses only
    the fast path, never the op."""
    data = {"format": keys.INDEX_FORMAT, "name": entry.name, "inputs": list(entry.inputs),
            "scalars": list(entry.scalars), "text": entry.text, "backward_kernel": entry.backward_kernel,
            "digest": entry.digest, "library": entry.library.key,
            "family": [[m.name, m.tensors, m.backward, m.composite, m.outputs, m.joined, m.rows, m.random]
                       for m in entry.family],
            "runtime": entry.library.runtime.parent.name.removeprefix("runtime-"),
            "auxiliary": dict(entry.auxiliary),
            # the request itself, so that fusegen.load(name) can find it by name and check
            # that its key is still this environment's
            "request": _fields(request)}
    _write(request, data)


def _fields(request) -> dict:
    """A request's fields as JSON holds them (tuples as lists)."""
    return {f: list(v) if isinstance(v, tuple) else v for f, v in vars(request).items()}


def _write(request, data: dict):
    """The entry of `request`. Best effort: a cache we cannot write loses only the fast
    path, never the op."""
    try:
        path = _path(keys.request_key(request))
        path.parent.mkdir(mode=0o700, exist_ok=True)
        write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError as err:
        build.log.debug("fusegen: could not write the index entry for %s: %s", data["name"], err)


def record_auxiliary(request, name: str, key: str):
    """Remember that auxiliary op `name` of the request's op was built into library `key`,
    so that a later process loads it on first use without the pipeline. Best effort."""
    path = _path(keys.request_key(request))
    try:
        data = json.loads(path.read_text())
        if data.get("format") != keys.INDEX_FORMAT or data.get("auxiliary", {}).get(name) == key:
            return
        data.setdefault("auxiliary", {})[name] = key
        write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    except (OSError, ValueError, AttributeError) as err:
        build.log.debug("fusegen: could not record %s in the index: %s", name, err)


def auxiliary_library(entry: Entry, name: str) -> build.Library | None:
    """The library auxiliary op `name` of a cached entry was built into, when the index
    recorded it and it is still the one published in the cache."""
    key = dict(entry.auxiliary).get(name)
    if key is None or entry.library is None:
        return None
    library = build.Library(build.cache_dir() / key / f"fusegen_{key}.so", key, 0.0, True, entry.library.runtime)
    return library if _cache.verify(library.path) is None else None


def named(name: str) -> tuple[list[dict], int]:
    """The index entries' requests of op `name`, the newest first (the requests as recorded:
    dicts of Request or StepRequest fields, `_kind` "op" or "step", entries of another
    environment among them), and how many entries the index holds in all."""
    folder = build.cache_dir() / "index"
    try:
        paths = list(folder.glob("*.json"))
    except OSError:
        return [], 0
    found = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
            if data.get("format") == keys.INDEX_FORMAT and data.get("name") == name and isinstance(data.get("request"), dict):
                request = dict(data["request"], _kind=data.get("kind", "op"))
                found.append((path.stat().st_mtime, path.stem, request))
        except (OSError, ValueError):
            continue
    found.sort(key=lambda f: f[0], reverse=True)
    return [dict(request, _key=key) for _, key, request in found], len(paths)


def names() -> list[str]:
    """Every op name the index knows (any environment), sorted."""
    out = set()
    try:
        paths = list((build.cache_dir() / "index").glob("*.json"))
    except OSError:
        return []
    for path in paths:
        try:
            data = json.loads(path.read_text())
            if data.get("format") == keys.INDEX_FORMAT and isinstance(data.get("name"), str):
                out.add(data["name"])
        except (OSError, ValueError):
            continue
    return sorted(out)


# -- step ops -------------------------------------------------------------------------------
#
# A step op (ir/step.py) has no family and no auxiliary ops: its entry names the library
# and what a FusedStep needs without its spec (name, parameters, the updated inputs, the
# text, a digest of the files). Keyed by the same request key, of a StepRequest.

def lookup_step(request) -> dict | None:
    """The cached step op of `request`: {"name", "inputs", "scalars", "updated", "text",
    "digest", "library"}; None when the index does not know it or its library is gone."""
    try:
        data = json.loads(_path(keys.request_key(request)).read_text())
        if data.get("format") != keys.INDEX_FORMAT or data.get("kind") != "step":
            return None
        library = _library(data)
        if library is None:
            return None
        return {"name": str(data["name"]), "inputs": tuple(map(str, data["inputs"])),
                "scalars": tuple(map(str, data["scalars"])), "updated": tuple(map(str, data["updated"])),
                "text": str(data["text"]), "digest": str(data["digest"]), "library": library}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_step(request, name: str, inputs, scalars, updated, text: str, digest: str, library):
    """Remember where the step op of `request` was built (best effort, as `record`)."""
    data = {"format": keys.INDEX_FORMAT, "kind": "step", "name": name, "inputs": list(inputs),
            "scalars": list(scalars), "updated": list(updated), "text": text, "digest": digest,
            "library": library.key, "runtime": library.runtime.parent.name.removeprefix("runtime-"),
            "request": _fields(request)}
    _write(request, data)


"""`fusegen package`: a wheel from generated/ folders, with no fusegen at run time.

The project it writes is the way a hand-written extension ships: pyproject.toml, a
setup.py with torch's CppExtension (CUDAExtension for a CUDA build), the ops' sources and
the shared runtime (`_runtime/` beside the op folders: generated/_runtime/), and a
package whose __init__.py loads the extension with torch.ops.load_library, which registers
torch.ops.fusegen.<name> with its backward and auxiliary ops (a step op: <name>_foreach).
The wheel is built with
`python -m pip wheel --no-deps --no-build-isolation` (pip is always there; no network).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

from fusegen import files

from fusegen.ir import names
from fusegen.errors import FusegenError
from fusegen.codegen.escape import c_comment, c_string, py_string, py_strings

# The runtime's files, each read from `<op folder>/../_runtime/` (files.RUNTIME_FOLDER): the
# names fusegen writes there, and no other file of that folder.
RUNTIME = tuple(files.runtime_files())


class PackageError(FusegenError):
    """A folder that is not a generated op, a clash between ops, or a failed wheel build."""


class WheelBuildError(PackageError):
    """pip could not build the wheel: the message has the first compiler error and the log's end."""


def cuda_available() -> bool:
    """nvcc on the PATH (or CUDA_HOME) and a CUDA build of torch: then a CUDA wheel."""
    import torch
    from torch.utils import cpp_extension
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def collect(folders: list[Path]) -> tuple[list[str], dict[str, bytes]]:
    """(op names, {file name: bytes}) over the folders: every op's own files once, the
    runtime once (from `_runtime/` beside each op folder). The same op twice (same bytes) is
    taken once; two different files of one name (two ops called alike, or folders from
    different fusegen versions) is an error, since one library must not register an op
    twice nor mix runtimes.

    A folder is read as untrusted input: its spec.json must hold what fusegen writes (the
    op name checked as the CLI checks it, the expression read back through the parser),
    and of its files only the ones fusegen writes for that op are read (a step op's
    program read back through the statement parser, frontend/statements.py), each a regular
    file, not a symbolic link (which would copy any file of this machine into the wheel);
    the runtime's folder must be a real folder too."""
    ops: list[str] = []
    kinds: dict[str, str] = {}  # op name -> "op" or "step"
    chosen: dict[str, bytes] = {}
    where: dict[str, Path] = {}
    for folder in folders:
        folder = Path(folder)
        name, auxiliary, kind = _read_spec(folder)
        if name not in ops:
            ops.append(name)
            kinds[name] = kind
        runtime = _runtime_folder(folder)
        for file_name in op_files(name, auxiliary):
            path = (runtime if file_name in RUNTIME else folder) / file_name
            data = _read_file(path)
            seen = chosen.get(file_name)
            if seen is None:
                chosen[file_name], where[file_name] = data, path
            elif seen != data:
                what = "the runtime" if file_name in RUNTIME else f"op file {file_name}"
                raise PackageError(f"{where[file_name]} and {path} differ: {what} must be the same in every folder "
                                   "(regenerate the folders with one fusegen version; two ops cannot share a name)")
    if not ops:
        raise PackageError("no op folders given")
    registered = set(ops)
    for name in ops:  # a step op registers <name>_foreach too
        foreach = name + "_foreach"
        if kinds[name] == "step" and foreach in registered:
            raise PackageError(f"op {foreach!r} and step op {name!r} (which registers {foreach}) cannot "
                               "share one library; rename one of them")
    return ops, chosen


def _runtime_folder(folder: Path) -> Path:
    """`_runtime/` beside an op folder, which fusegen writes with it: a real folder, not a
    symbolic link (that would read the runtime's names from anywhere)."""
    runtime = folder.parent / files.RUNTIME_FOLDER
    try:
        mode = os.lstat(runtime).st_mode
    except FileNotFoundError:
        raise PackageError(f"{runtime}: missing (fusegen writes the runtime beside the op folders; "
                           "regenerate the folder with this fusegen)") from None
    if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
        raise PackageError(f"{runtime} is {'a symbolic link' if stat.S_ISLNK(mode) else 'not a folder'}: "
                           "the runtime beside the op folders is a folder of regular files")
    return runtime


def op_files(name: str, auxiliary=()) -> list[str]:
    """What a project takes for an op: the op's and its auxiliary ops' sources
    (render.TEMPLATES) from generated/<name>/, and the runtime from generated/_runtime/."""
    return [f"{op}{suffix}" for op in (name, *auxiliary) for suffix in (".h", ".cu", ".cpp")] + list(RUNTIME)


def _read_spec(folder: Path) -> tuple[str, list[str], str]:
    """(op name, auxiliary op names, "op" or "step") from the folder's spec.json, each value
    checked."""
    from fusegen.frontend.parse import reparse
    from fusegen.ir.names import check_identifier, check_op_name

    path = folder / "spec.json"
    if not os.path.lexists(path):
        raise PackageError(f"{folder}: not a generated op folder (no spec.json)")
    try:
        doc = json.loads(_read_file(path).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PackageError(f"{path}: not the JSON fusegen writes ({err})") from None
    if not isinstance(doc, dict):
        raise PackageError(f"{path}: not the JSON fusegen writes (expected an object, got {type(doc).__name__})")
    try:
        name = check_op_name(doc.get("name"))
        inputs, scalars = doc.get("inputs"), doc.get("scalars", [])
        for what, values in (("inputs", inputs), ("scalars", scalars)):
            if not isinstance(values, list):
                raise PackageError(f"{path}: {what!r} must be a list of names, got {values!r}"[:300])
            for value in values:
                check_identifier(value, what[:-1])
        kind = doc.get("kind", "op")
        if kind == "step":
            _check_step(path, name, doc, inputs, scalars)
            return name, [], kind
        if kind != "op":
            raise PackageError(f"{path}: 'kind' must be \"step\" (a step op) or absent (an op), got {kind!r}"[:300])
        reparse(doc.get("expression"), inputs, scalars)
        auxiliary = doc.get("auxiliary_ops", {})
        allowed = [name + names.GRAD2_SUFFIX, name + names.JVP_SUFFIX]
        if not isinstance(auxiliary, dict) or any(a not in allowed for a in auxiliary):
            raise PackageError(f"{path}: 'auxiliary_ops' may name {' and '.join(allowed)} only, "
                               f"got {list(auxiliary) if isinstance(auxiliary, dict) else auxiliary!r}"[:300])
    except PackageError:
        raise
    except FusegenError as err:
        raise PackageError(f"{path}: {err}") from None
    return name, [a for a in allowed if a in auxiliary], kind


def _check_step(path: Path, name: str, doc: dict, inputs: list, scalars: list):
    """A step op's spec.json (ir/step.py): its program read back through the statement
    parser to the inputs, scalars and updated inputs recorded; no auxiliary ops. Its files
    are named as an op's (render.STEP_TEMPLATES: <name>.h, .cu, .cpp)."""
    from fusegen.frontend.statements import parse_program
    from fusegen.ir.expr import ParsedProgram
    from fusegen.ir.step import FOREACH_SUFFIX

    if name.endswith(FOREACH_SUFFIX):
        raise PackageError(f"{path}: name must not end in '{FOREACH_SUFFIX}' (a step op registers "
                           f"<name>{FOREACH_SUFFIX} too), got {name!r}")
    if "auxiliary_ops" in doc:
        raise PackageError(f"{path}: a step op has no auxiliary ops, got 'auxiliary_ops'")
    program = doc.get("expression")
    parsed = parse_program(program, inputs=inputs, scalars=scalars)
    if not isinstance(parsed, ParsedProgram):
        raise PackageError(f"{path}: {program!r} updates no input; a step op's program assigns to its inputs"[:300])
    updated = [u for u, _ in parsed.updates]
    if list(parsed.inputs) != inputs or list(parsed.scalars) != scalars or doc.get("updated") != updated:
        raise PackageError(f"{path}: the program {program!r} reads inputs {list(parsed.inputs)}, scalars "
                           f"{list(parsed.scalars)} and updates {updated}, not the recorded {inputs}, {scalars} "
                           f"and {doc.get('updated')!r}"[:400])


def _read_file(path: Path) -> bytes:
    """One file of a generated folder: a regular file, not a symbolic link, a folder or a
    device. Opened with O_NOFOLLOW, so a link swapped in after the check is refused too."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise PackageError(f"{path}: missing (fusegen writes it into every op folder; regenerate the "
                           "folder with this fusegen)") from None
    if stat.S_ISLNK(mode):
        raise PackageError(f"{path} is a symbolic link: a generated folder holds regular files only "
                           "(regenerate the folder, or copy the file itself in)")
    if not stat.S_ISREG(mode):
        raise PackageError(f"{path} is not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise PackageError(f"{path}: cannot be read as a regular file ({err.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise PackageError(f"{path} is not a regular file")
        return fh.read()


SETUP_PY = '''\
# Written by `fusegen package`; builds with torch and a compiler alone.
import os

import torch
from setuptools import setup
from torch.utils import cpp_extension

NAME = {name!r}
CUDA = {cuda!r}  # decided by fusegen package (--cuda, or nvcc and a CUDA torch were present)
here = os.path.dirname(os.path.abspath(__file__))
torch_version = torch.__version__.split("+")[0]
if CUDA and torch.version.cuda is None:
    raise RuntimeError("this project was written for a CUDA build; torch here has no CUDA")

# What the wheel was built against: __init__.py refuses another torch (the extension uses
# torch's full C++ API, whose ABI changes with every release) or another CUDA.
with open(os.path.join(here, NAME, "_build_info.py"), "w") as f:
    f.write(f"TORCH_VERSION = {{torch.__version__!r}}\\nCUDA_VERSION = {{torch.version.cuda if CUDA else None!r}}\\n")

# The sources fusegen package wrote, by name: no other file of csrc/ is compiled in.
sources = {sources!r}
cxx = ["-O3"]
if CUDA:
    sources += {cuda_sources!r}
    cxx.append("-DFUSEGEN_WITH_CUDA")
    extension = cpp_extension.CUDAExtension
    flags = {{"cxx": cxx, "nvcc": ["-O3"]}}
else:
    extension = cpp_extension.CppExtension
    flags = {{"cxx": cxx}}

setup(
    name=NAME,
    version={version!r},
    description="Fused elementwise PyTorch ops generated by fusegen: " + ", ".join({ops!r}),
    packages=[NAME],
    # The extension calls no Python API (only the empty module of csrc/fusegen-module.cpp),
    # so it is built against the stable Python ABI: one wheel for CPython >= 3.9 (cp39-abi3).
    ext_modules=[extension(NAME + "._C", sources, extra_compile_args=flags, py_limited_api=True,
                           include_dirs=[os.path.join(here, "csrc")])],
    cmdclass={{"build_ext": cpp_extension.BuildExtension}},
    options={{"bdist_wheel": {{"py_limited_api": "cp39"}}}},
    # numpy: torch imports it when present and warns at every import when it is not
    install_requires=["torch==" + torch_version, "numpy"],
    python_requires=">=3.9",
    zip_safe=False,
)
'''

PYPROJECT = '''\
# Written by `fusegen package`. Build without isolation, so the torch the wheel is built
# against is the one installed here: python -m pip wheel --no-deps --no-build-isolation .
[build-system]
requires = ["setuptools>=70.1", "torch"]
build-backend = "setuptools.build_meta"
'''

MODULE_CPP = '''\
// Written by `fusegen package`: an empty Python module, so that the extension is also
// importable as {name}._C (setuptools builds a Python extension). The ops register from
// their static initializers when {name}/__init__.py loads this library.
#include <Python.h>

static struct PyModuleDef module = {{PyModuleDef_HEAD_INIT, "_C", {doc}, -1, nullptr}};

PyMODINIT_FUNC PyInit__C(void) {{ return PyModule_Create(&module); }}
'''

INIT_PY = '''\
"""Fused ops generated by fusegen: importing this package registers
{registered}
(an elementwise op with its backward and auxiliary ops, a step op with its `_foreach` form
over tensor lists). It needs torch alone, the version it was built against."""

import glob as _glob
import os as _os

import torch as _torch

from ._build_info import CUDA_VERSION, TORCH_VERSION

_NAME = {name}
OPS = {ops}

if _torch.__version__.split("+")[0] != TORCH_VERSION.split("+")[0]:
    raise ImportError(f"{{_NAME}} was built against torch {{TORCH_VERSION}}, but torch {{_torch.__version__}} "
                      "is installed; rebuild the wheel (fusegen package) or install that torch")
if CUDA_VERSION is not None and _torch.version.cuda is None:
    raise ImportError(f"{{_NAME}} was built for CUDA {{CUDA_VERSION}}, but this torch has no CUDA")

_found = sorted(_glob.glob(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "_C*.so")) +
                _glob.glob(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "_C*.pyd")))
if not _found:
    raise ImportError(f"{{_NAME}}: the extension library (_C*.so) is missing next to __init__.py")
_registered = [op for op in OPS if hasattr(_torch.ops.fusegen, op)]
if not _registered:
    _torch.ops.load_library(_found[0])  # its static initializers register the ops
elif len(_registered) != len(OPS):  # one library must not register an op twice
    raise ImportError(f"{{_NAME}}: torch.ops.fusegen.{{_registered[0]}} is already registered in this process "
                      "(by another library built from the same op); load one of them only")
'''


MODULE = "fusegen-module.cpp"  # a hyphen: no op's file (an identifier's) can be called so

# Written into the project: the files fusegen wrote there, which a later run may replace or
# remove. A folder without it that holds anything is not fusegen's to write into.
MARKER = ".fusegen-package.json"

# Every path a marker may list (written by write_project): a later run removes a stale one.
_OWN_PATH = re.compile(r"csrc/(cuda/)?[A-Za-z0-9_][A-Za-z0-9_.-]*|[A-Za-z_][A-Za-z0-9_]*/__init__\.py"
                       r"|setup\.py|pyproject\.toml")


def check_package_name(name: object) -> str:
    """The Python package (and wheel) name: a name as an op's is checked (names.py), since it
    is also pasted into C++ (PyInit__C's module) and a folder name; and not fusegen."""
    problem = names.name_problem(name)
    if problem:
        raise PackageError(f"--name {name!r} {problem} (it is the Python package name)")
    if name == "fusegen":
        raise PackageError("--name 'fusegen' is fusegen's own package; pick another Python package name")
    return name


def write_project(folders: list[Path], name: str, project: Path, cuda: bool, force: bool = False) -> list[str]:
    """Write the buildable project into `project`; returns the op names.

    `project` must be new, empty, or written by fusegen package before (MARKER); then the
    files that run wrote are replaced, and those this run does not write are removed (a
    stale source would be compiled in). Other files are left alone, and one in the way of
    a file to write is an error. `force`: write into any folder, replacing the files of
    the names fusegen writes."""
    check_package_name(name)
    ops, chosen = collect([Path(f) for f in folders])
    out: dict[str, bytes] = {}
    for file_name, data in chosen.items():
        if file_name.endswith(".cu"):
            # csrc/cuda/: setuptools names an object after its source's stem, so fma.cu beside
            # fma.cpp would make a second csrc/fma.o (the build fails); includes resolve
            # through include_dirs=[csrc].
            if cuda:
                out[f"csrc/cuda/{file_name}"] = data
            continue
        out[f"csrc/{file_name}"] = data
    doc = c_string("fusegen ops " + ", ".join(ops))
    out[f"csrc/{MODULE}"] = MODULE_CPP.format(name=c_comment(name), doc=doc).encode()
    registered = "\n".join(f"torch.ops.fusegen.{op}" for op in ops)  # identifiers (collect)
    out[f"{name}/__init__.py"] = INIT_PY.format(name=py_string(name), ops=py_strings(ops),
                                                registered=registered).encode()
    sources = sorted(p for p in out if p.endswith(".cpp"))
    cuda_sources = sorted(p for p in out if p.endswith(".cu"))
    out["setup.py"] = SETUP_PY.format(name=name, cuda=cuda, version="0.1.0", ops=ops, sources=sources,
                                      cuda_sources=cuda_sources).encode()
    out["pyproject.toml"] = PYPROJECT.encode()

    earlier = _claimed(project, set(out), force)
    _write_marker(project, earlier | set(out))  # first: a run cut short leaves no file unclaimed
    for path, data in out.items():
        _make_folders(project, path)
        files.write_bytes(project / path, data)
    for path in sorted(earlier - set(out)):
        try:
            os.unlink(project / path)  # a link itself, not its target
        except FileNotFoundError:
            pass
    _write_marker(project, set(out))
    return ops


def _claimed(project: Path, paths: set[str], force: bool) -> set[str]:
    """The files an earlier run wrote into `project` (its marker's list); refuses a
    non-empty folder fusegen did not write, and a file of its own in the way, unless `force`."""
    try:
        mode = os.lstat(project).st_mode
    except FileNotFoundError:
        return set()
    if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
        raise PackageError(f"{project} is {'a symbolic link' if stat.S_ISLNK(mode) else 'not a folder'}; "
                           "fusegen package writes the project into a folder of its own")
    if not any(project.iterdir()):
        return set()
    earlier = _read_marker(project / MARKER)
    if force:
        return earlier or set()
    if earlier is None:
        raise PackageError(f"{project} is not empty and fusegen package did not write it (no {MARKER}); "
                           "pick a new --out, or pass --force to write the project's files into it "
                           "(files of other names are left alone)")
    theirs = sorted(p for p in paths - earlier if os.path.lexists(project / p))
    if theirs:
        raise PackageError(f"{project / theirs[0]} is in the way: fusegen package did not write it "
                           f"(not in {project / MARKER}); move it, or pass --force to replace it")
    return earlier


def _read_marker(path: Path) -> set[str] | None:
    """The files a marker lists, or None for a folder fusegen did not write (no marker, or
    not one of fusegen's: a link, other JSON, a path outside the project's own)."""
    try:
        doc = json.loads(_read_file(path).decode("utf-8"))
    except (PackageError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    listed = doc.get("files") if isinstance(doc, dict) and doc.get("written_by") == "fusegen package" else None
    if not isinstance(listed, list) or not all(isinstance(p, str) and _OWN_PATH.fullmatch(p) for p in listed):
        return None
    return set(listed)


def _write_marker(project: Path, paths: set[str]):
    from fusegen.version import FUSEGEN_VERSION

    project.mkdir(parents=True, exist_ok=True)
    doc = {"written_by": "fusegen package", "fusegen_version": FUSEGEN_VERSION, "files": sorted(paths)}
    files.write_text(project / MARKER, json.dumps(doc, indent=1) + "\n")


def _make_folders(project: Path, path: str):
    """The folders of `path` inside `project`, each a real folder: not a link that would
    send the file elsewhere."""
    folder = project
    for part in Path(path).parent.parts:
        folder = folder / part
        try:
            mode = os.lstat(folder).st_mode
        except FileNotFoundError:
            folder.mkdir()
            continue
        if not stat.S_ISDIR(mode):
            raise PackageError(f"{folder} is {'a symbolic link' if stat.S_ISLNK(mode) else 'not a folder'}; "
                               "fusegen package writes into real folders only")


def build_wheel(project: Path, out: Path) -> Path:
    """`python -m pip wheel --no-deps --no-build-isolation` into `out`; the wheel's path."""
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.whl"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(out), str(project)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        from fusegen.build.builder import first_compiler_error
        log = r.stdout + r.stderr
        first = first_compiler_error(log)  # (file, line, column, message), file None for a linker line
        where = "" if first is None else f"\nfirst error: {f'{first[0]}:{first[1]}: ' if first[0] else ''}{first[3]}"
        tail = "\n".join(log.splitlines()[-40:])
        raise WheelBuildError(f"building the wheel failed:{where}\n{tail}")
    name = project.name
    wheels = sorted(out.glob(f"{name}-*.whl"), key=lambda p: p.stat().st_mtime)
    new = [w for w in wheels if w not in before] or wheels
    if not new:
        raise PackageError(f"pip reported success but no {name}-*.whl is in {out}")
    return new[-1]

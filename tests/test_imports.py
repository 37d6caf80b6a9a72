"""The package's import graph: no cycles, and each stage imports only the stages before it.

Read with `ast` from fusegen/**/*.py, nothing is imported. Every import counts as an edge:
at module level, inside a function (a lazy import, there so that a cached load or `fusegen
cache` stays light) and under `if TYPE_CHECKING:` alike; a lazy import hides a dependency
from the interpreter, not from the design. `from fusegen.x import y` is an edge to the
module fusegen.x.y when there is one, else to fusegen.x. Importing a package's module runs
the package's `__init__` too; those edges are not counted (the stage packages' `__init__`
files are empty, and fusegen/__init__.py imports errors and version only).

The stages, in pipeline order (fusegen/<stage>/), and what each may import besides the base
modules (errors, files, version), which every module may import:

    frontend   reads user text into sympy                     -> ir
    ir         primitives, spec, names: the data              -> (nothing)
    codegen    printer, render                                -> ir
    build      compiler, cache, keys, index                   -> ir.family only (what the
               index keeps of an op family, no sympy: a cached load imports no sympy)
    pytorch    torch.library, autograd, torch.compile, ONNX   -> ir, build
    tools      cli, check, package, reference                 -> anything
    bench      the benchmarks                                 -> anything
    optim      fused optimizers, built with fusegen.fuse      -> anything

The drivers may import everything: api.py, ops.py, the package's __init__ and __main__, and
frontend/decorator.py (the @fused entry point, a driver like api.fuse: it waits for the
first call and builds through api). One function-level exception: pytorch/onnx.py's
`onnx_translations`, a public entry point that names the ops of the process (api's memo,
the @fused functions waiting to be built), imports api and frontend/decorator when called.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fusegen"
BASE = {"fusegen.errors", "fusegen.files", "fusegen.version"}
DRIVERS = {"fusegen", "fusegen.__main__", "fusegen.api", "fusegen.ops", "fusegen.frontend.decorator"}
ALLOWED = {  # stage -> the stages (or single modules) it may import, besides BASE and itself
    "frontend": {"ir"},
    "ir": set(),
    "codegen": {"ir"},
    "build": {"fusegen.ir.family"},
    "pytorch": {"ir", "build"},
    "tools": None,   # anything
    "bench": None,
    "optim": None,
}
# (importer, imported): allowed inside a function only.
LAZY_EXCEPTIONS = {("fusegen.pytorch.onnx", "fusegen.api"), ("fusegen.pytorch.onnx", "fusegen.frontend.decorator")}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = modules()
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def _resolve(name: str) -> str | None:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def imports(module: str) -> list[tuple[str, bool]]:
    """(imported fusegen module, at module level) for every import in `module`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if module in PACKAGES else module.rsplit(".", 1)[0]
    found = []

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package upwards
                    base = ".".join(package.split(".")[:len(package.split(".")) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in MODULES else base)
            for name in targets:
                resolved = _resolve(name) if name.split(".")[0] == "fusegen" else None
                if resolved is not None and resolved != module:
                    found.append((resolved, top))
            visit(child, inner)
    visit(tree, True)
    return found


def edges() -> dict[str, set[str]]:
    out = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _ in imports(m):
            if not (target in PACKAGES and target != "fusegen"):  # a stage package's empty __init__
                out[m].add(target)
    return out


def stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and module in PACKAGES) else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and self-loops."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_reader_sees_the_imports_it_should():
    """The graph is read right: module-level, lazy and `from package import module` edges."""
    assert ("fusegen.build.keys", True) in imports("fusegen.build.builder")
    assert ("fusegen.pytorch.derivatives", False) in imports("fusegen.pytorch.autograd")   # lazy
    assert ("fusegen.ir.primitives", True) in imports("fusegen.frontend.parse")  # from fusegen.ir import primitives
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    found = cycles(edges())
    assert not found, "import cycles (lazy imports count):\n" + "\n".join(" <-> ".join(c) for c in found)


def _allowed(importer: str, target: str, top: bool) -> bool:
    if target in BASE or importer in DRIVERS:
        return True
    if not top and (importer, target) in LAZY_EXCEPTIONS:
        return True
    if target in DRIVERS:
        return stage(importer) in ("tools", "bench", "optim")
    mine, theirs = stage(importer), stage(target)
    if mine is None:  # a top-level module that is neither a driver nor a base module
        return False
    allowed = ALLOWED[mine]
    return allowed is None or theirs == mine or theirs in allowed or target in allowed


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_stage_imports_only_earlier_stages(module):
    bad = sorted({t for t, top in imports(module) if not _allowed(module, t, top)
                  and not (t in PACKAGES and t != "fusegen")})
    assert not bad, f"{module} imports {bad}; its stage {stage(module)!r} may import {ALLOWED.get(stage(module))}"


def test_every_module_has_a_stage_or_a_role():
    """A new top-level module must say where it stands (BASE or DRIVERS), a new stage its rule."""
    for m in MODULES:
        assert m in BASE | DRIVERS or stage(m) in ALLOWED, m

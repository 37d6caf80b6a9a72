"""`pip install .` (not editable) ships the templates: the installed package renders an
op from a directory far from the checkout. pyproject.toml declares what is imported."""

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_plain_install_finds_templates(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True)
    assert (target / "fusegen" / "templates" / "op.cpp.j2").is_file()
    assert (target / "fusegen" / "templates" / "runtime" / "fusegen-registration.cpp").is_file()  # the runtime
    env = dict(os.environ, PYTHONPATH=str(target))
    work = tmp_path / "elsewhere"
    work.mkdir()
    result = subprocess.run([sys.executable, "-m", "fusegen", "a*b+c", "--name", "fma", "--no-build"],
                            cwd=work, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    rendered = (work / "generated" / "fma" / "fma.cu").read_text()
    assert rendered == (ROOT / "generated" / "fma" / "fma.cu").read_text()
    # and it really came from the installed copy, not the checkout
    probe = subprocess.run([sys.executable, "-c", "import fusegen.codegen.render as r; print(r.templates_dir())"],
                           cwd=work, env=env, capture_output=True, text=True, check=True)
    assert str(target) in probe.stdout


def _declared() -> tuple[set[str], set[str], set[str]]:
    """Normalised distribution names pyproject.toml declares: (runtime, the optional
    features' extras, test extra); an extra naming `fusegen[x]` includes extra x."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(reqs):
        out = set()
        for r in reqs:
            name, wanted = re.match(r"([A-Za-z0-9._-]+)(?:\[([^]]*)\])?", r).groups()
            if _normalise(name) == "fusegen":
                out |= names([d for x in wanted.split(",") for d in extras[x.strip()]])
            else:
                out.add(_normalise(name))
        return out

    features = names([r for x, reqs in extras.items() if x != "test" for r in reqs])
    return names(project["dependencies"]), features, names(extras["test"])


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _third_party_imports(files, local: set[str]) -> dict[str, str]:
    """top-level module -> first file importing it, for modules neither stdlib nor local."""
    found = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_pyproject_declares_what_is_imported():
    """A fresh virtualenv with the README's install command has everything: every module the
    package imports is a declared dependency (or, for an optional feature such as ONNX
    export, in that feature's extra), every module the tests import is declared
    (dependency or test extra), and numpy is declared, which torch needs but does not
    install (without it every `fusegen` call printed "Failed to initialize NumPy")."""
    runtime, features, test = _declared()
    assert "numpy" in runtime
    dists = importlib.metadata.packages_distributions()
    tests = ROOT / "tests"
    local = {"fusegen"} | {p.stem for p in tests.rglob("*.py")} | {p.name for p in tests.rglob("*") if p.is_dir()}
    missing = []
    for files, allowed in ((sorted((ROOT / "fusegen").rglob("*.py")), runtime | features),
                           (sorted(tests.rglob("*.py")), runtime | test)):
        for module, where in _third_party_imports(files, local).items():
            owners = {_normalise(d) for d in dists.get(module, [module])}
            if not owners & allowed:
                missing.append(f"{module} (imported by {where})")
    assert not missing, "not declared in pyproject.toml: " + ", ".join(missing)

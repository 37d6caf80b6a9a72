"""The README's commands and code run as written, so they cannot drift.

- The two commands under "Two commands" are the ones `.ci/run` runs, verbatim.
- The first command's `fusegen` call (and a bad expression) prints no third-party warning:
  stderr is empty on success and only fusegen's message on error.
- Every ```python block runs in a fresh interpreter; the one marked `readme-test:
  standalone` builds generated/fma/ with torch alone (fusegen never imported) and matches
  eager PyTorch forward and backward.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUNTIME_DOC = ROOT / "docs" / "runtime.md"  # the standalone build of an op folder
STANDALONE = "readme-test: standalone"


def python_blocks(doc: Path = README) -> list[tuple[str, str]]:
    """(the HTML comment just above it or "", code) for every ```python block."""
    lines = doc.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            mark = lines[i - 1].strip() if i and lines[i - 1].lstrip().startswith("<!--") else ""
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append((mark, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


def two_commands() -> list[str]:
    """The indented commands under "## Two commands", without their comments."""
    text = README.read_text()
    section = text[text.index("## Two commands"):]
    section = section[:section.index("\n## ", 1)]
    commands = [re.sub(r"\s+#.*$", "", line.strip()) for line in section.splitlines()
                if line.startswith("    ") and line.strip()]
    assert len(commands) == 2, commands
    return commands


def env() -> dict[str, str]:
    """The user's environment: no PYTHONWARNINGS, the test run's fusegen cache (conftest)."""
    e = dict(os.environ)
    e.pop("PYTHONWARNINGS", None)
    assert e.get("FUSEGEN_CACHE_DIR"), "tests/conftest.py sets a cache for the test run"
    return e


def fusegen_command() -> list[str]:
    """The `fusegen` console script installed beside this interpreter (python -m fusegen
    when it runs from a checkout without one)."""
    script = Path(sys.executable).parent / "fusegen"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "fusegen"]


def test_ci_runs_the_two_commands():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in two_commands():
        assert command in ci, f".ci/run does not run the README's command {command!r}"
    assert "python3 -m venv" in " ".join(ci)  # a fresh virtualenv, not the machine's packages
    # then the slow tests the README's command leaves out
    assert ci.index("python -m pytest -m slow") > ci.index(two_commands()[1])


def test_cli_prints_no_warning(tmp_path):
    """The README's `fusegen "a*b+c" --name fma` from a fresh directory: nothing on stderr
    (torch without numpy printed a UserWarning here); a bad expression: only fusegen's error."""
    install, _ = two_commands()
    cli = install.split("&&")[-1].split()  # after pip install and fusegen setup
    assert cli[0] == "fusegen"
    args = [a.strip('"') for a in cli[1:]]
    good = subprocess.run([*fusegen_command(), *args], cwd=tmp_path, env=env(), capture_output=True,
                          text=True, timeout=600)
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stderr == "", good.stderr
    assert (tmp_path / "generated" / "fma" / "fma.cpp").is_file()
    bad = subprocess.run([*fusegen_command(), "sigmod(x)", "--no-build"], cwd=tmp_path, env=env(),
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2
    assert bad.stderr.startswith("fusegen: error: unknown function 'sigmod'"), bad.stderr
    assert "warn" not in bad.stderr.lower() and "Traceback" not in bad.stderr, bad.stderr


def test_python_examples_run(tmp_path):
    """Each ```python block (but the standalone one) as a script: @fused reads its source."""
    blocks = [code for mark, code in python_blocks() if STANDALONE not in mark]
    assert blocks and any("fusegen.fuse(" in code for code in blocks)
    for i, code in enumerate(blocks):
        script = tmp_path / f"readme_example_{i}.py"
        script.write_text(code)
        r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env(), capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"README block {i} failed:\n{code}\n{r.stdout}{r.stderr}"
        # a first build says when it starts and ends; nothing else may reach stderr
        others = [line for line in r.stderr.splitlines()
                  if not re.fullmatch(r"fusegen: (building .* for CPU(\+CUDA)?\.\.\.|built .* in [0-9.]+ s)", line)]
        assert others == [], r.stderr


CHECK = textwrap.dedent("""
    # appended by tests/test_readme.py
    assert not any(m == "fusegen" or m.startswith("fusegen.") for m in sys.modules), "fusegen was imported"
    a, b, c = (torch.randn(33, 7, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = torch.ops.fusegen.fma(a, b, c)
    torch.testing.assert_close(out, a * b + c)
    g = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (a, b, c), g), torch.autograd.grad(a * b + c, (a, b, c), g)):
        torch.testing.assert_close(got, want)
    # second order, fused in the standalone library too (fma_grad2 is among its sources)
    ga, gb, gc = torch.autograd.grad(torch.ops.fusegen.fma(a, b, c), (a, b, c), g, create_graph=True)
    gga, ggb = torch.autograd.grad((ga * gb).sum(), (a, b))
    torch.testing.assert_close(gga, g * g * b)
    torch.testing.assert_close(ggb, g * g * a)
    # third order: not fused, and without fusegen's Python side an error naming the op
    ga, gb, gc = torch.autograd.grad(torch.ops.fusegen.fma(a, b, c), (a, b, c), g, create_graph=True)
    gga, ggb = torch.autograd.grad((ga * gb).sum(), (a, b), create_graph=True)
    try:
        torch.autograd.grad((gga * gga).sum(), (a, b))
        raise AssertionError("third order of a standalone build should raise")
    except NotImplementedError as err:
        assert "fusegen::fma_grad2: the derivative of its backward" in str(err), err
    print("standalone ok")
""")


@pytest.mark.slow
def test_standalone_build_runs(tmp_path):
    """The marked block of docs/runtime.md, run from a folder holding a copy of
    generated/fma/ and generated/_runtime/ (so nothing but their files is on the include path)."""
    (code,) = [code for mark, code in python_blocks(RUNTIME_DOC) if STANDALONE in mark]
    assert 'glob.glob("generated/fma/*.cpp")' in code  # the op, its auxiliary ops
    assert 'glob.glob("generated/_runtime/*.cpp")' in code  # and the runtime
    shutil.copytree(ROOT / "generated" / "fma", tmp_path / "generated" / "fma")
    shutil.copytree(ROOT / "generated" / "_runtime", tmp_path / "generated" / "_runtime")
    script = tmp_path / "standalone.py"
    script.write_text("import sys\n" + code + CHECK)
    e = dict(env(), TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))  # not ~/.cache
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=e, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "standalone ok" in r.stdout

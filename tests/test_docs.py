"""The documentation stays a user guide and the tree speaks of the product only.

- README.md is at most README_MAX_LINES lines; the reference lives in docs/ and
  CONTRIBUTING.md.
- Every relative link in the Markdown files, and every `docs/...` path they name, exists.
- No tracked text file (outside generated/) reads like a development diary: no work
  periods, ticket numbers, machine allowances or ordinal runs (the words are in DIARY).
  pytest's fixture scope and request attribute and onnxruntime's inference object are
  code, and allowed (ALLOWED).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 450
MARKDOWN = ["README.md", "CONTRIBUTING.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

# Spelt in pieces, so that this file does not match itself in a plain grep of the tree.
DIARY = re.compile("|".join((r"\bsess" r"ions?\b", "device " "budget", "work" "place", r"\biss" r"ue [0-9]+",
                             r"\bfif" r"th\b", r"\bfour" r"th\b", "next " "engineer")), re.IGNORECASE)
ALLOWED = re.compile(r'InferenceSession|\bsession\.(get_inputs|get_outputs|run)\(|\bsession = ')
SKIPPED_DIRS = {".git", "generated", "__pycache__", ".pytest_cache", "build", "dist"}


def tracked_files() -> list[Path]:
    """The files git tracks (or, without git, every file but build outputs and generated/)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        files = [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        files = [p for p in ROOT.rglob("*") if p.is_file()
                 and not SKIPPED_DIRS & set(p.relative_to(ROOT).parts) and ".egg-info" not in str(p)]
    return [p for p in files if p.is_file() and p.relative_to(ROOT).parts[0] != "generated"]


def diary_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each line that speaks of the development process."""
    return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1)
            if DIARY.search(ALLOWED.sub("", line))]


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference to docs/"


@pytest.mark.parametrize("name", MARKDOWN)
def test_links_and_paths_exist(name):
    path = ROOT / name
    text = path.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        target = target.split("#")[0]
        if target and not re.match(r"[a-z]+:", target) and not (path.parent / target).exists():
            missing.append(target)
    for named in re.findall(r"\bdocs/[\w./-]*\w", text):
        if not (ROOT / named).exists():
            missing.append(named)
    assert not missing, f"{name} links to missing files: {sorted(set(missing))}"


def test_readme_links_the_reference():
    text = (ROOT / "README.md").read_text()
    for target in ("docs/architecture.md", "docs/benchmarks.md", "CONTRIBUTING.md"):
        assert f"]({target})" in text, target


def test_no_development_diary_in_the_tree():
    here = Path(__file__).resolve()
    found = []
    for path in tracked_files():
        if path.resolve() == here:  # its own patterns
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        found += [f"{path.relative_to(ROOT)}:{i}: {line[:120]}" for i, line in diary_lines(text)]
    assert not found, "development-process wording (say what the product does, and why):\n" + "\n".join(found)


def test_the_diary_check_catches_and_allows():
    assert diary_lines("Measured in the fif" "th sess" "ion")
    assert diary_lines("see iss" "ue 7's targets")
    assert diary_lines("The device " "budget was spent")
    assert diary_lines('@pytest.fixture(scope="sess' 'ion")')
    assert not diary_lines("s = onnxruntime.InferenceSession(path)")
    assert not diary_lines("    sess" "ion = onnxruntime.InferenceSession(proto)")  # an ONNX runtime's
    assert not diary_lines("return sess" "ion.run(None, feeds)")
    assert diary_lines("for item in request.sess" "ion.items:")
    assert not diary_lines("the cache is built once per test run")

"""generated/ is what fusegen emits today, byte for byte, and emits the same twice.

Only the seed folders are checked: a folder a user added by running the CLI is theirs.

To update after a deliberate template change: FUSEGEN_UPDATE_GOLDEN=1 pytest tests/test_golden.py
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fusegen.api import Request, generate
from fusegen.files import RUNTIME_FOLDER, runtime_files, write

from corpus import GOLDEN, GOLDEN_STEPS, step_cli_args

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated"

# The one seed table (tests/corpus.py): generated/<name>/ -> expression; and the step ops'.
SEEDS = GOLDEN
STEPS = GOLDEN_STEPS


def render(name: str) -> dict:
    """What fusegen renders today for the seed or step op `name`."""
    if name in STEPS:
        from fusegen.api import generate_step
        from fusegen.frontend.statements import parse_program
        program, inputs, scalars = STEPS[name]
        return generate_step(parse_program(program, inputs=inputs, scalars=scalars), name)[1]
    return generate(Request(SEEDS[name], name=name)).files


def test_generated_holds_every_seed():
    """Every seed has its folder; other folders (a user's `fusegen ... --name mine`) are ignored."""
    assert [n for n in sorted(SEEDS) + sorted(STEPS) if not (GENERATED / n).is_dir()] == []


@pytest.mark.parametrize("name", sorted(SEEDS) + sorted(STEPS))
def test_golden(name):
    files = render(name)
    if os.environ.get("FUSEGEN_UPDATE_GOLDEN") == "1":
        write(files, GENERATED / name)
    on_disk = {p.name: p.read_bytes() for p in (GENERATED / name).iterdir() if p.is_file()}
    assert sorted(on_disk) == sorted(files), "generated/ holds other files than fusegen renders"
    for fname, text in files.items():
        assert on_disk[fname] == text.encode(), f"generated/{name}/{fname} differs from what fusegen renders now"


def test_golden_runtime():
    """generated/_runtime/ is the one copy of the runtime (templates/runtime/) that every
    op folder of generated/ builds with, byte for byte."""
    folder = GENERATED / RUNTIME_FOLDER
    if os.environ.get("FUSEGEN_UPDATE_GOLDEN") == "1":
        write(runtime_files(), folder)
    on_disk = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert sorted(on_disk) == sorted(runtime_files()), "generated/_runtime/ holds other files than the runtime"
    for fname, text in runtime_files().items():
        assert on_disk[fname] == text.encode(), f"generated/{RUNTIME_FOLDER}/{fname} differs from templates/runtime/"
    assert not [p for p in GENERATED.glob("*/fusegen-*") if p.parent != folder], "a runtime copy in an op folder"


def test_a_folder_the_user_added_does_not_fail_the_golden_test(tmp_path, monkeypatch):
    """The golden tests, run on a generated/ that holds the seeds and a folder the user
    added with the CLI, pass; and they still catch a changed byte or a stray file in a
    seed folder. (The seeds are rendered here, so this holds while generated/ lags.)"""
    from fusegen.tools.cli import main

    for name, expr in SEEDS.items():
        assert main([expr, "--name", name, "--out", str(tmp_path), "--no-build"]) == 0
    for name in STEPS:
        assert main(step_cli_args(name) + ["--out", str(tmp_path), "--no-build"]) == 0
    assert main(["x*y + 1", "--name", "users_op", "--out", str(tmp_path), "--no-build"]) == 0
    monkeypatch.setattr(sys.modules[__name__], "GENERATED", tmp_path)
    monkeypatch.delenv("FUSEGEN_UPDATE_GOLDEN", raising=False)
    test_generated_holds_every_seed()
    test_golden("fma")
    test_golden("adamw_step")
    with open(tmp_path / "fma" / "fma.cu", "ab") as fh:
        fh.write(b" ")
    with pytest.raises(AssertionError, match="fma.cu differs"):
        test_golden("fma")
    (tmp_path / "add" / "notes.txt").write_text("mine\n")
    with pytest.raises(AssertionError, match="other files"):
        test_golden("add")
    shutil.rmtree(tmp_path / "silu")
    with pytest.raises(AssertionError):
        test_generated_holds_every_seed()


def test_output_is_identical_across_processes(tmp_path):
    """A fresh interpreter (new hash seed) renders the same bytes: nothing depends on
    dict/set order or on the process."""
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        env = dict(os.environ, PYTHONHASHSEED=seed)
        subprocess.run([sys.executable, "-m", "fusegen", SEEDS["gelu_tanh"], "--name", "gelu_tanh",
                        "--no-build", "--out", str(out)], check=True, env=env, capture_output=True)
        outs.append({p.name: p.read_bytes() for p in (out / "gelu_tanh").iterdir()})
    assert outs[0] == outs[1]
    assert outs[0]["gelu_tanh.cu"] == (GENERATED / "gelu_tanh" / "gelu_tanh.cu").read_bytes()


def test_step_op_output_is_identical_across_processes(tmp_path):
    """A step op's folder, written by the CLI in two fresh interpreters, is the same bytes
    as generated/'s."""
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        env = dict(os.environ, PYTHONHASHSEED=seed)
        subprocess.run([sys.executable, "-m", "fusegen", *step_cli_args("adamw_step"), "--no-build", "--out",
                        str(out)], check=True, env=env, capture_output=True)
        outs.append({p.name: p.read_bytes() for p in (out / "adamw_step").iterdir()})
    assert outs[0] == outs[1]
    assert outs[0] == {p.name: p.read_bytes() for p in (GENERATED / "adamw_step").iterdir()}

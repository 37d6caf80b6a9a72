"""generated/ is what fusegen emits today, byte for byte, and emits the same twice.

To update after a deliberate template change: FUSEGEN_UPDATE_GOLDEN=1 pytest tests/test_golden.py
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusegen.api import Request, generate
from fusegen.parse import parse
from fusegen.render import write

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated"

# The articles' examples: name -> (expression, scalars).
SEEDS = {
    "fma": "a*b+c",
    "addmul": "(x+y)*w",
    "add": "a+b",
    "masked_add": "(x+y)*((x+y)>0)",
    "mul_add_mul": "(a*b)+(a*c)",
    "silu": "x*sigmoid(x)",
    "gelu_tanh": "0.5*x*(1+tanh(0.7978845608*(x+0.044715*x*x*x)))",
}


def test_generated_holds_exactly_the_seeds():
    assert sorted(p.name for p in GENERATED.iterdir() if p.is_dir()) == sorted(SEEDS)


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_golden(name):
    files = generate(Request(SEEDS[name], name=name)).files
    if os.environ.get("FUSEGEN_UPDATE_GOLDEN") == "1":
        write(files, GENERATED / name)
    on_disk = {p.name: p.read_text() for p in (GENERATED / name).iterdir() if p.is_file()}
    assert sorted(on_disk) == sorted(files), "generated/ holds other files than fusegen renders"
    for fname, text in files.items():
        assert on_disk[fname] == text, f"generated/{name}/{fname} differs from what fusegen renders now"


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

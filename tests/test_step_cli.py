"""Step ops through the CLI, generated folders and `fusegen package`: `fusegen PROGRAM` writes
generated/<name>/ (the step op's files and a spec.json of "kind": "step") and loads it,
fusegen.load(folder) loads it back, and a package takes it beside elementwise ops, its
spec.json checked as theirs are."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import fusegen
from fusegen.pytorch.step import FusedStep
from fusegen.tools import package
from fusegen.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
SGD = "m = beta*m + g; p = p - lr*m"


def sgd_args(name: str, out: Path, *extra) -> list[str]:
    return [SGD, "--name", name, "--inputs", "p,g,m", "--scalar", "lr", "--scalar", "beta", "--out", str(out),
            *extra]


def eager_sgd(p, g, m, lr, beta):
    m.copy_(beta * m + g)
    p.copy_(p - lr * m)


def test_cli_writes_the_step_folder(tmp_path, capsys):
    assert main(sgd_args("t_cli_sgd_files", tmp_path, "--no-build")) == 0
    out = capsys.readouterr().out
    assert "torch.ops.fusegen.t_cli_sgd_files(p, g, m, lr, beta) -> ()" in out
    assert "update   m <- beta*m + g" in out and "t_cli_sgd_files_foreach" in out
    folder = tmp_path / "t_cli_sgd_files"
    assert sorted(p.name for p in folder.iterdir()) == [
        "spec.json", "t_cli_sgd_files.cpp", "t_cli_sgd_files.cu", "t_cli_sgd_files.h"]
    doc = json.loads((folder / "spec.json").read_text())
    assert (doc["kind"], doc["inputs"], doc["scalars"], doc["updated"]) == ("step", ["p", "g", "m"], ["lr", "beta"],
                                                                            ["p", "m"])
    assert (tmp_path / "_runtime" / "fusegen-step.cpp").is_file()
    # the same program again rewrites the folder; another program under the name is refused
    assert main(sgd_args("t_cli_sgd_files", tmp_path, "--no-build")) == 0
    assert main(sgd_args("t_cli_sgd_files", tmp_path, "--no-build") + ["--scalar", "wd"]) == 2  # wd unused
    other = ["p = p - lr*g", "--name", "t_cli_sgd_files", "--scalar", "lr", "--out", str(tmp_path), "--no-build"]
    assert main(other) == 2
    assert "holds op 't_cli_sgd_files'" in capsys.readouterr().err
    assert main(other + ["--force"]) == 0


@pytest.mark.parametrize("flag", ["--check", "--bench"])
def test_check_and_bench_are_refused_for_a_step_op(tmp_path, capsys, flag):
    assert main(sgd_args("t_cli_sgd_refused", tmp_path, flag)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fusegen: error: {flag} compares an op's result") and "updates p, m in place" in err
    assert not (tmp_path / "t_cli_sgd_refused").exists()


def test_cli_builds_and_load_reads_the_folder(tmp_path, capsys):
    assert main(sgd_args("t_cli_sgd", tmp_path)) == 0
    assert "library  " in capsys.readouterr().out
    step = fusegen.load(str(tmp_path / "t_cli_sgd"))
    assert isinstance(step, FusedStep) and step.updated == ("p", "m")
    assert fusegen.load("t_cli_sgd") is step is fusegen.load(tmp_path / "t_cli_sgd" / "spec.json")
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(17, generator=gen, dtype=torch.float64) for _ in range(3)]
    ref = [t.clone() for t in ours]
    step(*ours, lr=0.1, beta=0.9)
    eager_sgd(*ref, lr=0.1, beta=0.9)
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_a_doctored_step_folder_is_refused_by_load(tmp_path):
    assert main(sgd_args("t_cli_sgd_doctored", tmp_path, "--no-build")) == 0
    spec = tmp_path / "t_cli_sgd_doctored" / "spec.json"
    doc = json.loads(spec.read_text())
    spec.write_text(json.dumps(dict(doc, inputs=["p", "g", "m", "v"])))
    with pytest.raises(fusegen.errors.FusegenError, match="'v' is not used"):
        fusegen.load(str(tmp_path / "t_cli_sgd_doctored"))


# -- fusegen package ------------------------------------------------------------------------------

def _copy(name: str, tmp_path: Path) -> Path:
    folder = tmp_path / "in" / name
    shutil.copytree(ROOT / "generated" / name, folder)
    shutil.copytree(ROOT / "generated" / "_runtime", folder.parent / "_runtime", dirs_exist_ok=True)
    return folder


def _edit_spec(folder: Path, **changes):
    doc = json.loads((folder / "spec.json").read_text())
    doc.update(changes)
    (folder / "spec.json").write_text(json.dumps(doc))


def test_a_step_op_is_packaged_beside_elementwise_ops(tmp_path):
    folders = [ROOT / "generated" / "fma", ROOT / "generated" / "adamw_step"]
    assert package.write_project(folders, "myops", tmp_path / "myops", cuda=True) == ["fma", "adamw_step"]
    csrc = tmp_path / "myops" / "csrc"
    assert (csrc / "adamw_step.cpp").read_bytes() == (ROOT / "generated" / "adamw_step" / "adamw_step.cpp").read_bytes()
    assert (csrc / "adamw_step.h").is_file() and (csrc / "cuda" / "adamw_step.cu").is_file()
    assert (csrc / "fusegen-step.cpp").is_file()
    assert "'adamw_step'" in (tmp_path / "myops" / "myops" / "__init__.py").read_text()


@pytest.mark.parametrize("changes, match", [
    ({"expression": "import os; m = beta1*m + (1-beta1)*g"}, "unsupported statement"),
    ({"expression": "m = __import__('os')"}, "unknown function '__import__'"),
    ({"expression": "p = p - lr*g"}, "not used"),
    ({"expression": "p*g + m*v + lr+beta1+beta2+eps+wd+bc1+bc2"}, "updates no input"),
    ({"expression": ["p = p"]}, "must be a string"),
    ({"updated": ["p"]}, "not the recorded"),
    ({"inputs": ["p", "g", "m", "v; import os"]}, "identifier"),
    ({"scalars": "lr"}, "list of names"),
    ({"auxiliary_ops": {"adamw_step_grad2": {}}}, "no auxiliary ops"),
    ({"kind": "other"}, "'kind' must be"),
    ({"name": "adamw_step_foreach"}, "must not end in '_foreach'"),
    ({"name": 'x"\nimport os'}, "op name"),
], ids=["statement", "call", "unused input", "no update", "not text", "updated", "bad input", "scalars not a list",
        "auxiliary", "kind", "foreach name", "name"])
def test_a_doctored_step_spec_is_refused(tmp_path, changes, match):
    folder = _copy("adamw_step", tmp_path)
    _edit_spec(folder, **changes)
    with pytest.raises(package.PackageError, match=match):
        package.write_project([folder], "myops", tmp_path / "p", cuda=False)
    assert not (tmp_path / "p").exists()


def test_only_a_step_op_s_own_files_are_read(tmp_path):
    folder = _copy("adamw_step", tmp_path)
    (folder / "extra.cpp").write_text("#error not fusegen's\n")
    package.write_project([folder], "myops", tmp_path / "p", cuda=False)
    assert not (tmp_path / "p" / "csrc" / "extra.cpp").exists()
    (folder / "adamw_step.h").unlink()
    (folder / "adamw_step.h").symlink_to(tmp_path / "in" / "_runtime" / "fusegen-step.h")
    with pytest.raises(package.PackageError, match=r"adamw_step\.h is a symbolic link"):
        package.write_project([folder], "myops", tmp_path / "q", cuda=False)


def test_a_step_op_and_an_op_named_its_foreach_cannot_share_a_package(tmp_path):
    assert main(["a*b", "--name", "t_pkg_step_foreach", "--out", str(tmp_path), "--no-build"]) == 0
    assert main(["p = p - lr*g", "--name", "t_pkg_step", "--scalar", "lr", "--out", str(tmp_path),
                 "--no-build"]) == 0
    with pytest.raises(package.PackageError, match="cannot share one library"):
        package.write_project([tmp_path / "t_pkg_step", tmp_path / "t_pkg_step_foreach"], "myops",
                              tmp_path / "p", cuda=False)


CHECK = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import stepops
assert not any(m == "fusegen" or m.startswith("fusegen.") for m in sys.modules)
p, g, m, v = (torch.randn(100, dtype=torch.float64) for _ in range(4))
v = v.abs()
ref = [t.clone() for t in (p, g, m, v)]
s = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1, bc1=0.1, bc2=0.001)
torch.ops.fusegen.adamw_step(p, g, m, v, *s.values())
rp, rg, rm, rv = ref
rm.copy_(s["beta1"] * rm + (1 - s["beta1"]) * rg)
rv.copy_(s["beta2"] * rv + (1 - s["beta2"]) * rg * rg)
rp.copy_(rp * (1 - s["lr"] * s["wd"]) - s["lr"] * (rm / s["bc1"]) / ((rv / s["bc2"]).sqrt() + s["eps"]))
for a, b in zip((p, m, v), (rp, rm, rv)):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
assert torch.ops.fusegen.fma(torch.ones(2), torch.ones(2), torch.ones(2)).tolist() == [2.0, 2.0]
print("ok")
"""


@pytest.mark.slow
def test_a_packaged_step_op_runs_without_fusegen(tmp_path):
    """The wheel of a step op and an op, unpacked and imported by a torch without fusegen: the
    update matches the statements run eagerly."""
    r = subprocess.run([sys.executable, "-m", "fusegen", "package", str(ROOT / "generated" / "adamw_step"),
                        str(ROOT / "generated" / "fma"), "--name", "stepops", "--out", str(tmp_path / "dist")],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("stepops-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "site")
    check = subprocess.run([sys.executable, "-I", "-c", CHECK, str(tmp_path / "site")], capture_output=True,
                           text=True, cwd=tmp_path, timeout=300)
    assert check.returncode == 0 and check.stdout.strip() == "ok", check.stdout + check.stderr


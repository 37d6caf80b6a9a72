"""`fusegen package`: a wheel of generated/fma and generated/silu, installed into a fresh
virtualenv that has torch and no fusegen, passes opcheck, gradcheck, gradgradcheck and a
forward/backward comparison with eager PyTorch there.

The virtualenv is made without system site packages and torch is installed into it from the
package index (local disk on the CI machine: about a minute, run while the wheel compiles).
A .pth pointing at the dev environment's site-packages would be faster, but that directory
holds fusegen itself (and every package the tests use), so it could not show that the wheel
needs nothing but torch. The checks run with `python -I` from an empty directory: no
PYTHONPATH, no current directory, no user site on sys.path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fusegen.tools import package
ROOT = Path(__file__).resolve().parent.parent

def _clean_env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONWARNINGS")}
    return e


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """(wheel, the fresh venv's python) with the wheel installed."""
    import torch

    tmp = tmp_path_factory.mktemp("package")
    venv = tmp / "venv"
    python = venv / "bin" / "python"
    log = open(tmp / "venv.log", "w")
    # torch at the version the wheel is built against (the dev torch), plus expecttest, which
    # torch.library.opcheck imports
    torch_req = "torch==" + torch.__version__.split("+")[0]
    maker = subprocess.Popen(
        f"{sys.executable} -m venv {venv} && {python} -m pip install --quiet "
        f"--disable-pip-version-check '{torch_req}' expecttest",
        shell=True, stdout=log, stderr=subprocess.STDOUT, env=_clean_env(), cwd=tmp)
    try:
        out = tmp / "dist"
        r = subprocess.run([sys.executable, "-m", "fusegen", "package", str(ROOT / "generated" / "fma"),
                            str(ROOT / "generated" / "silu"), str(ROOT / "generated" / "rope_pair"),
                            "--name", "myops", "--out", str(out)],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr
        (wheel,) = out.glob("myops-*.whl")
        assert wheel.name.endswith("-cp39-abi3-linux_x86_64.whl"), wheel.name  # one wheel, CPython >= 3.9
        assert maker.wait(timeout=900) == 0, (tmp / "venv.log").read_text()[-3000:]
    finally:
        if maker.poll() is None:
            maker.kill()
        log.close()
    r = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)],
                       capture_output=True, text=True, env=_clean_env(), cwd=tmp, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return wheel, python


CHECKS = textwrap.dedent("""
    import importlib.util, sys
    import torch
    import myops

    # nothing from fusegen: not imported, not even importable here
    assert not any(m == "fusegen" or m.startswith("fusegen.") for m in sys.modules)
    assert importlib.util.find_spec("fusegen") is None, importlib.util.find_spec("fusegen")
    assert myops.OPS == ("fma", "silu", "rope_pair"), myops.OPS
    # the ops, their backward and auxiliary ops
    for name in ("fma", "fma_backward", "fma_grad2", "fma_jvp", "silu", "silu_backward", "silu_grad2", "silu_jvp"):
        assert hasattr(torch.ops.fusegen, name), name

    g = torch.Generator().manual_seed(0)
    def sample(n, dtype, grad=True):
        return tuple(torch.randn(5, 7, generator=g, dtype=dtype).requires_grad_(grad) for _ in range(n))

    cases = [(torch.ops.fusegen.fma, 3, lambda a, b, c: a * b + c),
             (torch.ops.fusegen.silu, 1, lambda x: x * torch.sigmoid(x))]
    for op, n, eager in cases:
        for dtype in (torch.float32, torch.float64):
            for grad in (True, False):
                result = torch.library.opcheck(op, sample(n, dtype, grad))
                assert all(v == "SUCCESS" for v in result.values()), (op, result)
        args = sample(n, torch.float64)
        assert torch.autograd.gradcheck(op, args)
        assert torch.autograd.gradgradcheck(op, args)  # second order: the fused _grad2 op
        # forward and backward against eager, float32 and float64, broadcasting
        for dtype in (torch.float32, torch.float64):
            args = tuple(torch.randn(shape, generator=g, dtype=dtype, requires_grad=True)
                         for shape in [(4, 1, 6), (3, 1), (6,)][:n])
            out, want = op(*args), eager(*args)
            torch.testing.assert_close(out, want)
            dout = torch.randn(out.shape, generator=g, dtype=dtype)
            for got, exp in zip(torch.autograd.grad(out, args, dout), torch.autograd.grad(want, args, dout)):
                torch.testing.assert_close(got, exp)
    # forward mode at first order (the fused _jvp op) and torch.func's reverse mode, as eager;
    # the forward mode of a derivative needs fusegen's composite: an error that names the op
    import torch.autograd.forward_ad as fwAD
    for op, n, eager in cases:
        args, tangents = sample(n, torch.float64, False), sample(n, torch.float64, False)
        argnums = tuple(range(n))
        total = lambda f: (lambda *a: f(*a).sum())
        for transform in (lambda f: torch.func.jvp(f, args, tangents),
                          lambda f: torch.func.jacfwd(f, argnums=argnums)(*args),
                          lambda f: torch.func.grad(total(f), argnums=argnums)(*args),
                          lambda f: torch.func.vjp(f, *args)[1](tangents[0])):
            torch.testing.assert_close(transform(op), transform(eager))
        with fwAD.dual_level():
            got = fwAD.unpack_dual(op(*[fwAD.make_dual(a, t) for a, t in zip(args, tangents)]))
            want = fwAD.unpack_dual(eager(*[fwAD.make_dual(a, t) for a, t in zip(args, tangents)]))
        torch.testing.assert_close(tuple(got), tuple(want))
        try:
            torch.func.jacfwd(torch.func.jacfwd(total(op)))(*args)
        except NotImplementedError as err:
            assert "_jvp has no fused forward-mode derivative" in str(err), err
        else:
            raise AssertionError("jacfwd(jacfwd) without fusegen's composite")
    # an op of two outputs: a tuple, both gradients, second order and forward mode, fused
    rope = torch.ops.fusegen.rope_pair
    rope_eager = lambda x1, c, x2, s: (x1 * c - x2 * s, x2 * c + x1 * s)
    args = sample(4, torch.float64)
    result = torch.library.opcheck(rope, args)
    assert all(v == "SUCCESS" for v in result.values()), result
    assert torch.autograd.gradcheck(rope, args) and torch.autograd.gradgradcheck(rope, args)
    for got, want in zip(rope(*args), rope_eager(*args)):
        torch.testing.assert_close(got, want)
    primals, tangents = sample(4, torch.float64, False), sample(4, torch.float64, False)
    torch.testing.assert_close(torch.func.jvp(rope, primals, tangents), torch.func.jvp(rope_eager, primals, tangents))
    print("wheel ok")
""")


@pytest.mark.slow
def test_wheel_in_fresh_venv_without_fusegen(wheel_venv, tmp_path):
    _, python = wheel_venv
    script = tmp_path / "check_wheel.py"
    script.write_text(CHECKS)
    r = subprocess.run([str(python), "-I", str(script)], cwd=tmp_path, env=_clean_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wheel ok" in r.stdout
    assert "NumPy" not in r.stderr, r.stderr  # torch's "Failed to initialize NumPy": numpy came with the wheel


@pytest.mark.slow
def test_wheel_metadata(wheel_venv):
    """The wheel pins the torch it was built against and holds one library."""
    import zipfile

    import torch

    wheel, _ = wheel_venv
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        info = z.read("myops/_build_info.py").decode()
    assert [n for n in names if n.endswith(".so")] == ["myops/_C.abi3.so"]
    assert "Requires-Dist: torch==" + torch.__version__.split("+")[0] in metadata
    assert "Requires-Dist: numpy" in metadata
    assert repr(torch.__version__) in info and "CUDA_VERSION = None" in info


# -- the project it writes (no build: fast) ------------------------------------------------------

def test_project_has_one_runtime_and_each_op_once(tmp_path):
    folders = [ROOT / "generated" / "fma", ROOT / "generated" / "silu", ROOT / "generated" / "fma"]
    ops = package.write_project(folders, "myops", tmp_path / "myops", cuda=False)
    assert ops == ["fma", "silu"]
    csrc = sorted(p.name for p in (tmp_path / "myops" / "csrc").iterdir())
    assert set(package.RUNTIME) <= set(csrc)  # from generated/_runtime/, once
    assert [n for n in csrc if n.endswith(".cpp")] == [
        "fma.cpp", "fma_grad2.cpp", "fma_jvp.cpp", "fusegen-autograd.cpp", "fusegen-launch.cpp", "fusegen-layout.cpp",
        "fusegen-module.cpp", "fusegen-registration.cpp", "fusegen-rtc.cpp", "fusegen-step.cpp", "silu.cpp",
        "silu_grad2.cpp", "silu_jvp.cpp"]
    assert not any(n.endswith(".cu") for n in csrc)
    package.write_project(folders, "myops", tmp_path / "cuda", cuda=True)
    assert (tmp_path / "cuda" / "csrc" / "cuda" / "fma.cu").is_file()  # not beside fma.cpp: one fma.o each
    assert "CUDA = True" in (tmp_path / "cuda" / "setup.py").read_text()


def test_project_requires_torch_and_numpy(tmp_path):
    """numpy is a requirement: without it every `import torch` of the installed wheel warns
    "Failed to initialize NumPy"."""
    import ast

    package.write_project([ROOT / "generated" / "fma"], "myops", tmp_path / "myops", cuda=False)
    tree = ast.parse((tmp_path / "myops" / "setup.py").read_text())
    (setup,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"]
    (requires,) = [k.value for k in setup.keywords if k.arg == "install_requires"]
    names = [ast.unparse(e) for e in requires.elts]
    assert names == ["'torch==' + torch_version", "'numpy'"]


def test_project_errors(tmp_path):
    with pytest.raises(package.PackageError, match="not a generated op folder"):
        package.write_project([tmp_path], "myops", tmp_path / "p", cuda=False)
    with pytest.raises(package.PackageError, match="Python package name"):
        package.write_project([ROOT / "generated" / "fma"], "my-ops", tmp_path / "p", cuda=False)
    # a folder whose runtime differs from the others': one library cannot hold two runtimes
    import shutil
    other = tmp_path / "silu"
    shutil.copytree(ROOT / "generated" / "silu", other)
    shutil.copytree(ROOT / "generated" / "_runtime", tmp_path / "_runtime")
    (tmp_path / "_runtime" / "fusegen-layout.cpp").write_text("// another version\n")
    with pytest.raises(package.PackageError, match="the runtime must be the same"):
        package.write_project([ROOT / "generated" / "fma", other], "myops", tmp_path / "p", cuda=False)
    # the runtime beside the op folders: missing, or a link to another folder, is refused
    shutil.rmtree(tmp_path / "_runtime")
    with pytest.raises(package.PackageError, match="_runtime: missing"):
        package.write_project([other], "myops", tmp_path / "p", cuda=False)
    (tmp_path / "_runtime").symlink_to(ROOT / "generated" / "_runtime")
    with pytest.raises(package.PackageError, match="_runtime is a symbolic link"):
        package.write_project([other], "myops", tmp_path / "p", cuda=False)


def test_cli_package_no_build(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fusegen", "package", str(ROOT / "generated" / "fma"),
                        "--name", "myops", "--out", str(tmp_path), "--no-build"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "project" in r.stdout and (tmp_path / "myops" / "setup.py").is_file()
    bad = subprocess.run([sys.executable, "-m", "fusegen", "package", str(tmp_path), "--name", "myops",
                          "--out", str(tmp_path / "o")], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("fusegen: error:"), bad.stderr



# -- a generated folder is untrusted input ---------------------------------------------------------

def _copy(name: str, tmp_path: Path) -> Path:
    import shutil
    folder = tmp_path / "in" / name
    shutil.copytree(ROOT / "generated" / name, folder)
    shutil.copytree(ROOT / "generated" / "_runtime", folder.parent / "_runtime", dirs_exist_ok=True)
    return folder


def _edit_spec(folder: Path, **changes):
    import json
    doc = json.loads((folder / "spec.json").read_text())
    doc.update(changes)
    (folder / "spec.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("name", [
    'fma"\nimport os; os.system("touch PWNED")\n"',   # code in __init__.py
    "fma); system(\"touch PWNED\"",                     # code in the C++ module
    "__fma", "int", "fma_jvp", "fma-x", None, 3,
])
def test_a_doctored_op_name_is_refused(tmp_path, name):
    folder = _copy("fma", tmp_path)
    _edit_spec(folder, name=name)
    with pytest.raises(package.PackageError, match=r"spec\.json: (op name|name must not end)"):
        package.write_project([folder], "myops", tmp_path / "p", cuda=False)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("changes, match", [
    ({"expression": "__import__('os').system('touch PWNED')"}, "only named functions can be called"),
    ({"expression": "a*b"}, "not used"),                         # the inputs recorded: a, b, c
    ({"expression": "a*b+c+d"}, "inputs"),
    ({"expression": "a = a*b\nreturn a"}, "one line"),
    ({"expression": ["a*b+c"]}, "must be a string"),
    ({"inputs": ["a", "b", "c; import os"]}, "identifier"),
    ({"inputs": "a,b,c"}, "list of names"),
    ({"auxiliary_ops": {"fma_grad2": {}, "evil": {}}}, "auxiliary_ops"),
], ids=["call", "unused input", "other input", "newline", "not text", "bad input", "inputs not a list",
        "other auxiliary op"])
def test_a_doctored_spec_is_refused(tmp_path, changes, match):
    folder = _copy("fma", tmp_path)
    _edit_spec(folder, **changes)
    with pytest.raises(package.PackageError, match=match):
        package.write_project([folder], "myops", tmp_path / "p", cuda=False)


def test_op_files_are_what_fusegen_writes():
    """The allowlist of a folder's files is exactly what the render stage writes."""
    import json
    for name in ("fma", "add"):
        doc = json.loads((ROOT / "generated" / name / "spec.json").read_text())
        expected = package.op_files(name, list(doc["auxiliary_ops"])) + ["spec.json"]
        runtime = [f for f in expected if f in package.RUNTIME]
        assert sorted(set(expected) - set(runtime)) == sorted(os.listdir(ROOT / "generated" / name))
        assert sorted(runtime) == sorted(os.listdir(ROOT / "generated" / "_runtime"))


def test_a_fused_function_body_is_read_back(tmp_path):
    """A @fused body flattened into spec.json (`t = ...; expr`) is re-parsed as a body."""
    folder = _copy("fma", tmp_path)
    _edit_spec(folder, expression="t = a*b; t + c")
    assert package.write_project([folder], "myops", tmp_path / "p", cuda=False) == ["fma"]
    _edit_spec(folder, expression="t = a*b; import os; t + c")
    with pytest.raises(package.PackageError, match="name = expression"):
        package.write_project([folder], "myops", tmp_path / "q", cuda=False)


def test_a_symbolic_link_in_a_folder_is_refused_by_name(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the key\n")
    folder = _copy("fma", tmp_path)
    (folder / "fma_jvp.h").unlink()
    (folder / "fma_jvp.h").symlink_to(secret)
    with pytest.raises(package.PackageError, match=r"fma_jvp\.h is a symbolic link"):
        package.write_project([folder], "myops", tmp_path / "p", cuda=False)
    assert not (tmp_path / "p").exists()
    folder = _copy("silu", tmp_path)
    (folder / "spec.json").rename(tmp_path / "spec.json")
    (folder / "spec.json").symlink_to(tmp_path / "spec.json")
    with pytest.raises(package.PackageError, match=r"spec\.json is a symbolic link"):
        package.write_project([folder], "myops", tmp_path / "p", cuda=False)


def test_only_regular_files_of_fusegen_s_names_are_read(tmp_path):
    folder = _copy("fma", tmp_path)
    (folder / "fma.h").unlink()
    os.mkfifo(folder / "fma.h")  # a read would block, or read another process's bytes
    with pytest.raises(package.PackageError, match=r"fma\.h is not a regular file"):
        package.write_project([folder], "myops", tmp_path / "p", cuda=False)
    folder = _copy("silu", tmp_path)
    (folder / "silu_grad2.cu").unlink()
    with pytest.raises(package.PackageError, match=r"silu_grad2\.cu: missing"):
        package.write_project([folder], "myops", tmp_path / "p", cuda=False)
    # files fusegen does not write are neither read nor copied, links among them included
    folder = _copy("fma", tmp_path / "stray")
    (folder / "evil.cpp").write_text('static int x = system("touch PWNED");\n')
    (folder / "fma_extra.cpp").symlink_to(tmp_path / "nowhere")
    (folder / "notes.txt").write_text("mine\n")
    package.write_project([folder], "myops", tmp_path / "p", cuda=True)
    written = sorted(str(p.relative_to(tmp_path / "p" / "csrc")) for p in (tmp_path / "p" / "csrc").rglob("*")
                     if p.is_file())
    assert written == sorted(["cuda/" + f if f.endswith(".cu") else f for f in package.op_files("fma", [
        "fma_grad2", "fma_jvp"])] + ["fusegen-module.cpp"])


def test_values_reach_the_project_as_literals_and_identifiers(tmp_path):
    """__init__.py, setup.py and the C++ module hold the names as literals that parse back to
    them, and setup.py compiles exactly the sources fusegen wrote."""
    import ast

    package.write_project([ROOT / "generated" / "fma", ROOT / "generated" / "add"], "myops", tmp_path / "p",
                          cuda=True)
    def constants(path: Path) -> dict:
        """Module-level `NAME = <str, or a tuple or list of str>`, read from the syntax tree."""
        found = {}
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                value = node.value
                if isinstance(value, ast.Constant):
                    found[node.targets[0].id] = value.value
                elif isinstance(value, (ast.Tuple, ast.List)) and \
                        all(isinstance(e, ast.Constant) for e in value.elts):
                    found[node.targets[0].id] = [e.value for e in value.elts]
        return found

    init = constants(tmp_path / "p" / "myops" / "__init__.py")
    assert init["_NAME"] == "myops" and init["OPS"] == ["fma", "add"]
    cpp = sorted(f"csrc/{f}" for f in os.listdir(tmp_path / "p" / "csrc") if f.endswith(".cpp"))
    assert constants(tmp_path / "p" / "setup.py")["sources"] == cpp
    assert "csrc/cuda/fma_jvp.cu" in setup_text(tmp_path / "p") and "glob" not in setup_text(tmp_path / "p")
    module = (tmp_path / "p" / "csrc" / "fusegen-module.cpp").read_text()
    assert '"_C", "fusegen ops fma, add", -1' in module


def setup_text(project: Path) -> str:
    return (project / "setup.py").read_text()


# -- --out over an existing folder ---------------------------------------------------------------

FMA, SILU = ROOT / "generated" / "fma", ROOT / "generated" / "silu"


def test_a_folder_fusegen_did_not_write_is_refused(tmp_path):
    project = tmp_path / "myops"
    (project / "csrc").mkdir(parents=True)
    (project / "setup.py").write_text("# my own project\n")
    (project / "csrc" / "mine.cpp").write_text("int mine;\n")
    with pytest.raises(package.PackageError, match="not empty and fusegen package did not write it"):
        package.write_project([FMA], "myops", project, cuda=False)
    assert (project / "setup.py").read_text() == "# my own project\n"
    assert sorted(p.name for p in project.rglob("*")) == ["csrc", "mine.cpp", "setup.py"]
    # --force: fusegen's files written over it, the others left alone and not compiled in
    package.write_project([FMA], "myops", project, cuda=False, force=True)
    assert (project / "csrc" / "mine.cpp").read_text() == "int mine;\n"
    assert "fusegen package" in setup_text(project) and "csrc/mine.cpp" not in setup_text(project)
    # an empty folder is anyone's
    (tmp_path / "empty").mkdir()
    package.write_project([FMA], "myops", tmp_path / "empty", cuda=False)


def test_a_project_fusegen_wrote_is_replaced_file_by_file(tmp_path):
    import json

    project = tmp_path / "myops"
    package.write_project([FMA, SILU], "myops", project, cuda=True)
    (project / "csrc" / "notes.txt").write_text("mine\n")
    (project / "myops" / "extra.py").write_text("MINE = 1\n")
    (project / "csrc" / "fma.cpp").write_text("// edited\n")
    package.write_project([FMA], "myops", project, cuda=False)
    assert (project / "csrc" / "notes.txt").read_text() == "mine\n"     # not fusegen's: kept
    assert (project / "myops" / "extra.py").read_text() == "MINE = 1\n"
    assert (project / "csrc" / "fma.cpp").read_bytes() == (FMA / "fma.cpp").read_bytes()  # fusegen's: replaced
    assert not (project / "csrc" / "silu.cpp").exists()                 # stale: removed
    assert not any((project / "csrc" / "cuda").iterdir())
    marker = json.loads((project / package.MARKER).read_text())
    assert "csrc/fma.cpp" in marker["files"] and "csrc/silu.cpp" not in marker["files"]
    # a file of the user's where fusegen would now write: refused, unless --force
    (project / "csrc" / "silu.cpp").write_text("// my silu\n")
    with pytest.raises(package.PackageError, match=r"silu\.cpp is in the way"):
        package.write_project([FMA, SILU], "myops", project, cuda=False)
    assert (project / "csrc" / "silu.cpp").read_text() == "// my silu\n"
    package.write_project([FMA, SILU], "myops", project, cuda=False, force=True)
    assert (project / "csrc" / "silu.cpp").read_bytes() == (SILU / "silu.cpp").read_bytes()


def test_a_marker_that_is_not_fusegen_s_counts_as_none(tmp_path):
    import json

    project = tmp_path / "myops"
    project.mkdir()
    (project / "setup.py").write_text("# mine\n")
    for doc in ({"written_by": "fusegen package", "files": ["../outside.txt"]},
                {"written_by": "fusegen package", "files": ["/etc/passwd"]}, ["setup.py"], "x"):
        (project / package.MARKER).write_text(json.dumps(doc))
        with pytest.raises(package.PackageError, match="did not write it"):
            package.write_project([FMA], "myops", project, cuda=False)
    (project / package.MARKER).unlink()
    (project / package.MARKER).symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(package.PackageError, match="did not write it"):
        package.write_project([FMA], "myops", project, cuda=False)


def test_links_in_the_project_are_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    project = tmp_path / "myops"
    package.write_project([FMA], "myops", project, cuda=False)
    import shutil
    shutil.rmtree(project / "csrc")
    (project / "csrc").symlink_to(elsewhere)
    with pytest.raises(package.PackageError, match=r"csrc is a symbolic link"):
        package.write_project([FMA], "myops", project, cuda=False)
    assert not any(elsewhere.iterdir())


def test_cli_package_refuses_a_foreign_folder_without_force(tmp_path, capsys):
    from fusegen.tools.cli import main

    project = tmp_path / "myops"
    project.mkdir()
    (project / "setup.py").write_text("# mine\n")
    argv = ["package", str(FMA), "--name", "myops", "--out", str(tmp_path), "--no-build"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--force" in err and err.startswith("fusegen: error:"), err
    assert (project / "setup.py").read_text() == "# mine\n"
    assert main(argv + ["--force"]) == 0, capsys.readouterr().err
    assert "fusegen package" in setup_text(project)


def test_cli_package_exit_status_is_the_errors_class(tmp_path, capsys, monkeypatch):
    """A wheel that fails to build is a failed build (1), as an op's is; a folder that is
    not an op is a bad argument (2). The class decides, not the message."""
    from fusegen.tools.cli import main

    def fail(project, out):
        raise package.WheelBuildError("pip said no")

    monkeypatch.setattr(package, "build_wheel", fail)
    assert main(["package", str(FMA), "--name", "myops", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == "fusegen: error: pip said no\n"
    monkeypatch.setattr(package, "build_wheel", lambda project, out: (_ for _ in ()).throw(
        package.PackageError("building the wheel failed, says the message")))
    assert main(["package", str(FMA), "--name", "myops", "--out", str(tmp_path)]) == 2
    assert main(["package", str(tmp_path), "--name", "myops", "--out", str(tmp_path / "o"), "--no-build"]) == 2
    assert "not a generated op folder" in capsys.readouterr().err


def test_package_name_is_checked_as_an_op_name_is(tmp_path):
    for bad in ["my-ops", "class", "__x", "caf\u00e9", 'x"\nimport os']:
        with pytest.raises(package.PackageError, match="Python package name"):
            package.write_project([FMA], bad, tmp_path / "p", cuda=False)
    with pytest.raises(package.PackageError, match="fusegen's own package"):
        package.write_project([FMA], "fusegen", tmp_path / "p", cuda=False)

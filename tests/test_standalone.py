"""What `fusegen --out DIR` writes builds with torch and a compiler alone: a fresh
interpreter that never imports fusegen compiles generated/fma (the op and the shared
runtime copied beside it, into one library) with cpp_extension, loads it, and gets
eager's answer, forward and backward."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch.utils.cpp_extension import load
    load(name="standalone_fma", sources=[sys.argv[1] + "/fma.cpp", sys.argv[1] + "/fusegen-runtime.cpp"],
         build_directory=sys.argv[2], is_python_module=False, extra_cflags=["-O2"])
    assert not any(m.startswith("fusegen") for m in sys.modules), "fusegen was imported"
    a, b, c = (torch.randn(33, 7, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = torch.ops.fusegen.fma(a, b, c)
    torch.testing.assert_close(out, a * b + c)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (a, b, c), g)
    want = torch.autograd.grad(a * b + c, (a, b, c), g)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)
    print("standalone ok")
""")


def test_generated_folder_builds_without_fusegen(tmp_path):
    # Copy the folder, so nothing but its own files is on the include path.
    src = tmp_path / "fma"
    src.mkdir()
    for f in (ROOT / "generated" / "fma").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    build = tmp_path / "build"
    build.mkdir()
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(build)],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "standalone ok" in result.stdout

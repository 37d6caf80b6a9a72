"""`pip install .` (not editable) ships the templates: the installed package renders an
op from a directory far from the checkout."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_plain_install_finds_templates(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True)
    assert (target / "fusegen" / "templates" / "op.cpp.j2").is_file()
    assert (target / "fusegen" / "templates" / "fusegen-runtime.cpp").is_file()  # the shared runtime
    env = dict(os.environ, PYTHONPATH=str(target))
    work = tmp_path / "elsewhere"
    work.mkdir()
    result = subprocess.run([sys.executable, "-m", "fusegen", "a*b+c", "--name", "fma", "--no-build"],
                            cwd=work, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    rendered = (work / "generated" / "fma" / "fma.cu").read_text()
    assert rendered == (ROOT / "generated" / "fma" / "fma.cu").read_text()
    # and it really came from the installed copy, not the checkout
    probe = subprocess.run([sys.executable, "-c", "import fusegen.render as r; print(r.templates_dir())"],
                           cwd=work, env=env, capture_output=True, text=True, check=True)
    assert str(target) in probe.stdout

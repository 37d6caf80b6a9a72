"""Shipping on the GPU machine: the CUDA wheel of `fusegen package` and AOTInductor on CUDA.

The CPU twins (tests/test_package.py, tests/test_export.py) run in CI. Here the wheel is
built with CUDAExtension (nvcc and a CUDA torch are present, so `fusegen package` writes a
CUDA project), installed with --no-deps into a folder of its own and checked by a
`python -I` process started in an empty directory: no PYTHONPATH, no current directory, so
fusegen is not importable there, only torch (the machine's) and the wheel's package.

Run on the GPU machine: PYTHONPATH=. python3 -m pytest -q -m cuda tests/gpu/test_ship_cuda.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]

CHECKS = textwrap.dedent("""
    import importlib.util, sys
    sys.path.insert(0, SITE)
    import torch
    import myops

    assert importlib.util.find_spec("fusegen") is None, importlib.util.find_spec("fusegen")
    assert myops.OPS == ("fma", "silu"), myops.OPS
    g = torch.Generator(device="cuda").manual_seed(0)

    def sample(n, dtype, grad=True, shape=(5, 7)):
        return tuple(torch.randn(shape, generator=g, device="cuda", dtype=dtype).requires_grad_(grad)
                     for _ in range(n))

    cases = [(torch.ops.fusegen.fma, 3, lambda a, b, c: a * b + c),
             (torch.ops.fusegen.silu, 1, lambda x: x * torch.sigmoid(x))]
    for op, n, eager in cases:
        for dtype in (torch.float32, torch.float64):
            result = torch.library.opcheck(op, sample(n, dtype))
            assert all(v == "SUCCESS" for v in result.values()), (op, result)
        args = sample(n, torch.float64)
        assert torch.autograd.gradcheck(op, args)
        assert torch.autograd.gradgradcheck(op, args)
        for dtype in (torch.float32, torch.bfloat16):
            args = sample(n, dtype, shape=(1 << 20) + 3)
            out, want = op(*args), eager(*(a.float() for a in args)).to(dtype)
            assert out.device.type == "cuda" and out.dtype == dtype
            torch.testing.assert_close(out, want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
            dout = torch.randn(out.shape, generator=g, device="cuda", dtype=dtype)
            for got, exp in zip(torch.autograd.grad(out, args, dout), torch.autograd.grad(eager(*args), args, dout)):
                torch.testing.assert_close(got, exp, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=2e-2)
    print("cuda wheel ok")
""")


def test_cuda_wheel_without_fusegen(tmp_path):
    out = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "fusegen", "package", str(ROOT / "generated" / "fma"),
                        str(ROOT / "generated" / "silu"), "--name", "myops", "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("myops-*.whl")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                        "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    import zipfile
    with zipfile.ZipFile(wheel) as z:
        info = z.read("myops/_build_info.py").decode()
    assert f"CUDA_VERSION = {torch.version.cuda!r}" in info, info
    empty = tmp_path / "empty"
    empty.mkdir()
    script = empty / "check.py"
    script.write_text(f"SITE = {str(site)!r}\n" + CHECKS)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    r = subprocess.run([sys.executable, "-I", str(script)], cwd=empty, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cuda wheel ok" in r.stdout
    print(wheel.name, f"{wheel.stat().st_size / 1e6:.1f} MB")


def test_aoti_package_runs_on_cuda(tmp_path):
    """torch.export of a model with fused ops on CUDA, compiled by AOTInductor into a .pt2
    package, loaded and run; the fused ops stay calls to the registered CUDA kernels. Each
    variant in a process of its own (tests/gpu/aoti_probe.py), so that a crash is a failure
    with its output, and a control without fusegen ops tells AOTInductor's own faults apart."""
    results = {}
    for variant in ("control", "fused"):
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "aoti_probe.py"), variant, str(tmp_path)],
                           capture_output=True, text=True, timeout=600)
        results[variant] = (r.returncode, r.stdout[-2000:] + r.stderr[-4000:])
    if results["control"][0] != 0:
        # The machine's AOTInductor is broken (the H200 image of 2026-12-01 segfaults in
        # aoti_load_package): the fused variant cannot be judged there.
        pytest.xfail(f"AOTInductor fails here without fusegen ops (rc {results['control'][0]}): "
                     f"{results['control'][1][-500:]}")
    assert results["fused"][0] == 0, results["fused"][1]

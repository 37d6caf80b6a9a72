"""The tiled CUDA kernel's index math, run on the CPU: templates/runtime/'s CUDA headers compiled
with g++ against tests/emulated/cuda_runtime.h (a block's threads as std::threads, a
barrier for __syncthreads), its launches rewritten as calls, over a*b+c loops whose
layouts take each access width (tests/emulated/tiled_check.cpp): every output element, the
memory around it, the P chosen and (AddressSanitizer) every load's bounds are checked. No
GPU needed; the GPU runs such layouts in tests/gpu/test_cuda.py (kernel paths)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EMULATED = ROOT / "tests" / "emulated"

# The header's pieces g++ cannot take, each with its host stand-in: fp16's PTX conversions
# (fp16 is not run here: bf16 takes the same kernels) and the launch syntax.
REWRITES = [
    (re.escape('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.x));'), 'f = 0; emulator_lacks("fp16");'),
    (re.escape('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(x));'), 'h.x = 0; (void)x; emulator_lacks("fp16");'),
    (re.escape("extern __shared__ __align__(16) unsigned char tile_bytes[];"), ""),
    (re.escape("extern __shared__ float column_sums[];"), ""),
    (r"([\w:]+(?:<[^;<>]*(?:<[^;<>]*>[^;<>]*)*>)?)\s*<<<(.*?)>>>\((.*?)\);", r"emulate_launch(\1, \2, \3);"),
]


def _emulated_headers(headers: dict[str, str]) -> dict[str, str]:
    """The runtime's CUDA headers with each REWRITES pattern replaced wherever it occurs."""
    headers = dict(headers)
    for pattern, replacement in REWRITES:
        total = 0
        for name, text in headers.items():
            headers[name], count = re.subn(pattern, replacement, text, flags=re.S)
            total += count
        assert total > 0, f"the CUDA headers no longer have {pattern!r}: update REWRITES"
    assert not any("<<<" in text for text in headers.values())
    return headers


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_tiled_kernel_emulated(tmp_path):
    runtime = ROOT / "templates" / "runtime"
    for path in runtime.glob("*.h"):
        shutil.copy(path, tmp_path / path.name)
    for name, text in _emulated_headers({p.name: p.read_text() for p in runtime.glob("*.cuh")}).items():
        (tmp_path / name).write_text(text)
    shutil.copy(ROOT / "generated" / "fma" / "fma.h", tmp_path / "fma.h")
    exe = tmp_path / "tiled_check"
    # AddressSanitizer: a load past an operand's last element (an unchecked edge tile) fails.
    # The kernels and the launchers in one host build (fusegen-math.h's FUSEGEN_DEVICE_CODE).
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-fsanitize=address,undefined", "-fno-sanitize-recover",
                    "-DFUSEGEN_DEVICE_CODE=1", "-DFUSEGEN_HOST_CODE=1", f"-I{EMULATED}", f"-I{tmp_path}", str(EMULATED / "tiled_check.cpp"), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and lines[-1] == "0 failed", run.stdout + run.stderr
    assert sum(line.startswith("ok ") for line in lines) == 30, run.stdout  # 15 cases, bf16 and fp32

"""Every generated .cu compiles with nvcc (compile only: CI has no GPU), warning-free.

The .cu files include no torch headers, so this needs only the CUDA toolkit. On a machine
without nvcc the test skips, except in CI (CI=true), where a missing nvcc is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
from corpus import GOLDEN, GOLDEN_STEPS  # noqa: E402  (tests/ is on sys.path via conftest)

# Every seed's and golden step op's kernels; folders a user added to generated/ are not ours to compile.
KERNELS = [ROOT / "generated" / name / f"{name}.cu" for name in sorted(GOLDEN) + sorted(GOLDEN_STEPS)]
RUNTIME = ROOT / "generated" / "_runtime"  # the headers every op's sources include
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
# The architectures we ship for (H100/H200 and A100), warnings as errors.
FLAGS = ["-std=c++17", "-O3", "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_80,code=sm_80",
         "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra"]


def _require_nvcc():
    if NVCC is None:
        if os.environ.get("CI") == "true":
            pytest.fail("nvcc not found: CI must compile the generated CUDA sources")
        pytest.skip("nvcc not found")


def _compile(cu: Path, out_dir: Path, *extra: str):
    obj = out_dir / (cu.parent.name + ".o")
    return subprocess.run([NVCC, *FLAGS, *extra, f"-I{RUNTIME}", "-c", str(cu), "-o", str(obj)],
                          capture_output=True, text=True)


def test_every_seed_has_its_kernels():
    missing = [str(cu) for cu in KERNELS if not cu.is_file()]
    assert not missing and len(KERNELS) == len(GOLDEN) + len(GOLDEN_STEPS) == 13, missing


@pytest.mark.slow
def test_every_generated_cu_compiles(tmp_path):
    _require_nvcc()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda cu: _compile(cu, tmp_path), KERNELS))
    failures = [f"{cu}:\n{r.stderr}" for cu, r in zip(KERNELS, results) if r.returncode != 0 or r.stderr.strip()]
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
def test_the_wide_random_accumulating_kernel_compiles(tmp_path):
    """The eight-element accumulating kernel of a 16-bit backward that draws
    (FUSEGEN_RANDOM_ACCUMULATING_WIDE, on by default) compiles warning-free, without spills."""
    _require_nvcc()
    cu = ROOT / "generated" / "bias_dropout_add" / "bias_dropout_add.cu"
    r = _compile(cu, tmp_path, "-Xptxas", "-v")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    wide = [i for i, line in enumerate(lines)
            if "Compiling entry function" in line and "accumulating_kernelINS_8BFloat16ELi8E" in line]
    assert wide, "no eight-element bf16 accumulating kernel was compiled"
    for i in wide:  # ptxas: the entry, its properties, its stack frame and spills, its registers
        spills = next(line for line in lines[i + 1:i + 4] if "spill stores" in line)
        assert "0 bytes spill stores" in spills, lines[i:i + 4]
    assert not [line for line in lines if "warning" in line.lower()]


def test_cold_op_units_split_its_own_cu_by_three_dtype_groups(monkeypatch):
    """A cold op on 16 cores: its own .cu as 6 units, each auxiliary op's (plain kernels)
    as 4, so that no unit waits for a core."""
    from fusegen.build import builder as build
    folder = ROOT / "generated" / "fma"
    files = {f.name: f.read_text() for f in folder.iterdir() if f.suffix in (".cu", ".cpp")}
    monkeypatch.setenv("FUSEGEN_CUDA_COMPILER", "nvcc")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    units = [t for n, t in build._units([("fma", files)], cuda=True).items() if n.endswith(".cu")]
    per_cu = {cu: sum(f'/{cu}"' in t for t in units) for cu in ("fma.cu", "fma_grad2.cu", "fma_jvp.cu")}
    assert per_cu == {"fma.cu": 6, "fma_grad2.cu": 4, "fma_jvp.cu": 4} and len(units) <= 16


@pytest.mark.slow
def test_cuda_host_code_compiles(tmp_path):
    """The CUDA half of the shared runtime (under FUSEGEN_WITH_CUDA: device guard, stream,
    launch check) compiles against torch's c10/cuda headers, together with the CUDA half
    of every <name>.cpp (launcher declarations and adapters, no torch header).

    The CPU wheel of torch ships those headers but not the one file CMake generates for a
    CUDA build, c10/cuda/impl/cuda_cmake_macros.h (a single #define), so we write it."""
    from torch.utils.cpp_extension import include_paths

    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    cuda_include = next((Path(h) / "include" for h in homes
                         if h and (Path(h) / "include" / "cuda_runtime_api.h").is_file()), None)
    if cuda_include is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CUDA headers not found: CI must compile the CUDA host code")
        pytest.skip("CUDA toolkit not found")
    macros = tmp_path / "cfg" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    macros.parent.mkdir(parents=True)
    macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    from fusegen.build.builder import RUNTIME_UNITS, _runtime_units
    units = sorted((ROOT / "generated" / "_runtime").glob("*.cpp"))
    assert sorted(u.name for u in units) == sorted(RUNTIME_UNITS)
    # The runtime's units are translation units of their own, and on a machine of few cores
    # all but one share one (builder._runtime_units); the ops' .cpp files go in one more.
    # cuda_runtime_api.h first: the ops' own spelling of cudaStream_t must agree with CUDA's.
    shared = [[ROOT / "generated" / "_runtime" / line.split('"')[1] for line in text.splitlines()]
              for text in _runtime_units(2).values() if text is not None]
    assert len(shared) == 1 and len(shared[0]) == len(RUNTIME_UNITS) - 1
    bundles = [[u] for u in units] + shared + [[cu.with_suffix(".cpp") for cu in KERNELS]]
    includes = [f"-isystem{p}" for p in [tmp_path / "cfg", *include_paths("cpu"), cuda_include]]
    includes.append(f"-I{ROOT / 'generated' / '_runtime'}")

    def check(k):
        bundle = tmp_path / f"bundle{k}.cpp"
        bundle.write_text("#include <cuda_runtime_api.h>\n" + "".join(f'#include "{u}"\n' for u in bundles[k]))
        return subprocess.run([os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra",
                               "-DFUSEGEN_WITH_CUDA", *includes, str(bundle)], capture_output=True, text=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(check, range(len(bundles))))
    failures = [r.stderr for r in results if r.returncode != 0 or r.stderr.strip()]
    assert not failures, "\n\n".join(failures)


_FWD, _BWD = "FUSEGEN_FORWARD_ONLY", "FUSEGEN_BACKWARD_ONLY"
_WIDE, _16, _FP16, _BF16 = "FUSEGEN_WIDE_ONLY", "FUSEGEN_16BIT_ONLY", "FUSEGEN_FP16_ONLY", "FUSEGEN_BF16_ONLY"


@pytest.mark.slow
@pytest.mark.parametrize("cores, macros", [
    (2, [(_FWD,), (_BWD,)]),
    (4, [(_FWD, _WIDE), (_FWD, _16), (_BWD, _WIDE), (_BWD, _16)]),
    (16, [(_FWD, _WIDE), (_FWD, _16, _FP16), (_FWD, _16, _BF16), (_BWD, _WIDE), (_BWD, _16, _FP16), (_BWD, _16, _BF16)]),
], ids=["by direction", "by direction and dtype", "by direction, fp16 and bf16 apart"])
def test_split_units_define_each_entry_point_once(tmp_path, monkeypatch, cores, macros):
    """With cores to spare, build._units compiles an op's .cu as two units (forward
    kernels, backward kernels), four (each by dtype group) or six (fp16 and bf16 apart),
    that together define each entry point and each 16-bit launcher exactly once."""
    if NVCC is None:
        if os.environ.get("CI") == "true":
            pytest.fail("nvcc not found: CI must compile the generated CUDA sources")
        pytest.skip("nvcc not found")
    from fusegen.build import builder as build
    folder = ROOT / "generated" / "addmul"
    files = {"addmul.cu": (folder / "addmul.cu").read_text(), "addmul.cpp": (folder / "addmul.cpp").read_text()}
    monkeypatch.setenv("FUSEGEN_CUDA_COMPILER", "nvcc")
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    units = {name: text for name, text in build._units([("addmul", files)], cuda=True).items() if name.endswith(".cu")}
    assert [tuple(line[len("#define "):] for line in text.splitlines() if line.startswith("#define"))
            for text in units.values()] == macros
    entries = [f"op_addmul::{d}_cuda{g}(" for d in ("forward", "backward") for g in ("", "_fp16", "_bf16")]
    defined = []
    for name, text in units.items():
        (tmp_path / name).write_text(text)
        obj = tmp_path / (name + ".o")
        result = subprocess.run([NVCC, *FLAGS[:3], "-Werror", "all-warnings", f"-I{ROOT / 'generated'}",
                                 f"-I{folder}", f"-I{RUNTIME}", "-c", str(tmp_path / name), "-o", str(obj)], capture_output=True, text=True)
        assert result.returncode == 0 and not result.stderr.strip(), result.stderr
        symbols = subprocess.run(["nm", "-C", "--defined-only", str(obj)], capture_output=True, text=True).stdout
        defined += [e for e in entries if e in symbols]
    assert sorted(defined) == sorted(entries)

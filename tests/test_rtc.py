"""The NVRTC route without a GPU: an op's launchers compile with the host compiler alone
(FUSEGEN_RTC_HOST), warning-free under -Wpedantic; run against a stand-in for the runtime's
rtc_launch, over loops of every layout kind and dtype, they ask for kernels by name; NVRTC
compiles each of those names from the op's own .cu, as the runtime does on a GPU (the
runtime's options, fusegen-rtc.cpp). tests/gpu/test_rtc_cuda.py runs the route for real.

NVRTC comes from the nvidia-cuda-nvrtc wheel (a test dependency; a CUDA build of torch
brings it anyway). Without it the compile test skips, except in CI (CI=true), where it fails.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fusegen.build import builder

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated"
CXX = os.environ.get("CXX", "c++")
from corpus import GOLDEN, GOLDEN_STEPS  # noqa: E402  (tests/ is on sys.path via conftest)

# The runtime's NVRTC options (fusegen-rtc.cpp), for the architecture of the H100/H200.
OPTIONS = ["--gpu-architecture=sm_90", "-std=c++17", "-default-device", "-DFUSEGEN_WITH_CUDA"]


def _units(monkeypatch, name: str, cores: int = 16) -> dict[str, str]:
    """An op's launch units, as an op of more operands than the runtime's launchers take
    (kMaxLaunchedOperands) gets them: its launchers of its own."""
    monkeypatch.setenv("FUSEGEN_CUDA_COMPILER", "nvrtc")
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(builder, "LAUNCHED_MARK", "\0")  # in no .cpp
    folder = GENERATED / name
    files = {f.name: f.read_text() for f in folder.iterdir() if f.suffix in (".cu", ".cpp")}
    return {u: text for u, text in builder._units([(name, files)], cuda=True).items()
            if u.endswith("_launch.cpp")}


def _compile(unit: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([CXX, "-std=c++17", "-Wall", "-Wextra", "-Wpedantic", "-Werror", "-DFUSEGEN_WITH_CUDA",
                           f"-I{GENERATED}", f"-I{GENERATED / '_runtime'}", *flags, str(unit)],
                          capture_output=True, text=True)


@pytest.mark.parametrize("cores", [2, 16])
def test_launch_units_define_each_entry_point_and_source_once(tmp_path, monkeypatch, cores):
    """The launch units of an op (split by direction and dtype group with cores to spare)
    compile warning-free and together define each CUDA entry point and the op's
    rtc_source() exactly once."""
    units = _units(monkeypatch, "addmul", cores)
    assert units and all("#define FUSEGEN_RTC_HOST\n" in t for t in units.values())
    entries = [f"op_addmul::{d}_cuda{g}(" for d in ("forward", "backward") for g in ("", "_fp16", "_bf16")]
    entries += [f"op_addmul{aux}::rtc_source()" for aux in ("", "_grad2", "_jvp")]
    defined = []
    for name, text in units.items():
        (tmp_path / name).write_text(text)
        obj = tmp_path / (name + ".o")
        result = _compile(tmp_path / name, "-O1", "-c", "-o", str(obj))
        assert result.returncode == 0 and not result.stderr.strip(), result.stderr
        symbols = subprocess.run(["nm", "-C", "--defined-only", str(obj)], capture_output=True, text=True).stdout
        defined += [e for e in entries if re.search(rf" [TtWw] fusegen::{re.escape(e)}", symbols)]
    assert sorted(defined) == sorted(entries)


def _launched_goldens() -> list[str]:
    return sorted(n for n in GOLDEN if builder.LAUNCHED_MARK in (GENERATED / n / f"{n}.cpp").read_text())


@pytest.mark.parametrize("name", _launched_goldens())
def test_a_descriptor_compiled_alone_includes_no_math(tmp_path, monkeypatch, name):
    """A new op's library on a GPU machine is its descriptor alone (its CPU kernels later,
    its CUDA kernels from NVRTC): that unit compiles warning-free without the op's math or
    <cmath>, most of a new op's build. The unit built whole checks the descriptor's
    written-out launch counts against the functors (a static_assert)."""
    monkeypatch.setenv("FUSEGEN_CUDA_COMPILER", "nvrtc")
    folder = GENERATED / name
    files = {f.name: f.read_text() for f in folder.iterdir() if f.suffix in (".cu", ".cpp")}
    for later in (True, False):
        units = builder._units([(name, files)], cuda=True, later=later)
        assert list(units) == ["unit0.cpp"]
        unit = tmp_path / f"unit_{later}.cpp"
        unit.write_text(units["unit0.cpp"])
        result = _compile(unit, "-fsyntax-only")
        assert result.returncode == 0 and not result.stderr.strip(), result.stderr
        headers = _compile(unit, "-M").stdout.replace("\\\n", " ").split()
        math = [h for h in headers if h.endswith(("/cmath", f"/{name}.h"))]
        assert bool(math) != later, math


# A stand-in for the runtime's NVRTC entry points that prints each kernel a launcher asks
# for, and loops of every kind the launchers tell apart.
HARNESS = r"""
#include <cstdio>
#include <vector>
#include "fusegen-runtime.h"

namespace fusegen {
void rtc_launch(const RtcSource& source, const char* kernel, const RtcShape& shape, cudaStream_t,
                void** params) {
  std::printf("launch %s|%s|%u,%u,%u|%d|%zu|%d\n", source.file, kernel, shape.grid[0], shape.grid[1],
              shape.grid[2], shape.threads, shape.shared, params[0] != nullptr);
}
int rtc_blocks_per_sm(const RtcSource&, const char*, int) { return 4; }
int rtc_sm_count() { return 132; }
}  // namespace fusegen

using fusegen::CudaLoop;
using fusegen::Dtype;
@DECLARATIONS@

namespace {
const int64_t kSize[] = {4, 8, 2, 2};  // by Dtype

// `layout` 0: contiguous; 1: misaligned; 2: a per-row input (repeated); 3: a sliced input
// (gathered); 4: a transposed input (tiled); 5: past 2^31 elements (64-bit offsets);
// 6: a backward's accumulators beside its operands (per-column sums).
void run(fusegen::CudaKernel kernel, Dtype dtype, int operands, int inputs_from, int layout,
         int accumulators_from) {
  const int64_t e = kSize[int(dtype)];
  std::vector<char*> data;
  for (int k = 0; k < operands; ++k) data.push_back(reinterpret_cast<char*>(int64_t(k + 1) << 32));
  std::vector<int64_t> sizes = {1024, 64};
  if (layout == 5) sizes = {int64_t(1) << 16, int64_t(1) << 16};
  std::vector<int64_t> strides;
  for (int d = 0; d < 2; ++d)
    for (int k = 0; k < operands; ++k) {
      const bool sum = accumulators_from >= 0 && k >= accumulators_from;
      int64_t s = d == 0 ? (sum ? 4 : e) : sizes[0] * (sum ? 0 : e);
      if (k == inputs_from && layout == 2) s = d == 0 ? 0 : e;
      if (k == inputs_from && layout == 3 && d == 1) s = (sizes[0] + 3) * e;
      if (k == inputs_from && layout == 4) s = d == 0 ? sizes[1] * e : e;
      strides.push_back(s);
    }
  if (layout == 1) data[inputs_from] += e;
  const bool flat = layout <= 1;
  static const fusegen::Random random;  // an op that draws: its state
  const CudaLoop loop{sizes[0] * sizes[1], flat ? 0 : 2, operands, sizes.data(), strides.data(),
                      data.data(), &random};
  const double scalars[16] = {0.5, 0.25, 2.0, 1.0, 0.5, 0.25, 2.0, 1.0,
                              0.5, 0.25, 2.0, 1.0, 0.5, 0.25, 2.0, 1.0};
  kernel(dtype, loop, scalars, nullptr);
}
}  // namespace

int main() {
  for (int dtype = 0; dtype < 4; ++dtype) {
    for (int layout = 0; layout < 6; ++layout) {
@CALLS@
    }
  }
  return 0;
}
"""


def _harness(tmp_path: Path, name: str, units: dict[str, str], objects=(), lines: bool = False) -> list:
    """Builds the op's launch units with the stand-in runtime (and `objects`), runs them;
    the (source file, kernel) pairs asked for, or with `lines`, every launch's line."""
    header = (GENERATED / name / f"{name}.h").read_text()
    counts = [int(n) for n in re.findall(r"static constexpr int k(?:Inputs|Outputs) = (\d+);", header)]
    ns = f"op_{name}"
    declarations = [f"namespace fusegen::{ns} {{ void forward_cuda(Dtype, const CudaLoop&, const double*, void*); }}"]
    f_in, f_out = counts[0], counts[1]
    calls = [f"      run(fusegen::{ns}::forward_cuda, Dtype(dtype), {f_in + f_out}, {f_out}, layout, -1);"]
    if len(counts) > 2:
        b_in, b_out = counts[2], counts[3]
        declarations.append(f"namespace fusegen::{ns} {{ void backward_cuda(Dtype, const CudaLoop&, const double*, "
                            "void*); }")
        calls.append(f"      run(fusegen::{ns}::backward_cuda, Dtype(dtype), {b_in + b_out}, {b_out}, layout, -1);")
        acc = b_in + b_out
        if "def.backward_accumulates = true;" in (GENERATED / name / f"{name}.cpp").read_text():
            calls.append(f"      if (dtype != 1) run(fusegen::{ns}::backward_cuda, Dtype(dtype), {acc + b_out + 1}, "
                         f"{b_out}, 6, {acc});")
    main = tmp_path / "harness.cpp"
    main.write_text(HARNESS.replace("@DECLARATIONS@", "\n".join(declarations)).replace("@CALLS@", "\n".join(calls)))
    objects = list(objects)
    for unit, text in units.items():
        if f'"{name}/{name}.cu"' not in text:
            continue  # the auxiliary ops' units: compiled by the test above
        (tmp_path / unit).write_text(text)
        objects.append(tmp_path / unit)
    exe = tmp_path / "harness"
    torch_lib = Path(torch.__file__).parent / "lib"
    links = [f"-L{torch_lib}", "-lc10", f"-Wl,-rpath,{torch_lib}"] if objects else []
    result = _compile(main, *map(str, objects), "-O1", "-o", str(exe), *links)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    if lines:
        return sorted(set(run.stdout.splitlines()))
    asked = sorted({tuple(line[len("launch "):].split("|")[:2]) for line in run.stdout.splitlines()})
    assert all(line.endswith("|1") for line in run.stdout.splitlines())  # every launch has parameters
    return asked


def _nvrtc() -> ctypes.CDLL | None:
    """libnvrtc: from the nvidia-cuda-nvrtc wheel (nvidia/cu*/lib, nvidia/cuda_nvrtc/lib), or
    the CUDA toolkit's lib64."""
    candidates = []
    for base in map(Path, sys.path):
        candidates += sorted((base / "nvidia").glob("*/lib/libnvrtc.so*"))
    homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    candidates += [p for h in homes if h for p in sorted(Path(h, "lib64").glob("libnvrtc.so*"))]
    for path in candidates:
        if "builtins" in path.name or "alt" in path.name:
            continue
        try:
            return ctypes.CDLL(str(path))
        except OSError:
            continue
    return None


@pytest.fixture
def lib() -> ctypes.CDLL:
    """libnvrtc, or a skip (a failure in CI)."""
    found = _nvrtc()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("libnvrtc not found (pip install nvidia-cuda-nvrtc): CI must compile the NVRTC route")
        pytest.skip("libnvrtc not found")
    return found


def _nvrtc_compile(lib: ctypes.CDLL, source: Path, kernel: str, options: list[str],
                   check=None) -> str | None:
    """None when NVRTC compiles `kernel` from `source` to a cubin (or, for a
    `--gpu-architecture=compute_*` option, PTX), else its log. `check(lowered name, PTX)`
    looks at a PTX result."""
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    ptx = any(o.startswith("--gpu-architecture=compute_") for o in options)
    program = ctypes.c_void_p()
    text = source.read_bytes()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), text, str(source).encode(), 0, None, None) == 0
    try:
        assert lib.nvrtcAddNameExpression(program, kernel.encode()) == 0
        argv = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        if lib.nvrtcCompileProgram(program, len(options), argv) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            return log.value.decode(errors="replace")
        lowered, size = ctypes.c_char_p(), ctypes.c_size_t()
        assert lib.nvrtcGetLoweredName(program, kernel.encode(), ctypes.byref(lowered)) == 0 and lowered.value
        get_size, get = (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX) if ptx else (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
        assert get_size(program, ctypes.byref(size)) == 0 and size.value > 0
        code = ctypes.create_string_buffer(size.value)
        assert get(program, code) == 0
        if check is not None:
            check(lowered.value.decode(), code.value.decode() if ptx else None)
        return None
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


# The kernels an op's launchers ask for over the harness's loops: every kind, in every dtype.
KINDS = ["contiguous_kernel", "strided_kernel", "vector_kernel", "tiled_kernel", "accumulating_kernel"]


@pytest.mark.parametrize("name", ["fma", "addmul"])
def test_nvrtc_compiles_every_kernel_the_launchers_ask_for(tmp_path, monkeypatch, name, lib):
    asked = _harness(tmp_path, name, _units(monkeypatch, name))
    kernels = [k for _, k in asked]
    assert {f"fusegen::{kind}<" for kind in KINDS} <= {k[:k.index("<") + 1] for k in kernels}, kernels
    for storage in ("float", "double", "fusegen::Half", "fusegen::BFloat16"):
        assert any(f"<{storage}," in k for k in kernels), storage
    assert any("uint64_t>" in k for k in kernels)  # offsets past 2^31
    folder = tmp_path / "entry"
    shutil.copytree(GENERATED / "_runtime", folder / "_runtime")
    shutil.copytree(GENERATED / name, folder / name)
    options = OPTIONS + [f"-I{folder / '_runtime'}", f"-I{folder / name}"]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        logs = list(pool.map(lambda fk: _nvrtc_compile(lib, folder / fk[0], fk[1], options), asked))
    failures = [f"{k}:\n{log}" for (_, k), log in zip(asked, logs) if log is not None]
    assert not failures, "\n\n".join(failures)


def test_nvrtc_compiles_a_step_kernel(tmp_path, lib):
    name = sorted(GOLDEN_STEPS)[0]
    folder = tmp_path / "entry"
    shutil.copytree(GENERATED / "_runtime", folder / "_runtime")
    shutil.copytree(GENERATED / name, folder / name)
    options = OPTIONS + [f"-I{folder / '_runtime'}", f"-I{folder / name}"]
    for t, narrow in (("float", "false"), ("float", "true"), ("double", "false")):
        kernel = f"fusegen::step_kernel<{t}, fusegen::op_{name}::Step<{t}>, {narrow}>"
        assert _nvrtc_compile(lib, folder / name / f"{name}.cu", kernel, options) is None


@pytest.mark.parametrize("name", ["rms_norm", "softmax"])
def test_nvrtc_compiles_the_row_kernels(tmp_path, lib, name):
    """A row op's kernel in every storage type, both row widths (a warp, a block), holding
    the row in registers (1, 2 or 4 vectors a thread) or reading it again, forward and
    backward, and RMSNorm's backward summing its weight's gradient over the rows (an op of
    one input has none), as run_rows_cuda names them."""
    folder = tmp_path / "entry"
    shutil.copytree(GENERATED / "_runtime", folder / "_runtime")
    shutil.copytree(GENERATED / name, folder / name)
    options = OPTIONS + [f"-I{folder / '_runtime'}", f"-I{folder / name}"]
    failures = []
    for storage, acc in (("float", "float"), ("double", "double"), ("fusegen::Half", "float"),
                         ("fusegen::BFloat16", "float")):
        summing = [("Backward", "true")] if name == "rms_norm" else []
        for functor, sums in [("Forward", "false"), ("Backward", "false")] + summing:
            shapes = ([(32, "true", 0), (256, "false", 0)] if sums == "true" else
                      [(32, "true", 4), (256, "true", 1), (256, "true", 2), (256, "false", 0)])
            for threads, vector, cache in shapes:
                kernel = (f"fusegen::rows_kernel<{storage}, fusegen::op_{name}::{functor}<{acc}>, {threads}, "
                          f"{vector}, {sums}, {cache}>")
                log = _nvrtc_compile(lib, folder / name / f"{name}.cu", kernel, options)
                if log is not None:
                    failures.append(f"{kernel}:\n{log}")
    assert not failures, "\n\n".join(failures)


def test_nvrtc_compiles_ptx_for_a_device_newer_than_it(tmp_path, lib):
    """The runtime's fallback for a GPU this NVRTC does not know (fusegen-rtc.cpp,
    target_arch): the newest architecture NVRTC lists below the device's, as PTX, which the
    driver compiles when it loads it. The kernel source compiles that way too, and NVRTC
    lists its architectures (nvrtcGetSupportedArchs)."""
    count = ctypes.c_int()
    assert lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)) == 0 and count.value > 0
    archs = (ctypes.c_int * count.value)()
    assert lib.nvrtcGetSupportedArchs(archs) == 0 and 90 in list(archs)
    folder = tmp_path / "entry"
    shutil.copytree(GENERATED / "_runtime", folder / "_runtime")
    shutil.copytree(GENERATED / "fma", folder / "fma")
    options = ["--gpu-architecture=compute_90"] + OPTIONS[1:] + [f"-I{folder / '_runtime'}", f"-I{folder / 'fma'}"]
    kernel = "fusegen::contiguous_kernel<float, 4, fusegen::op_fma::Forward<float>>"

    def has_entry(lowered: str, ptx: str):
        assert f".entry {lowered}" in ptx

    assert _nvrtc_compile(lib, folder / "fma" / "fma.cu", kernel, options, has_entry) is None


# What the runtime's stand-in leaves to an op's .cpp when the harness links it: its CPU
# kernels' conversions and its registration (never called: the harness launches on CUDA).
STUBS = r"""
#include "fusegen-cpu.h"
#include "fusegen-runtime.h"
namespace fusegen {
bool register_op(const OpDef&) { return true; }
void convert(const Half*, float*, int64_t) {}
void convert(const BFloat16*, float*, int64_t) {}
void convert(const float*, Half*, int64_t) {}
void convert(const float*, BFloat16*, int64_t) {}
}  // namespace fusegen
"""


@pytest.fixture(scope="module")
def runtime_launchers(tmp_path_factory) -> list[Path]:
    """The runtime's launchers (fusegen-launch.cpp), each part as the runtime's build makes
    it, compiled warning-free under -Wpedantic."""
    folder = tmp_path_factory.mktemp("launch")
    units = {u: t for u, t in builder._runtime_units(16, cuda=True).items() if u.startswith("fusegen-launch-")}
    assert len(units) == builder.RUNTIME_LAUNCH_PARTS

    def build(unit: str) -> Path:
        (folder / unit).write_text(units[unit])
        obj = folder / (unit + ".o")
        result = _compile(folder / unit, "-O1", f"-isystem{Path(torch.__file__).parent / 'include'}", "-c",
                          "-o", str(obj))
        assert result.returncode == 0 and not result.stderr.strip(), result.stderr
        return obj

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(build, sorted(units)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fma", "addmul", "rope_pair", "bias_dropout_add"])
def test_runtime_launchers_launch_as_an_ops_own(tmp_path, monkeypatch, name, runtime_launchers):
    """An op built for the NVRTC route has no launcher code: its .cpp (with FUSEGEN_RTC_FILE,
    as the build's unit defines it) hands each loop to the runtime's launchers, which ask for
    the very kernels, grids, blocks and shared memory its own launchers ask for, over every
    layout kind and dtype (forward, backward, the accumulating backward)."""
    monkeypatch.setenv("FUSEGEN_CUDA_COMPILER", "nvrtc")
    folder = GENERATED / name
    files = {f.name: f.read_text() for f in folder.iterdir() if f.suffix in (".cu", ".cpp")}
    units = builder._units([(name, files)], cuda=True)
    assert not any(u.endswith("_launch.cpp") for u in units)  # no launcher of its own
    (unit,) = [t for u, t in units.items() if u.endswith(".cpp")]
    assert f'#define FUSEGEN_RTC_FILE "{name}/{name}.cu"\n#include "{name}/{name}.cpp"' in unit
    (tmp_path / "stubs.cpp").write_text(STUBS)
    (tmp_path / "op.cpp").write_text(unit)
    objects = []
    for source in ("stubs.cpp", "op.cpp"):
        obj = tmp_path / (source + ".o")
        result = _compile(tmp_path / source, "-O1", "-c", "-o", str(obj))
        assert result.returncode == 0 and not result.stderr.strip(), result.stderr
        objects.append(obj)
    for variant in ("launched", "own"):
        (tmp_path / variant).mkdir()
    launched = _harness(tmp_path / "launched", name, {}, objects + runtime_launchers, lines=True)
    own = _harness(tmp_path / "own", name, _units(monkeypatch, name), lines=True)
    assert launched and launched == own

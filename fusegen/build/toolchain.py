"""What a build runs with: whether it builds for CUDA, the CUDA toolkit, the GPU
architectures and the compiler flags (builder.py compiles with them, keys.py hashes them)."""

from __future__ import annotations

import os
import shutil
import sys
from functools import lru_cache

import torch

# -fno-math-errno: C math functions that never set errno, so the CPU loop vectorizes them
# (libmvec below) and sqrt is one instruction; values are unchanged.
CXX_FLAGS = ["-O3", "-Wall", "-fno-math-errno"]
# Accurate math by default: no --use_fast_math, so results match eager PyTorch.
NVCC_FLAGS = ["-O3"]  # cpp_extension adds the -std= that matches torch


def cuda_enabled() -> bool:
    """Build the CUDA impls when torch sees a GPU and nvcc is there. FUSEGEN_CPU_ONLY=1
    forces the CPU-only build (the same generated files, without FUSEGEN_WITH_CUDA)."""
    if os.environ.get("FUSEGEN_CPU_ONLY") == "1" or torch.version.cuda is None or not torch.cuda.is_available():
        return False
    return cuda_home() is not None


# How the CUDA kernels of an op built in the process (fuse, @fused, the CLI's cache build)
# are compiled: "nvrtc", by the runtime on each kernel's first launch, with the NVRTC library
# torch loads (the op's library holds its launchers, compiled by the host compiler); or
# "nvcc", every kernel ahead of time into the op's library. generated/ folders and packaged
# wheels always build with nvcc. Both compile the same sources with the same flags.
CUDA_COMPILER_ENV = "FUSEGEN_CUDA_COMPILER"
CUDA_COMPILERS = ("nvrtc", "nvcc")


def cuda_compiler() -> str:
    value = os.environ.get(CUDA_COMPILER_ENV) or CUDA_COMPILERS[0]
    if value not in CUDA_COMPILERS:
        from fusegen.errors import BuildError
        raise BuildError(f"fusegen: {CUDA_COMPILER_ENV} must be one of {', '.join(CUDA_COMPILERS)}, "
                         f"got {value!r}")
    return value


def cuda_home() -> str | None:
    """The CUDA toolkit, found as torch.utils.cpp_extension finds CUDA_HOME ($CUDA_HOME or
    $CUDA_PATH, then the nvcc on the PATH, then /usr/local/cuda), without importing it: it
    imports setuptools, 0.13 s that a cached load on the GPU machine must not pay (measured
    there with cProfile)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home is None:
        nvcc = shutil.which("nvcc")
        home = os.path.dirname(os.path.dirname(nvcc)) if nvcc else "/usr/local/cuda"
    return home if os.path.exists(home) else None


def compilers(cuda: bool) -> list[tuple[str, str]]:
    """(role, command) of each compiler a build runs, as cpp_extension picks them: $CXX or
    c++; for CUDA, $PYTORCH_NVCC or $CUDA_HOME/bin/nvcc and nvcc's host compiler ($CC,
    which cpp_extension passes as -ccbin, else $NVCC_CCBIN, else gcc)."""
    tools = [("c++", os.environ.get("CXX") or "c++")]
    if cuda:
        nvcc = os.environ.get("PYTORCH_NVCC") or os.path.join(cuda_home() or "/usr/local/cuda", "bin", "nvcc")
        tools += [("nvcc", nvcc), ("host", os.environ.get("CC") or os.environ.get("NVCC_CCBIN") or "gcc")]
    return tools


def cuda_arch_flags() -> list[str]:
    """-gencode for every visible GPU's architecture (e.g. sm_90 on an H200), or for
    TORCH_CUDA_ARCH_LIST when set ("9.0;8.0")."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        archs = sorted({a.replace("+PTX", "").strip() for a in env.replace(",", ";").split(";") if a.strip()})
    else:
        archs = sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    flags = []
    for arch in archs:
        num = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


@lru_cache(maxsize=None)
def libmvec() -> bool:
    """glibc's vector math library (x86-64 Linux): the CPU loop's exp, tanh, ... run 4
    (float) or 2 (double) at a time through it (fusegen-cpu.h, FUSEGEN_LIBMVEC)."""
    import ctypes.util
    import platform
    return sys.platform == "linux" and platform.machine() == "x86_64" and ctypes.util.find_library("mvec") is not None


def build_flags(cuda: bool) -> dict[str, list[str]]:
    cflags = list(CXX_FLAGS) + (["-DFUSEGEN_WITH_CUDA"] if cuda else []) + (["-DFUSEGEN_LIBMVEC"] if libmvec() else [])
    return {"cflags": cflags, "cuda_cflags": (NVCC_FLAGS + cuda_arch_flags()) if cuda else []}

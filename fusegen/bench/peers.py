"""What `fusegen bench` races for one expression: fusegen, eager PyTorch, torch.compile,
jiterator and CuPy's ElementwiseKernel, each as an `Impl`.

Every peer computes the user's expression, built from the op's own description:
- eager: `reference.evaluate_text`, the text as written, one torch call per operation,
  traced once per dtype with make_fx, so that a call runs exactly those ATen ops without
  walking the text again and torch.compile sees plain tensor code (a function that parses
  text per call would recompile, or graph-break, on every call);
- compile: torch.compile of that eager function, one compiled function per expression and
  dtype reused across sizes (dynamic shapes), or one per size (`static`);
- jiterator and CuPy (forward only; CUDA only): fusegen's own forward math, printed by
  printer.py in float, inside their kernels, so their columns compare kernel machinery
  running the same arithmetic. fusegen-math.h's helpers are their preamble, without its
  #include lines (NVRTC, which both use, has no C++ standard headers).

A peer that is not installed or fails to build is reported with the reason and left out;
nothing here is a dependency of fusegen (cupy is imported by name where it is present).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from fusegen.ir import names

from fusegen.codegen import printer
from fusegen.files import runtime_files
from fusegen.tools.reference import evaluate_text

# Peers in the order of the tables; `fusegen` first. The forward-only ones have no backward.
IMPLS = ("fusegen", "eager", "compile", "jiterator", "cupy")
FORWARD_ONLY = {"jiterator", "cupy"}
CUDA_ONLY = {"jiterator", "cupy"}

# The dtypes CuPy's ElementwiseKernel spells (NumPy has no bfloat16).
CUPY_DTYPES = {torch.float32: "float32", torch.float16: "float16"}


@dataclass
class Impl:
    """One implementation of the expression for one dtype. `prepare` turns a set of torch
    tensors into the arguments `forward` takes (CuPy arrays for CuPy), once, outside the
    timed loop; a differentiable one is also timed with torch.autograd.grad."""

    name: str
    forward: Callable
    prepare: Callable = field(default=lambda tensors: tuple(tensors))
    differentiable: bool = True
    note: str = ""


def optional_module(module: str):
    """A peer's package where it is installed (cupy, liger_kernel, matplotlib), else None:
    imported by name, never a dependency of fusegen."""
    try:
        return importlib.import_module(module)
    except Exception:  # ImportError, or a broken install (a CUDA library missing): absent
        return None


def failure(err: Exception) -> str:
    """An exception as one short line: why a peer or a measurement was left out."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


def eager_function(text: str, inputs, dtype: torch.dtype, device: str):
    """The expression as eager PyTorch runs it: evaluate_text traced once (make_fx) into the
    ATen calls it makes for `dtype` (numbers become 0-dim tensors of that dtype). Its
    `forward`, not the module: a call then costs what the same torch calls written by hand
    cost, plus one Python frame per operation (torch.ops.aten.<op>.<overload>)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def function(*tensors):
        return evaluate_text(text, dict(zip(inputs, tensors)))

    examples = [torch.ones(4, dtype=dtype, device=device) for _ in inputs]
    return make_fx(function)(*examples).forward


def configure_compile(static: bool, sizes: int):
    """Room in dynamo's cache for every graph the run compiles: forward and forward+backward
    per function, times the sizes when each size is its own static graph."""
    import torch._dynamo.config as config

    wanted = max(64, 4 * sizes if static else 8)
    # the per-function limit and the one across a function's guards; renamed in torch 2.6
    for option in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                   "accumulated_cache_size_limit"):
        if hasattr(config, option):
            setattr(config, option, max(getattr(config, option), wanted))


def float_math(spec) -> tuple[list[str], list[str], str]:
    """An OpSpec's forward in float C, as printer.py prints it for the kernels: (the names
    of the raw inputs, in any storage type; lines converting each to float and computing
    the `const T t = ...;` temporaries; the result expression)."""
    program = names.for_c(spec.forward_program, spec.inputs + spec.scalars)
    printed = printer.print_program(program, "float")
    values = [names.value(i) for i in spec.inputs]
    lines = [f"const float {c} = static_cast<float>(raw_{c});" for c in values]
    lines += [f"const {ctype} {temp} = {code};" for ctype, temp, code in printed.temps]
    return [f"raw_{c}" for c in values], lines, dict(printed.results).get("out", printed.results[0][1])


def nvrtc_preamble() -> str:
    """fusegen-math.h for NVRTC: its helpers (maximum, relu, sigmoid, ...) without the
    #include lines, and C's INFINITY/NAN, which <cmath> would have defined."""
    header = runtime_files()["fusegen-math.h"]
    kept = [line for line in header.splitlines() if not line.startswith("#include")]
    return ("#ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif\n"
            "#ifndef NAN\n#define NAN __int_as_float(0x7fffffff)\n#endif\n" + "\n".join(kept) + "\n")


def jiterator_source(spec) -> str:
    """A jiterator entry function computing the op's forward in float for any storage T.
    jiterator's parser wants the code to start with a template function and takes the last
    one as the entry: the entry is declared first, the helpers follow, then its body."""
    inputs, lines, result = float_math(spec)
    params = ", ".join(f"T {raw}" for raw in inputs)
    head = f"template <typename T> T fusegen_bench_{spec.name}({params})"
    body = "\n  ".join(lines + [f"return T({result});"])
    return f"{head};\n{nvrtc_preamble()}{head} {{\n  {body}\n}}\n"


def cupy_kernel(cupy, spec, dtype: torch.dtype):
    """A CuPy ElementwiseKernel computing an OpSpec's forward in float, storage `dtype`."""
    inputs, lines = cupy_body(spec)
    ctype = CUPY_DTYPES[dtype]
    params = ", ".join(f"{ctype} {raw}" for raw in inputs)
    return cupy.ElementwiseKernel(params, f"{ctype} out", "\n".join(lines), f"fusegen_bench_{spec.name}",
                                  preamble=nvrtc_preamble())


def cupy_body(spec) -> tuple[list[str], list[str]]:
    """(the kernel's input parameter names, the lines of its body): fusegen's math in
    float, the result stored into `out`, of the output's type."""
    inputs, lines, result = float_math(spec)
    return inputs, lines + [f"out = {result};"]


def _cupy_impl(cupy, spec, dtype) -> Impl:
    kernel = cupy_kernel(cupy, spec, dtype)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def forward(*arrays):
        with stream:  # torch's current stream, where the CUDA events are recorded
            return kernel(*arrays)

    return Impl("cupy", forward, prepare=lambda tensors: tuple(cupy.from_dlpack(t) for t in tensors),
                differentiable=False, note=f"cupy {cupy.__version__}")


def build_impls(op, text: str, dtype: torch.dtype, device: str, wanted, static_compile: bool):
    """name -> Impl for each wanted implementation that runs here, and name -> the reason
    for each that does not. Each is called once on small tensors, so that a peer that fails
    to build (a jiterator or CuPy compile error) is reported here, not mid-measurement."""
    impls, skipped = {}, {}
    inputs = list(op.entry.inputs)

    def eager():
        return Impl("eager", eager_function(text, inputs, dtype, device))

    def compiled():
        function = eager_function(text, inputs, dtype, device)
        mode = "static shapes, one graph per size" if static_compile else "dynamic shapes"
        return Impl("compile", torch.compile(function, dynamic=not static_compile), note=mode)

    def jiterator():
        source = jiterator_source(op.spec)
        return Impl("jiterator", torch.cuda.jiterator._create_jit_fn(source), differentiable=False)

    def cupy():
        module = optional_module("cupy")
        if module is None:
            raise LookupError("cupy is not installed")
        if dtype not in CUPY_DTYPES:
            raise LookupError(f"CuPy has no {str(dtype)[6:]}")
        return _cupy_impl(module, op.spec, dtype)

    makers = {"fusegen": lambda: Impl("fusegen", op), "eager": eager, "compile": compiled,
              "jiterator": jiterator, "cupy": cupy}
    for name in wanted:
        if name in CUDA_ONLY and device != "cuda":
            skipped[name] = "needs CUDA"
            continue
        try:
            impl = makers[name]()
            if name != "compile":  # compile's first call happens at the largest size (bench.py)
                probe = [torch.rand(8, dtype=dtype, device=device) + 0.5 for _ in inputs]
                impl.forward(*impl.prepare(probe))
        except Exception as err:  # a peer that cannot run here is left out, with the reason
            skipped[name] = failure(err)
            continue
        impls[name] = impl
    return impls, skipped

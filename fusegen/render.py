"""The only place that touches Jinja.

`render(spec, printed)` turns an OpSpec and its printed C strings into the files of one
op: `<name>.h` (the math, host and device), `<name>.cu` (CUDA kernels and launchers, no
torch headers), `<name>.cpp` (schemas, CPU/Meta/CUDA impls, autograd), the hand-written
helper headers they include, and `spec.json`. Templates only paste strings built here;
the output is a pure function of the spec, so it is byte-identical from run to run.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from importlib import resources
from pathlib import Path

import jinja2

from .printer import PrintedOp
from .spec import FUSEGEN_VERSION, OpSpec

# Hand-written headers copied beside every op, so `--out DIR` builds without fusegen.
HELPERS = ("fusegen.h", "fusegen_cuda.cuh", "fusegen_op.h")

# Output file -> (template, what the file is, for its header comment).
TEMPLATES = {
    "{name}.h": ("op_math.h.j2", "the elementwise math, shared by the CPU and CUDA kernels"),
    "{name}.cu": ("op_kernels.cu.j2", "CUDA kernels and their launchers (no torch headers)"),
    "{name}.cpp": ("op.cpp.j2", "schemas, CPU/CUDA/Meta impls and the autograd Function"),
}

COMPUTE_TYPES = ("float", "double")


def templates_dir() -> Path:
    """templates/ beside the package in a checkout (editable install, PYTHONPATH=.);
    the `fusegen.templates` package data in a wheel (pip install .)."""
    source = Path(__file__).resolve().parent.parent / "templates"
    if (source / "op.cpp.j2").is_file():
        return source
    # templates/ has no __init__.py, so this is a namespace package: ask for a file in it
    # (str() of the folder itself would be a MultiplexedPath's repr).
    return Path(str(resources.files("fusegen.templates") / "op.cpp.j2")).parent


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["add_suffix"] = lambda text, suffix: text + suffix
    return env


def _join(items) -> str:
    return ", ".join(items)


def _context(spec: OpSpec, printed: PrintedOp) -> dict:
    """Every string the templates paste. Names: inputs, then outputs, then scalars."""
    ins, scal = list(spec.inputs), list(spec.scalars)
    bins, bscal = list(spec.backward_inputs), list(spec.backward_scalars)
    kgrads = [f"grad_{g.input}" for g in spec.kernel_gradients]
    nk = len(kgrads)

    math = []
    for ctype in COMPUTE_TYPES:
        math.append({
            "ctype": ctype,
            "forward_params": _join([f"{ctype} {x}" for x in ins + scal]),
            "backward_params": _join([f"{ctype} {x}" for x in ["grad"] + bins + bscal]
                                     + [f"{ctype}& {g}" for g in kgrads]),
            "forward": printed.forward[ctype],
            "backward": printed.backward[ctype],
        })

    acc = "fusegen::acc_t<scalar_t>"
    cuda = {
        "forward_params": ",\n    ".join(
            [f"const scalar_t* __restrict__ {x}" for x in ins] + ["scalar_t* __restrict__ out"]
            + [f"{acc} {s}" for s in scal]),
        "forward_vec_call": _join([f"fusegen::to_acc({x}_v.v[k])" for x in ins] + scal),
        "forward_call": _join([f"fusegen::to_acc({x}[i])" for x in ins] + scal),
        "forward_launch_params": _join(["fusegen::Dtype dtype", "int64_t n"]
                                       + [f"const void* {x}" for x in ins] + ["void* out"]
                                       + [f"double {s}" for s in scal] + ["cudaStream_t stream"]),
        "forward_pointers": _join(ins + ["out"]),
        "forward_launch_args": _join([f"static_cast<const scalar_t*>({x})" for x in ins]
                                     + ["static_cast<scalar_t*>(out)"]
                                     + [f"static_cast<{acc}>({s})" for s in scal]),
        "backward_params": ",\n    ".join(
            [f"const scalar_t* __restrict__ {x}" for x in ["grad"] + bins]
            + [f"scalar_t* __restrict__ {g}" for g in kgrads] + [f"{acc} {s}" for s in bscal]),
        "backward_vec_call": _join([f"fusegen::to_acc({x}_v.v[k])" for x in ["grad"] + bins]
                                   + bscal + [f"{g}_k" for g in kgrads]),
        "backward_call": _join([f"fusegen::to_acc({x}[i])" for x in ["grad"] + bins]
                               + bscal + [f"{g}_i" for g in kgrads]),
        "backward_launch_params": _join(["fusegen::Dtype dtype", "int64_t n"]
                                        + [f"const void* {x}" for x in ["grad"] + bins]
                                        + [f"void* {g}" for g in kgrads]
                                        + [f"double {s}" for s in bscal] + ["cudaStream_t stream"]),
        "backward_pointers": _join(["grad"] + bins + kgrads),
        "backward_launch_args": _join([f"static_cast<const scalar_t*>({x})" for x in ["grad"] + bins]
                                      + [f"static_cast<scalar_t*>({g})" for g in kgrads]
                                      + [f"static_cast<{acc}>({s})" for s in bscal]),
    }

    def args_init(names):
        return "{" + _join([f'{{"{x}", {x}}}' for x in names]) + "}"

    tensor = "const at::Tensor&"
    mask = f"std::array<bool, {nk}> output_mask"
    host = {
        "forward_params": _join([f"{tensor} {x}" for x in ins] + [f"double {s}" for s in scal]),
        "forward_params_unnamed_scalars": _join([f"{tensor} {x}" for x in ins]
                                                + [f"double /*{s}*/" for s in scal]),
        "forward_args": args_init(ins),
        "forward_names": _join(ins + scal),
        "forward_cpu_call": _join([f"static_cast<acc_t>({x}_p[i])" for x in ins]
                                  + [f"static_cast<acc_t>({s})" for s in scal]),
        "forward_launch_call": _join(["fusegen::kernel_dtype(out.scalar_type())", "n"]
                                     + [f"in[{j}].const_data_ptr()" for j in range(len(ins))]
                                     + ["out.mutable_data_ptr()"] + scal
                                     + ["c10::cuda::getCurrentCUDAStream()"]),
        "backward_params": _join([f"{tensor} {x}" for x in ["grad"] + bins]
                                 + [f"double {s}" for s in bscal] + [mask]),
        "backward_params_unnamed_scalars": _join([f"{tensor} {x}" for x in ["grad"] + bins]
                                                 + [f"double /*{s}*/" for s in bscal] + [mask]),
        "backward_args": args_init(["grad"] + bins),
        "backward_allocs": _join([f"output_mask[{k}] ? layout.empty() : at::Tensor()" for k in range(nk)]),
        "backward_cpu_call": _join([f"static_cast<acc_t>({x}_p[i])" for x in ["grad"] + bins]
                                   + [f"static_cast<acc_t>({s})" for s in bscal]
                                   + [f"{g}_i" for g in kgrads]),
        "backward_launch_call": _join(["fusegen::kernel_dtype(layout.dtype())", "n"]
                                      + [f"in[{j}].const_data_ptr()" for j in range(1 + len(bins))]
                                      + [f"{g}.defined() ? {g}.mutable_data_ptr() : nullptr" for g in kgrads]
                                      + bscal + ["c10::cuda::getCurrentCUDAStream()"]),
        "needs_mask": _join([f"ctx->needs_input_grad({spec.inputs.index(g.input)})"
                             for g in spec.kernel_gradients]),
        "any_needed": " || ".join(f"output_mask[{k}]" for k in range(nk)),
        "backward_call_from_saved": _join(["grad"] + [f"saved[{j}]" for j in range(len(bins))]
                                          + bscal + ["output_mask"]),
    }

    slots, k = [], 0
    for index, g in enumerate(spec.gradients):
        slots.append({"index": index, "input": g.input, "passthrough": g.passthrough,
                      "kernel_index": None if g.passthrough else k})
        k += 0 if g.passthrough else 1

    schema = {
        "forward": f"{spec.name}(" + _join([f"Tensor {x}" for x in ins] + [f"float {s}" for s in scal])
                   + ") -> Tensor",
        "backward": f"{spec.name}_backward(" + _join([f"Tensor {x}" for x in ["grad"] + bins]
                                                    + [f"float {s}" for s in bscal]
                                                    + [f"bool[{nk}] output_mask"]) + ") -> Tensor[]",
    }
    return {
        "name": spec.name,
        "class_name": "".join(p.capitalize() for p in spec.name.split("_") if p) + "Function",
        "text": spec.text,
        "gradient_lines": spec.summary(),
        "version": FUSEGEN_VERSION,
        "command": spec.command,
        "inputs": ins,
        "scalars": scal,
        "backward_inputs": bins,
        "backward_scalars": bscal,
        "kernel_grads": kgrads,
        "gradient_slots": slots,
        "math": math,
        "cuda": cuda,
        "host": host,
        "schema": schema,
    }


def render(spec: OpSpec, printed: PrintedOp) -> dict[str, str]:
    """All files of one op, name -> text, in a fixed order. spec.json carries the hash."""
    env = _environment()
    context = _context(spec, printed)
    files: dict[str, str] = {}
    for pattern, (template, role) in TEMPLATES.items():
        files[pattern.format(name=spec.name)] = env.get_template(template).render(context, file_role=role)
    for helper in HELPERS:
        files[helper] = (templates_dir() / helper).read_text()
    files["spec.json"] = spec.to_json(content_hash(files))
    return files


def content_hash(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        if name == "spec.json":
            continue
        h.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    return h.hexdigest()


def write(files: dict[str, str], directory: str | os.PathLike) -> list[Path]:
    """Write files into `directory`, each through a temp file and an atomic rename, so a
    crash never leaves a half-written source behind. Unchanged files are not touched."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = directory / name
        if path.exists() and path.read_text() == text:
            written.append(path)
            continue
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        written.append(path)
    return written

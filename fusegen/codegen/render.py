"""The only place that touches Jinja.

`render(spec, printed)` turns an OpSpec and its printed C strings into the files of one
op: `<name>.h` (the math, host and device), `<name>.cu` (CUDA kernels and launchers, no
torch headers), `<name>.cpp` (the op's CPU kernels and its descriptor: schemas, dispatch
keys, autograd), and `spec.json`. The hand-written runtime they include is not part of an
op's files: it is written once beside the op folders (`_runtime/`, files.runtime_files). Templates only paste strings built here;
the output is a pure function of the spec, so it is byte-identical from run to run.

User text reaches the files in two ways only (escape.py): names, checked here to be
identifiers (names.name_problem), go in bare; every other string (the expression, the
gradients' notation, the regenerate command, a @fused function's qualified name in it)
goes into a comment through `c_comment`, and every string literal (op name, schemas,
input names) through the `c_string` filter.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import jinja2

from fusegen.ir import names
from fusegen.errors import SpecError
from fusegen.codegen.escape import c_comment, c_string
from fusegen.files import templates_dir
from fusegen.codegen.printer import APPROX, PrintedOp, saved_row_names
from fusegen.codegen.wrap import wrap
from fusegen.ir.limits import MAX_LAUNCHED_OPERANDS
from fusegen.ir.spec import OpSpec
from fusegen.version import FUSEGEN_VERSION

# Output file -> (template, what the file is, for its header comment).
TEMPLATES = {
    "{name}.h": ("op_math.h.j2", "the elementwise math, shared by the CPU and CUDA kernels"),
    "{name}.cu": ("op_kernels.cu.j2", "CUDA kernels and their launchers (no torch headers)"),
    "{name}.cpp": ("op.cpp.j2", "CPU kernels and the descriptor the shared runtime registers"),
}

COMPUTE_TYPES = ("float", "double")


@lru_cache(maxsize=None)
def _environment(compiled: str | None = None) -> jinja2.Environment:
    # Compiling the templates is 0.1 s of a new op's process: given a folder (the driver
    # passes the cache's, when the cache is fusegen's), Jinja keeps them compiled there,
    # checked against each template's source.
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        bytecode_cache=jinja2.FileSystemBytecodeCache(compiled) if compiled else None,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        extensions=["jinja2.ext.do"],
    )
    # `fmt` fills a pattern written in the template: "to_acc({}[i])" | fmt on a name.
    env.filters["fmt"] = lambda value, pattern: pattern.format(value)
    env.filters["c_string"] = c_string
    env.filters["c_comment"] = c_comment
    # a row functor's input (its C name) read by one of `passes` (printer.PrintedPass)
    env.filters["in_passes"] = lambda name, passes: any(name in p.params for p in passes)
    env.globals["values"] = lambda items: [x.c for x in items]
    env.globals["grads"] = lambda items: [x.grad for x in items]
    return env


@dataclass(frozen=True)
class Name:
    """One of the user's names and every C identifier derived from it (names.py)."""

    name: str                     # as the user wrote it: forward schema, error messages
    index: int = -1               # position among the forward's arguments
    kernel_index: int = -1        # position among the gradients the backward kernel writes

    def __getattr__(self, role):  # x.grad -> "grad_x"
        if role in names.ROLES:
            return names.role(role, self.name)
        raise AttributeError(role)

    @property
    def c(self) -> str:
        return names.value(self.name)


def _step(op: str, value: float) -> str:
    """One DoutStep initializer: the value printed exactly (repr round-trips a double)."""
    return f"{{'{op}', {names.c_double(value)}}}"


def _grad_defs(spec: OpSpec) -> tuple[list[str], list[str]]:
    """The DoutStep arrays (one per distinct list of steps) and one GradDef per input."""
    arrays: dict[tuple, str] = {}
    defs = []
    for g in spec.gradients:
        output = -1 if g.output is None else g.output
        if not g.dout_steps:
            defs.append(f"{{{output}, {0 if g.dout_steps == () else -1}, nullptr}}")
            continue
        array = arrays.setdefault(g.dout_steps, f"kDoutSteps{len(arrays)}")
        defs.append(f"{{{output}, {len(g.dout_steps)}, {array}}}")
    lines = [f"const DoutStep {a}[] = {{{', '.join(_step(*st) for st in steps)}}};" for steps, a in arrays.items()]
    return lines, defs


def _jvp_args(spec: OpSpec, jvp: OpSpec | None) -> tuple[list[int], list[int]]:
    """OpDef's jvp_args and jvp_scalars: <name>_jvp's arguments in terms of <name>'s. Its
    tensors are the primals it reads (by name), then one tangent per input whose gradient
    is not zero, in input order (spec.jvp_spec)."""
    if jvp is None:
        return [], []  # every gradient is zero: so is the tangent
    moving = [spec.inputs.index(g.input) for g in spec.gradients if g.expr != 0]
    primals = [x for x in jvp.inputs if x in spec.inputs][:len(jvp.inputs) - len(moving)]
    args = [spec.inputs.index(x) for x in primals] + [len(spec.inputs) + i for i in moving]
    assert len(args) == len(jvp.inputs), (spec.name, jvp.inputs)
    return args, [spec.scalars.index(s) for s in jvp.scalars]


def _context(spec: OpSpec, printed: PrintedOp, jvp=None, grad2: bool = False) -> dict:
    """Names and printed math for the templates; every C spelling is in the templates."""
    _check_names(spec)
    inputs = [Name(x, index=i) for i, x in enumerate(spec.inputs)]
    by_name = {x.name: x for x in inputs}
    if spec.saved_output:
        # kResult - k: output k (fusegen-runtime.h)
        by_name[spec.saved_output] = Name(spec.saved_output, index=-1 - spec.saved_index)
    kernel_grads = [Name(g.input, index=by_name[g.input].index, kernel_index=g.output)
                    for g in spec.kernel_gradients]
    steps, grad_defs = _grad_defs(spec)
    return {
        "name": spec.name,
        "ns": names.op_namespace(spec.name),
        "text": c_comment(spec.text),
        "gradient_lines": [c_comment(line) for line in spec.summary() + spec.saved_lines()],
        "version": FUSEGEN_VERSION,
        "command": c_comment(spec.command),
        "inputs": inputs,
        "scalars": [Name(s) for s in spec.scalars],
        "backward_inputs": [by_name[x] for x in spec.backward_inputs],
        "backward_scalars": [Name(s, index=spec.scalars.index(s)) for s in spec.backward_scalars],
        "kernel_grads": kernel_grads,
        "dout_steps": steps,
        "grad_defs": grad_defs,
        "douts": [d.name for d in spec.douts],
        "outputs": [names.output(k, len(spec.outputs)) for k in range(len(spec.outputs))],
        "joined": spec.joined,
        "jvp_args": jvp[0] if jvp else None,  # None: no fused forward mode (an auxiliary op)
        "jvp_scalars": jvp[1] if jvp else [],
        "grad2": grad2,  # <name>_grad2 is built beside it (its double backward)
        "math": [{"ctype": t, "forward": printed.forward.get(t), "backward": printed.backward.get(t)}
                 for t in COMPUTE_TYPES],
        "rows": _rows_context(spec, printed),
        "random": list(spec.random),
        "coarse": sum(1 << spec.random.index(s) for s in spec.coarse),  # a bit per stream
        "probabilities": [spec.scalars.index(p) for p in spec.probabilities],
        # The NVRTC route runs it through the runtime's launchers (fusegen-launch.cpp): an
        # elementwise op whose loops fit the operand counts they are instantiated for.
        "launched": printed.forward_rows is None and max(
            len(spec.inputs) + len(spec.outputs),
            len(spec.douts) + len(spec.backward_inputs) + len(spec.kernel_gradients)) <= MAX_LAUNCHED_OPERANDS,
    }


def _rows_context(spec: OpSpec, printed: PrintedOp) -> dict | None:
    """A row op's printed passes per compute type, and what its functors need: the C name
    of each tensor the kernel reads -> its place x[i], the accumulator counts, the outputs
    of one value per row."""
    if printed.forward_rows is None:
        return None
    douts = [d.name for d in spec.douts]
    backward = [names.value(x) for x in spec.backward_inputs]
    saved = saved_row_names(spec)
    outputs = len(spec.outputs)

    def backward_info(program, read_saved: bool) -> dict | None:
        if program is None:
            return None
        return {"rows": len(program.accumulators), "per_row": [False] * len(program.results),
                "raw": [False] * len(program.results),
                "index": [False] * len(douts) + [x in spec.index_inputs for x in spec.backward_inputs]
                + [True] * (len(saved) if read_saved else 0)}

    def printing(key: str) -> dict:
        return {"ctype": "float" if key == APPROX else key, "forward": printed.forward_rows[key],
                "backward": printed.backward_rows[key] if printed.backward_rows else None,
                "saved_backward": printed.saved_backward_rows[key] if printed.saved_backward_rows else None}

    math = [printing(t) for t in COMPUTE_TYPES]
    approx = printing(APPROX)
    return {
        "math": math,
        # fp16 and bf16 on CUDA: float with approximate exp and division (printer.py), where
        # that printing differs from float's
        "approx": approx if approx != math[0] else None,
        "forward_x": {names.value(x): f"x[{i}]" for i, x in enumerate(spec.inputs)},
        "backward_x": {n: f"x[{i}]" for i, n in enumerate(douts + backward)},
        "saved_backward_x": {n: f"x[{i}]" for i, n in enumerate(douts + backward + saved)},
        "forward": {"rows": len(spec.forward_rows.accumulators), "per_row": list(spec.forward_rows.per_row),
                    "raw": [k >= outputs for k in range(len(spec.forward_rows.results))],
                    "index": [x in spec.index_inputs for x in spec.inputs]},
        "backward": backward_info(spec.backward_rows, False),
        "saved_backward": backward_info(spec.saved_backward_rows, True),
        "saved": saved,
        "any_index": bool(spec.index_inputs),
    }


def _check_names(spec: OpSpec):
    """Every name the templates paste bare (identifiers, namespaces, #include file names)
    is an identifier: an OpSpec made by hand, not by differentiate, is held to it too."""
    for what, values in (("op name", (spec.name,)), ("input", spec.inputs), ("scalar", spec.scalars),
                         ("backward input", spec.backward_inputs)):
        for value in values:
            problem = names.name_problem(value)
            if problem:
                raise SpecError(f"{what} {value!r} {problem}")


def render(spec: OpSpec, printed: PrintedOp, auxiliary=(), compiled: str | None = None) -> dict[str, str]:
    """All files of one op, name -> text, in a fixed order. spec.json carries the hash.

    `auxiliary`: (spec, printed) of the ops derived from it (`<name>_grad2`, `<name>_jvp`),
    rendered by the same templates into the same folder and built into the same library."""
    env = _environment(compiled)
    files: dict[str, str] = {}
    jvp = next((a for a, _ in auxiliary if a.name == spec.name + names.JVP_SUFFIX), None)
    grad2 = any(a.name == spec.name + names.GRAD2_SUFFIX for a, _ in auxiliary)
    for s, p in ((spec, printed),) + tuple(auxiliary):
        main = s is spec
        context = _context(s, p, _jvp_args(spec, jvp) if main else None, grad2 and main)
        context["plain_kernels"] = not main
        # A row op's CUDA backward that may sum a weight's gradient over the rows: one of an op
        # of one input would be the whole (one-row) broadcast shape, with nothing to sum.
        context["row_sums"] = bool(main and context["rows"] and len(s.inputs) > 1)
        for pattern, (template, role) in TEMPLATES.items():
            text = env.get_template(template).render(context, file_role=role)
            files[pattern.format(name=s.name)] = wrap(text)
    files["spec.json"] = spec.to_json(content_hash(files), [s for s, _ in auxiliary])
    return files


def content_hash(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        if name == "spec.json":
            continue
        h.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    return h.hexdigest()


# -- step ops ---------------------------------------------------------------------------------

STEP_TEMPLATES = {
    "{name}.h": ("step_math.h.j2", "the update math, shared by the CPU and CUDA kernels"),
    "{name}.cu": ("step_kernels.cu.j2", "the CUDA kernel's entry point (no torch headers)"),
    "{name}.cpp": ("step.cpp.j2", "the CPU kernel and the descriptor the shared runtime registers"),
}


def render_step(spec, program_by_type: dict, derived: list, compiled: str | None = None) -> dict[str, str]:
    """The files of one step op (ir/step.py): `program_by_type` is its Program printed per
    compute type (printer.print_program), `derived` its derived scalars printed in double,
    (name, code)."""
    for what, values in (("op name", (spec.name,)), ("input", spec.inputs), ("scalar", spec.scalars)):
        for value in values:
            problem = names.name_problem(value)
            if problem:
                raise SpecError(f"{what} {value!r} {problem}")
    inputs = [Name(x, index=i) for i, x in enumerate(spec.inputs)]
    by_name = {x.name: x for x in inputs}
    masks = []
    for ok in spec.alias_ok:
        bits = sum(1 << spec.inputs.index(j) for j in ok)
        masks.append(f"UINT32_C({bits:#x})")
    context = {
        "name": spec.name,
        "ns": names.op_namespace(spec.name),
        "text": c_comment(spec.text),
        "update_lines": [c_comment(line) for line in spec.summary()],
        "version": FUSEGEN_VERSION,
        "command": c_comment(spec.command),
        "inputs": inputs,
        "scalars": [Name(s, index=i) for i, s in enumerate(spec.scalars)],
        "updated": [by_name[u] for u in spec.updated],
        "reads": [by_name[r] for r in spec.reads],
        "alias_masks": masks,
        "derived": list(derived),
        "schema": spec.schema(),
        "foreach_schema": spec.foreach_schema(),
        "math": [{"ctype": t, "step": program_by_type[t]} for t in COMPUTE_TYPES],
    }
    env = _environment(compiled)
    files = {}
    for pattern, (template, role) in STEP_TEMPLATES.items():
        files[pattern.format(name=spec.name)] = wrap(env.get_template(template).render(context, file_role=role))
    files["spec.json"] = spec.to_json(content_hash(files))
    return files

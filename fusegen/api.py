"""The driver: text in, a loaded op out, one line per stage.

    text --parse--> sympy --differentiate+cse--> OpSpec --print--> C strings
         --render--> files --build--> .so --load--> torch.ops.fusegen.<name>

`generate` runs the stages up to the files, `fuse_many` adds the compiler and the loader
for many ops at once (one library), and `fuse` is `fuse_many` of one. The in-process
memo, the request index (index.py: a request built before, in any process, is found
without running the pipeline) and the check that one name means one expression wrap the
pipeline; they are not part of it.

Only the cached path is imported with fusegen: the stages (sympy, Jinja) are imported when
a request is not in the index, so a cached load costs milliseconds, not a second of imports.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fusegen.pytorch import autograd as _autograd
from fusegen.build import builder as _build
from fusegen.pytorch import decompose as _decompose
from fusegen.pytorch.binding import arguments, bind
from fusegen.build import index as _index
from fusegen.build import keys as _keys
from fusegen.ir import names
from fusegen.errors import LoadError, SpecError

# FusedOp.__call__'s checks, bound once
_is_compiling = _autograd._is_compiling
_functorch_active = _autograd._functorch_active
_forward_ad = _autograd.forward_ad

if TYPE_CHECKING:
    from fusegen.ir.expr import Parsed
    from fusegen.ir.spec import OpSpec
    from fusegen.pytorch.step import StepRequest

# Statements (an assignment, `;` or a line break), told apart from one expression without
# importing the parser: `=` that is not part of ==, !=, <= or >=.
_STATEMENT = re.compile(r"(?<![=!<>])=(?!=)|;|\n")


def looks_like_program(text) -> bool:
    return isinstance(text, str) and _STATEMENT.search(text.strip()) is not None


@dataclass(frozen=True)
class Request:
    """One op to make: the arguments of `fuse`. With `params`, `expr` is the source of a
    @fused function instead of one expression."""

    expr: str
    name: str | None = None
    inputs: tuple[str, ...] | None = None
    scalars: tuple[str, ...] = ()
    params: tuple[str, ...] | None = None
    command: str | None = None

    @classmethod
    def of(cls, item) -> "Request":
        """A Request from what fuse_many accepts: a Request, an expression, or fuse's kwargs."""
        if isinstance(item, Request):
            return item
        if isinstance(item, str):
            return cls(item)
        if isinstance(item, dict):
            unknown = set(item) - {"expr", "name", "inputs", "scalars"}
            if unknown or "expr" not in item:
                raise SpecError(f"fuse_many: each dict needs 'expr' and may have 'name', 'inputs', "
                                f"'scalars'; got keys {sorted(item)}")
            return cls(item["expr"], item.get("name"), _names_arg("inputs", item.get("inputs")),
                       _names_arg("scalars", item.get("scalars")) or ())
        raise SpecError(f"fuse_many: expected expressions (str), dicts of fuse() arguments or "
                        f"Requests, got {type(item).__name__}")

    def parse(self) -> "Parsed":
        from fusegen.frontend.parse import parse, parse_function
        if self.params is None and looks_like_program(self.expr):
            from fusegen.frontend.statements import parse_program
            from fusegen.ir.expr import Parsed
            parsed = parse_program(self.expr, inputs=self.inputs, scalars=self.scalars)
            if not isinstance(parsed, Parsed):
                raise SpecError(f"{self.expr!r} updates inputs in place: fusegen.fuse() makes it a step op "
                                "(fuse_many and the CLI take expressions)")
            return parsed
        if self.params is None:
            return parse(self.expr, inputs=self.inputs, scalars=self.scalars)
        return parse_function(self.expr, list(self.params), list(self.scalars))


@dataclass(frozen=True)
class Generated:
    """An op's spec and its rendered files: everything but the binary. `auxiliary`: the
    ops derived from it for higher-order and forward-mode AD (`<name>_grad2`,
    `<name>_jvp`), whose files are among `files`."""

    spec: "OpSpec"
    files: dict
    auxiliary: tuple["OpSpec", ...] = ()

    @functools.cached_property
    def digest(self) -> str:
        """Of the files: one name, one expression (hashed once, checked and indexed)."""
        return _keys.files_digest(self.files)

    def _of(self, name: str) -> set[str]:
        return {f"{name}{ext}" for ext in _OP_FILES}

    @property
    def own_files(self) -> dict:
        """What the op's library is built from: `files` without the auxiliary ops', which are
        built on first use (`auxiliary_files`). A generated folder keeps them all."""
        theirs = set().union(*(self._of(a.name) for a in self.auxiliary))
        return {f: text for f, text in self.files.items() if f not in theirs}

    def auxiliary_files(self, name: str) -> dict:
        """What auxiliary op `name`'s library is built from: its files and the helper headers."""
        mine = self._of(name)
        return {f: text for f, text in self.files.items() if f in mine or f.startswith(_HELPER_PREFIX)}


_OP_FILES = (".h", ".cu", ".cpp")  # an op's own files (codegen/render.py's TEMPLATES)
_HELPER_PREFIX = "fusegen-"        # the hand-written headers beside them (no op name has a '-')


def _compiled_templates() -> str | None:
    """Where Jinja keeps the compiled templates: the cache's folder, if the cache is fusegen's."""
    from fusegen.build.cache import template_folder
    folder = template_folder()
    return str(folder) if folder else None


def generate(request: Request) -> Generated:
    """Every stage but the compiler: what `fusegen --no-build` writes."""
    from fusegen.ir import limits
    from fusegen.codegen.printer import print_op
    from fusegen.codegen.render import render
    from fusegen.ir.spec import auxiliary_specs, differentiate

    with limits.scope(request.name):  # one deadline and graph budget for the whole family
        parsed = request.parse()                                                    # parse
        spec = differentiate(parsed, name=request.name, command=request.command)    # differentiate
        auxiliary = auxiliary_specs(spec)                                           # ... again
        printed = [print_op(_with_c_names(s)) for s in (spec,) + auxiliary]         # print
        files = render(spec, printed[0], tuple(zip(auxiliary, printed[1:])),        # render
                       compiled=_compiled_templates())
        limits.check_source(spec.name, files)  # the runtime is not among them
    return Generated(spec, files, auxiliary)


def _build_and_load(generated: list[Generated]) -> list["FusedOp"]:
    library = _build.build([(g.spec.name, g.own_files) for g in generated])     # build
    _build.load(library)                                                        # load
    auxiliary = _Auxiliary(lambda: generated)                                   # ... on first use
    families = [_autograd.register(g.spec, g.auxiliary, auxiliary) for g in generated]  # autograd, torch.func
    for g, f in zip(generated, families):
        _decompose.loaded(g.spec.name, f, g.digest)                             # torch.compile
    return [FusedOp(_entry(g, library, f), g) for g, f in zip(generated, families)]


class _Auxiliary:
    """Builds the auxiliary ops (`<name>_grad2`, `<name>_jvp`) of ops loaded together, on
    the first use of one (autograd.load_auxiliary): the first double backward builds the
    `_grad2` ops, the first forward-mode use the `_jvp` ops, of every op of the batch (one
    `fuse_many`: one library, one compiler run, as the ops themselves), never both kinds
    at once. `get()` returns the batch's Generated (for an op found in the index, its
    pipeline runs then)."""

    def __init__(self, get, entry: _index.Entry | None = None):
        self._get = get
        self._entry = entry  # an op found in the index: the auxiliary libraries it recorded

    def __call__(self, name: str) -> list[str]:
        recorded = self._entry and _index.auxiliary_library(self._entry, name)
        if recorded:
            try:
                _build.load(recorded)  # built by an earlier process: no pipeline, no compiler
                return [name]
            except LoadError:
                pass  # gone or unsafe since the lookup: the long way says why
        generated = self._get()
        suffix = next(a.name[len(g.spec.name):] for g in generated for a in g.auxiliary if a.name == name)
        pending = set(_autograd.pending_auxiliary())
        todo = [(g, g.spec.name + suffix) for g in generated if g.spec.name + suffix in pending]
        library = _build.build([(a, g.auxiliary_files(a)) for g, a in todo])
        _build.load(library)
        with _LOCK:
            for g, a in todo:  # for the next process's first use
                for request, op in list(_MEMO.items()):
                    if op.name == g.spec.name:
                        _index.record_auxiliary(request, a, library.key)
        return [a for _, a in todo]


def _entry(g: Generated, library: _build.Library | None, family=()) -> _index.Entry:
    spec = g.spec
    return _index.Entry(spec.name, tuple(spec.inputs), tuple(spec.scalars), spec.text,
                        bool(spec.kernel_gradients), g.digest, library, family)


def _with_c_names(spec: OpSpec) -> OpSpec:
    """The spec as the C printer must see it: user names renamed to their C names."""
    user = spec.inputs + spec.scalars + ((spec.saved_output,) if spec.saved_output else ())
    rename = names.c_renaming(user)
    return dataclasses.replace(spec, forward_program=names.for_c(spec.forward_program, user),
                               backward_program=names.for_c(spec.backward_program, user),
                               forward_rows=spec.forward_rows and spec.forward_rows.substituted(rename),
                               backward_rows=spec.backward_rows and spec.backward_rows.substituted(rename),
                               saved_backward_rows=(spec.saved_backward_rows
                                                    and spec.saved_backward_rows.substituted(rename)))


class FusedOp:
    """A built, loaded fusegen op. Call it like the expression: `op(a, b, c, alpha=0.5)`.

    Tensors come first in `inputs` order, then scalars (positional or by keyword).
    `op.op` is `torch.ops.fusegen.<name>`; calling that directly skips the Python binding.
    An op found through the index has no spec until `.spec` or `.files` is asked for; then
    the pipeline runs once (sympy and all) to produce them."""

    def __init__(self, entry: _index.Entry, generated: Generated | None = None,
                 request: Request | None = None):
        self.entry = entry
        self.library = entry.library
        self.name = entry.name
        self.op = getattr(torch.ops.fusegen, self.name)
        self.params = entry.inputs + entry.scalars
        self._tensors = len(entry.inputs)
        # The fast path calls the OpOverload's C++ callable itself: OpOverload.__call__ is one
        # Python frame around it (0.2 us a call, a tenth of the floor at n = 4096).
        self._raw = self.op.default._op
        self._generated = generated
        self._request = request

    @property
    def _signature(self) -> inspect.Signature:
        """For a call by keyword or with a wrong count (bind): made then, not at load. (Not a
        functools.cached_property: on Python 3.11 that takes an RLock, which torch.compile
        cannot trace, so a first keyword call inside a compiled function would break it.)"""
        signature = self.__dict__.get("_bound_signature")
        if signature is None:
            signature = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                           for p in self.params])
            self.__dict__["_bound_signature"] = signature
        return signature

    @functools.cached_property
    def generated(self) -> Generated:
        return self._generated if self._generated is not None else generate(self._request)

    @property
    def spec(self) -> "OpSpec":
        return self.generated.spec

    @property
    def files(self) -> dict:
        return self.generated.files

    @property
    def compile_mode(self) -> str:
        """"opaque" or "decompose": what torch.compile makes of this op (fusegen/pytorch/decompose.py)."""
        return _decompose.mode(self.name)

    def load_auxiliary(self) -> "FusedOp":
        """Build (or find in the cache) and load the op's auxiliary ops now. They are built
        on first use otherwise: the first double backward builds `<name>_grad2`, the first
        forward-mode derivative `<name>_jvp`. After this, `torch.ops.fusegen.<name>_grad2`
        and `_jvp` exist, and no later call compiles. Returns the op."""
        _autograd.load_family(self.name)
        return self

    @property
    def backward_op(self):
        """torch.ops.fusegen.<name>_backward, or None when every gradient passes grad through."""
        return getattr(torch.ops.fusegen, f"{self.name}_backward") if self.entry.backward_kernel else None

    def __call__(self, *args, **kwargs):
        if kwargs:
            args = self._with_keywords(args, kwargs)
        # _autograd.eager() spelt out: one Python frame less on every call (at n = 1024 the
        # call is host time; dynamo folds is_compiling to True first, as in eager()).
        if not (_is_compiling() or _functorch_active() or _forward_ad._current_level >= 0):
            try:
                return self._raw(*args)
            except (RuntimeError, TypeError):
                pass  # a number among the tensors, or a wrong call: the full path converts or reports it
        if len(args) != len(self.params):  # (a call with keywords has them all by now)
            args = bind(self._signature, args, {}, f"fusegen op '{self.name}'", self.name)
        return _autograd.call(self.name, *as_tensors(args, self._tensors))

    def _with_keywords(self, args: tuple, kwargs: dict) -> tuple:
        return arguments(self.params, self._signature, args, kwargs, f"fusegen op '{self.name}'", self.name)

    def __repr__(self):
        return f"FusedOp(torch.ops.fusegen.{self.name}: {self.entry.text})"


def as_tensors(args, count: int):
    """`args` with each Python number among the first `count` (the tensor arguments) made a
    0-d CPU tensor, so that it promotes as eager's wrapped numbers do: a number takes the
    dtype eager's result would have (torch's own rule, `elementwise_dtypes`), so it never
    widens it (`bf16_tensor * 2.0` stays bfloat16) and lifts integer tensors to the default
    float dtype (`int_tensor + 0.5` is float32). The runtime moves it to the op's device."""
    tensors = args[:count]
    for a in tensors:
        if not isinstance(a, torch.Tensor):  # one type test per tensor: the common case
            break
    else:
        return args
    if not any(isinstance(a, (bool, int, float)) for a in tensors):
        return args
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    known = [a for a in tensors if isinstance(a, (torch.Tensor, bool, int, float))]
    _, dtype = elementwise_dtypes(*known, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
    wrapped = tuple(torch.tensor(a, dtype=dtype) if isinstance(a, (bool, int, float)) else a for a in tensors)
    return wrapped + tuple(args[count:])


# The in-process memo: the same request returns the same FusedOp, a name loaded once stays
# loaded (a library must never register an op twice), and a different expression under a
# name already registered is an error, not a crash.
_OPS: dict[str, FusedOp] = {}
_MEMO: dict[Request, FusedOp] = {}
_LOCK = threading.RLock()


def _loaded_step(name: str):
    """The step op loaded under `name`, if any. None without importing the step module when
    nothing has (no step op can be loaded then): a cached load of an op does not need it."""
    step = sys.modules.get("fusegen.pytorch.step")
    return step.loaded_step(name) if step is not None else None


def _check_one_expression(entry: _index.Entry):
    step = _loaded_step(entry.name)
    if step is not None:
        raise LoadError(f"fusegen op '{entry.name}' is already defined in this process as the step op "
                        f"{step.text!r}; pick another name")
    known = _OPS.get(entry.name)
    if known is not None and known.entry.digest != entry.digest:
        raise LoadError(f"fusegen op '{entry.name}' is already defined in this process as "
                        f"{known.entry.text!r}; expected the same expression, got {entry.text!r}. "
                        "Pick another name.")


def load_generated(generated: list[Generated]) -> list[FusedOp]:
    """Build and load the ops not yet loaded in this process, all in one library."""
    with _LOCK:
        todo = []
        for g in generated:
            _check_one_expression(_entry(g, None))
            if g.spec.name not in _OPS and all(t.spec.name != g.spec.name for t in todo):
                todo.append(g)
        if todo:
            for op in _build_and_load(todo):
                _OPS[op.name] = op
        return [_OPS[g.spec.name] for g in generated]


def _from_index(request: Request) -> FusedOp | None:
    """The op of a request built before (in any process), loaded without the pipeline."""
    entry = _index.lookup(request)
    if entry is None:
        return None
    _check_one_expression(entry)
    if entry.name not in _OPS:
        try:
            _build.load(entry.library)
        except LoadError:
            return None  # deleted or unsafe since the lookup: the long way says why
        op = _OPS[entry.name] = FusedOp(entry, request=request)
        # vmap rules and autograd kernels from the family's description; the derivatives
        # themselves (sympy) only when first needed.
        _autograd.register_cached(entry.family, lambda: (op.generated.spec, op.generated.auxiliary),
                                  _Auxiliary(lambda: [op.generated], entry))
        _decompose.loaded(entry.name, entry.family, entry.digest)
    return _OPS[entry.name]


def fuse_many(requests) -> list[FusedOp]:
    """Several ops built into one library in one compiler run, loaded, in request order.

    Each item is an expression (`"a*b+c"`), a dict of `fuse`'s arguments
    (`{"expr": "x*alpha+y", "name": "axpy", "scalars": ["alpha"]}`) or a Request."""
    requests = [Request.of(r) for r in requests]
    with _LOCK:
        load_requests([(r, None) for r in dict.fromkeys(requests) if r not in _MEMO])
        return [_MEMO[r] for r in requests]


def load_requests(pending: list[tuple[Request, Generated | None]]):
    """Each request's op into the memo: from the index when it is there, else generated
    (unless already given) and built, all the new ones into one library."""
    with _LOCK:
        todo = []
        for request, generated in pending:
            op = cached(request)
            if op is None:
                todo.append((request, generated or generate(request)))
            elif generated is not None and op._generated is None:
                op._generated = generated  # found in the index: these are its files, no need to derive them again
        for (request, _), op in zip(todo, load_generated([g for _, g in todo])):
            _index.record(request, op.entry)
            _MEMO[request] = op


def cached(request: Request) -> FusedOp | None:
    """The request's op when this process or the index has it (no pipeline, no compiler)."""
    with _LOCK:
        op = _MEMO.get(request) or _from_index(request)
        if op is not None:
            _MEMO[request] = op
        return op


def fuse(expr: str, *, name: str | None = None, inputs=None, scalars=(), compile: str | None = None) -> FusedOp:
    """Turn one elementwise expression into a fused, differentiable op.

    `expr` is Python syntax over tensor names (`"a*b+c"`, `"x*sigmoid(x)"`); `inputs`
    fixes the argument order (default: order of first appearance); `scalars` names
    runtime float arguments (changing their value never rebuilds). The op is registered
    as `torch.ops.fusegen.<name>`; its backward is one fused kernel. `compile` is what
    torch.compile makes of it: "opaque" (one call: the generated kernels) or "decompose"
    (ATen ops of its expression, which Inductor fuses with their neighbours; eager calls
    keep the kernels); None keeps the op's mode ($FUSEGEN_COMPILE, else opaque)."""
    if looks_like_program(expr):
        from fusegen.pytorch.step import StepRequest

        step_request = StepRequest(expr, name, _names_arg("inputs", inputs), _names_arg("scalars", scalars) or ())
        step = _cached_step(step_request)  # this process, or the index: no sympy
        if step is not None:
            return step
        from fusegen.frontend.statements import parse_program
        from fusegen.ir.expr import Parsed

        parsed = parse_program(expr, inputs=step_request.inputs, scalars=step_request.scalars)
        if not isinstance(parsed, Parsed):
            if compile is not None:
                raise SpecError("fuse(..., compile=...): a step op has one mode under torch.compile (its kernel, "
                                "functionalized and re-inplaced); drop compile=")
            return _fuse_step(parsed, step_request)
    request = Request.of({"expr": expr, "name": name, "inputs": inputs, "scalars": scalars})
    if compile is not None:
        _decompose.check(compile, f"fuse({expr!r}, compile=...)")
    with _LOCK:
        op = _MEMO.get(request)
        op = op if op is not None else fuse_many([request])[0]
        _decompose.set_mode(op.name, compile)
    return op


def _cached_step(request: StepRequest):
    """The step op of `request` when this process made it or the index knows its library."""
    from fusegen.pytorch import step as _step

    with _LOCK, _step._LOCK:
        found = _step.memo(request)
        if found is not None:
            return found
        data = _index.lookup_step(request)
        if data is None or data["name"] in _OPS:
            return None
        known = _step.loaded_step(data["name"])
        if known is None:
            _step.check_free(data["name"])
            try:
                _build.load(data["library"])
            except LoadError:
                return None  # gone or unsafe since the lookup: the long way says why

        def generate():
            from fusegen.frontend.statements import parse_program
            parsed = parse_program(request.expr, inputs=request.inputs, scalars=request.scalars)
            return generate_step(parsed, request.name)

        loaded = _step.Loaded(**data, generate=generate)
        return _step.add(request, data["name"], data["digest"], data["text"], lambda: loaded)


def step_key(parsed, name: str | None) -> StepRequest:
    """What names a parsed step-op request in this process's memo and in the index."""
    from fusegen.pytorch.step import StepRequest

    return StepRequest(parsed.text, name, parsed.inputs, parsed.scalars)


def generate_step(parsed, name: str | None = None, command: str | None = None):
    """A step op's (spec, files): every stage but the compiler, what `fusegen PROGRAM
    --no-build` writes."""
    from fusegen.codegen.printer import print_step
    from fusegen.codegen.render import render_step
    from fusegen.ir import limits
    from fusegen.ir.step import step_spec

    spec = step_spec(parsed, name, command)                                         # spec
    files = render_step(spec, *print_step(spec), compiled=_compiled_templates())  # print, render
    limits.check_source(spec.name, files)
    return spec, files


def _fuse_step(parsed, request: StepRequest):
    return load_step(request, *generate_step(parsed, request.name))


def load_step(key: StepRequest, spec, files: dict):
    """The step op of (spec, files), built and loaded unless this process has it; recorded
    in the index under `key` for the next process."""
    from fusegen.pytorch import step as _step

    with _LOCK, _step._LOCK:
        found = _step.memo(key)
        if found is not None:
            return found
        if spec.name in _OPS:
            raise LoadError(f"fusegen op '{spec.name}' is already defined in this process as the elementwise "
                            f"op {_OPS[spec.name].entry.text!r}; pick another name for the step op")
        digest = _keys.files_digest(files)

        def build_and_load():
            library = _build.build([(spec.name, files)])                            # build
            _build.load(library)                                                    # load
            _index.record_step(key, spec.name, spec.inputs, spec.scalars, spec.updated, spec.text,
                               digest, library)
            return _step.Loaded(spec.name, spec.inputs, spec.scalars, spec.updated, spec.text, digest,
                                library, lambda: (spec, files))

        _step.check_free(spec.name)
        return _step.add(key, spec.name, digest, spec.text, build_and_load)


def load(target) -> FusedOp:
    """An op (or step op) built before, in this process or another (the CLI, a script): by its name,
    `fusegen.load("fma")`, from the request index in the cache (no sympy, no compiler: a
    JSON read and a dlopen); or from a generated folder, `fusegen.load("generated/fma")`
    (its spec.json names the expression), which builds the op when the cache no longer holds
    it; a step op's folder (spec.json "kind": "step") gives its FusedStep. `fusegen.ops.fma`
    is `fusegen.load("fma")`. By name, the op built last wins when
    the index knows several expressions under one name."""
    if isinstance(target, os.PathLike) or (isinstance(target, str) and ("/" in target or os.sep in target)):
        return _load_folder(Path(target))
    if not isinstance(target, str):
        raise TypeError(f"fusegen.load: expected an op name or a generated folder, got {target!r}")
    with _LOCK:
        if target in _OPS:
            return _OPS[target]
        step = _loaded_step(target)
        if step is not None:
            return step
        requests, total = _index.named(target)
        other = False
        for request in _recorded(requests):
            if request is None:
                other = True  # recorded by another fusegen, torch, Python or CUDA setup
                continue
            op = cached(request) if isinstance(request, Request) else _cached_step(request)
            if op is not None:
                return op
        raise OpNotFound(_not_found(target, total, other))


class OpNotFound(LoadError):
    """fusegen.load(name) found no op of that name."""


def _recorded(requests: list[dict]):
    """Each index entry's Request (or StepRequest), or None for one recorded in another
    environment (its key is not what this environment computes for the same request)."""
    from fusegen.pytorch.step import StepRequest

    for data in requests:
        try:
            fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k[0] != "_"}
            request = (StepRequest if data.get("_kind") == "step" else Request)(**fields)
        except TypeError:
            continue
        yield request if _keys.request_key(request) == data["_key"] else None


def _not_found(name: str, total: int, other: bool) -> str:
    where = _build.cache_dir() / "index"
    known = [n for n in _index.names() if n != name]
    shown = ", ".join(known[:12]) + (f", ... ({len(known) - 12} more)" if len(known) > 12 else "")
    lines = [f"fusegen.load({name!r}): no op named {name!r} in this process, nor in the request index "
             f"{where}/ ({total} entr{'y' if total == 1 else 'ies'}"
             + (f"; ops there: {shown}" if known else "") + ")"]
    if other:
        lines.append(f"the index has {name!r} from another fusegen, torch, Python or CUDA setup, "
                     "which this one cannot load: build it again")
    folder = Path("generated") / name
    if (folder / "spec.json").is_file():
        lines.append(f"{folder}/ is here: fusegen.load({str(folder)!r}) loads it (building it if need be)")
    lines.append(f"expected an op built with `fusegen \"EXPR\" --name {name}`, fusegen.fuse(EXPR, name={name!r}) "
                 "or @fusegen.fused, with this FUSEGEN_CACHE_DIR")
    return "\n".join(lines)


def _load_folder(path: Path) -> FusedOp:
    """The op of a generated folder: the indexed op whose files are the folder's, else the
    op of its spec.json's expression (built when the cache does not hold it)."""
    import json

    folder = path.parent if path.name == "spec.json" else path
    try:
        data = json.loads((folder / "spec.json").read_text())
        name, expr = data["name"], data["expression"]
        inputs, scalars = tuple(data["inputs"]), tuple(data["scalars"])
        files = {p.name: p.read_text() for p in sorted(folder.iterdir())
                 if p.is_file() and not p.name.startswith(".")}
    except FileNotFoundError:
        raise OpNotFound(f"fusegen.load({str(path)!r}): {folder}/spec.json does not exist; expected a "
                         f"folder that `fusegen EXPR --name NAME` wrote (generated/NAME/)") from None
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise LoadError(f"fusegen.load({str(path)!r}): cannot read {folder}/spec.json ({err}); expected "
                        f"a folder that `fusegen EXPR --name NAME` wrote") from None
    if not isinstance(name, str) or not isinstance(expr, str):
        raise LoadError(f"fusegen.load({str(path)!r}): {folder}/spec.json has no op name and expression")
    if data.get("kind") == "step":
        return _load_step_folder(path, name, expr, inputs, scalars)
    digest = _keys.files_digest(files)
    with _LOCK:
        known = _OPS.get(name)
        if known is not None and known.entry.digest == digest:
            return known
        for request in _recorded(_index.named(name)[0]):
            entry = isinstance(request, Request) and _index.lookup(request)
            if entry is not None and entry.digest == digest:
                op = cached(request)
                if op is not None:
                    return op
        return fuse_many([Request(expr, name, inputs, scalars)])[0]


def _load_step_folder(path: Path, name: str, program: str, inputs, scalars):
    """The step op of a generated folder (spec.json's "kind": "step"): its program, read back
    through the statement parser, built (or found in the cache) and loaded."""
    from fusegen.frontend.statements import parse_program
    from fusegen.ir.expr import ParsedProgram

    parsed = parse_program(program, inputs=inputs, scalars=scalars)
    if not isinstance(parsed, ParsedProgram) or parsed.inputs != inputs or parsed.scalars != scalars:
        raise LoadError(f"fusegen.load({str(path)!r}): spec.json's program {program!r} is not a step op of "
                        f"inputs {list(inputs)} and scalars {list(scalars)}; regenerate the folder")
    return load_step(step_key(parsed, name), *generate_step(parsed, name))


def _names_arg(what: str, value) -> tuple[str, ...] | None:
    """inputs=/scalars= as a tuple of names: a list or tuple of names, or one string of
    comma-separated names ("a,b,c", or "beta" for one)."""
    if value is None:
        return None
    if isinstance(value, str):
        return tuple(p.strip() for p in value.split(","))
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SpecError(f"{what} must be a list of names or a comma-separated string, got {value!r}")

"""@fused: a PyTorch function whose body is one expression becomes a fused op.

    @fusegen.fused
    def silu(x):
        return x * torch.sigmoid(x)

The function is read as source (never run) by the same parser as the CLI, so the
undecorated function stays valid eager PyTorch and serves as the reference.
A parameter is a runtime scalar when it is annotated `float`, `int` or `bool` (a dropout's
`training`), when its default is a number or a bool, or when `scalars=` names it; defaults
work as in Python.

A body that updates parameters in place with `copy_` is a step op (fusegen.FusedStep):

    @fusegen.fused(scalars=("lr", "beta"))
    def momentum_step(p, g, b, lr, beta):
        b.copy_(beta * b + g)
        p.copy_(p - lr * b)       # reads b's new value, as eager does

It is the statement program `b = beta*b + g; p = p - lr*b` (frontend/statements.py), one
kernel; calling it updates p and b and returns None; `.foreach` takes lists.

Functions decorated together are built together. The decorator checks the function at once
(a bad body fails at the `def`), and an op built before in any process is loaded at once;
a new one waits, and the first call of any waiting function (or `fusegen.build_pending()`)
builds every waiting one into one library in one compiler run. So a module with three
@fused functions costs one build at its first use, not three at import.
"""

from __future__ import annotations

import ast
import builtins
import collections
import functools
import inspect
import numbers
import sys
import textwrap
import threading

import torch

from fusegen import api
from fusegen.pytorch import decompose as _decompose
from fusegen.pytorch.binding import arguments
from fusegen.api import Request
from fusegen.frontend import statements
from fusegen.frontend.parse import dotted_name
from fusegen.errors import ParseError, SpecError

# (`bool`: a dropout's `training`, passed to the op as 1.0 or 0.0)
_SCALAR_ANNOTATIONS = (float, int, bool, "float", "int", "bool")


def _is_scalar(param: inspect.Parameter) -> bool:
    default = param.default
    number_default = isinstance(default, numbers.Real)
    return param.annotation in _SCALAR_ANNOTATIONS or number_default


def fused(fn=None, *, name: str | None = None, compile: str | None = None, scalars=()):
    """Decorate a function; usable bare (`@fused`) or with a name (`@fused(name="silu")`).
    `compile`: what torch.compile makes of the op, as for `fusegen.fuse`. `scalars`: names
    of parameters that are runtime floats, besides those annotated or defaulted so."""
    if fn is None:
        def decorate(f):
            return fused(f, name=name, compile=compile, scalars=scalars)
        decorate.__fusegen_fused__ = True  # so that _is_fused knows `@fused(name=...)`
        return decorate
    if hasattr(fn, "__wrapped__"):
        # functools.wraps: the source is the wrapped function's, the behaviour the wrapper's.
        raise SpecError(f"@fused function '{getattr(fn, '__name__', fn)}' is wrapped by another "
                        "decorator (it has __wrapped__): fusegen reads the source, which is not "
                        "what the wrapper computes; put @fused directly above the def, or apply the "
                        "other decorator to the result")
    # The scope the def is in, where its decorators' names are looked up: the caller, or
    # the caller of `decorate` for @fused(name=...).
    frame = sys._getframe(1)
    if frame.f_code is _DECORATE_CODE:
        frame = frame.f_back
    scope = collections.ChainMap(frame.f_locals if frame is not None else {}, getattr(fn, "__globals__", {}))
    del frame
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as err:
        raise ParseError(f"@fused needs the source of '{getattr(fn, '__name__', fn)}' ({err})",
                         repr(fn)) from None
    _check_decorators(fn, source, scope)
    signature = inspect.signature(fn)
    for p in signature.parameters.values():
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise SpecError(f"@fused function '{fn.__name__}': parameter '{p.name}' is *args or "
                            "**kwargs; expected named parameters only")
        if p.default is not p.empty and not _is_scalar(p):
            raise SpecError(f"@fused function '{fn.__name__}': parameter '{p.name}' has default "
                            f"{p.default!r}; expected a number (a runtime scalar) or no default")
    params = tuple(signature.parameters)
    named = (scalars,) if isinstance(scalars, str) else tuple(scalars or ())
    unknown = [s for s in named if s not in params]
    if unknown:
        raise SpecError(f"@fused function '{fn.__name__}': scalars={list(named)} names '{unknown[0]}', which is "
                        f"not a parameter; expected some of {list(params)}")
    scalars = tuple(p for p, v in signature.parameters.items() if _is_scalar(v) or p in named)
    command = f"@fusegen.fused on {fn.__module__}.{fn.__qualname__}"
    if statements.updates_in_place(source):
        if compile is not None:
            raise SpecError(f"@fused(compile=...) on '{fn.__name__}', which updates its parameters in place: a "
                            "step op has one mode under torch.compile (its kernel); drop compile=")
        parsed = statements.parse_function(source, params, scalars)
        return FusedStepFunction(fn, signature, parsed, name or fn.__name__, command)
    request = Request(source, name=name or fn.__name__, scalars=scalars, params=params, command=command)
    _decompose.set_mode(request.name, compile)  # applied when the op is loaded
    return FusedFunction(fn, signature, request)


def _check_decorators(fn, source: str, scope):
    """Refuse a decorator between @fused and the def: it changes what the function computes,
    but fusegen reads the source, so the op would compute the undecorated body while
    `.eager` computed the decorated one. Decorators above @fused apply to the op: fine."""
    try:
        func = ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        return  # parse_function reports it
    if not isinstance(func, ast.FunctionDef) or not func.decorator_list:
        return
    decorators = func.decorator_list
    ours = [i for i, d in enumerate(decorators) if _is_fused(scope, d)]
    below = decorators[ours[-1] + 1:] if ours else decorators
    if below:
        spelled = ", ".join("@" + ast.unparse(d) for d in below)
        line = source.splitlines()[below[0].lineno - 1]
        raise ParseError(f"@fused function '{fn.__name__}' has another decorator below @fused ({spelled}): "
                         "fusegen reads the source, so the op would ignore it while the function "
                         "(and .eager) would not", line, line.find("@"),
                         "put @fused directly above the def, or apply the other decorator to the result")


def _is_fused(scope, decorator: ast.expr) -> bool:
    """Whether a decorator expression is fusegen's @fused (bare, called, or under another
    name), its names looked up in `scope` (the def's locals and globals) and the builtins;
    a name that cannot be looked up counts when it is spelled `fused`."""
    dotted = dotted_name(decorator.func if isinstance(decorator, ast.Call) else decorator)
    if dotted is None:
        return False
    parts = dotted.split(".")
    value = scope[parts[0]] if parts[0] in scope else getattr(builtins, parts[0], _MISSING)
    for attr in parts[1:]:
        if value is _MISSING:
            break
        value = getattr(value, attr, _MISSING)
    if value is _MISSING:
        return parts[-1] == "fused"  # e.g. imported inside the enclosing function
    return value is fused or getattr(value, "__fusegen_fused__", False) is True


_MISSING = object()
_DECORATE_CODE = fused(name=None).__code__


class FusedFunction:
    """What @fused returns: call it like the function. `.op` is the FusedOp (building it and
    every other waiting @fused function, if not built yet); `.eager` is the undecorated
    function, the reference."""

    def __init__(self, fn, signature: inspect.Signature, request: Request):
        functools.update_wrapper(self, fn)
        self.eager = fn
        self._signature = signature
        self._names = tuple(signature.parameters)
        # binding.place fills parameters by position then by name: not positional-only or
        # keyword-only ones, whose rules only bind applies
        placeable = all(p.kind == p.POSITIONAL_OR_KEYWORD for p in signature.parameters.values())
        self._placed = self._names if placeable else None
        self._who = f"@fused function '{self.__name__}'"
        self._order = None
        self._request = request
        self._op = api.cached(request)
        if self._op is None:
            # Checked now, so a bad body fails at its `def`, not at first use.
            self._generated = api.generate(request)
            with _PENDING_LOCK:
                _PENDING.append(self)
            _build_before_compiling()

    @property
    def op(self) -> api.FusedOp:
        if self._op is None:
            build_pending()
        return self._op

    def __call__(self, *args, **kwargs):
        values = arguments(self._placed, self._signature, args, kwargs, self._who, self.__name__)
        op = self._op
        if op is None:
            if torch.compiler.is_compiling():  # a build cannot be traced; torch.compile builds first
                raise RuntimeError(f"@fused function {self._request.name!r} is not built yet and torch.compile "
                                   "is tracing it; call "
                                   "fusegen.build_pending() before compiling")
            op = self.op
        order = self._order
        if order is None:  # the op's parameters by their place in the function's
            order = self._order = tuple(self._names.index(p) for p in op.params)
        return op(*(values[i] for i in order))  # FusedOp: numbers, autograd, torch.func

    def __repr__(self):
        return f"<@fused {self.eager.__module__}.{self.eager.__qualname__}>"


class FusedStepFunction:
    """What @fused returns for a function that updates its parameters in place
    (`p.copy_(...)`): call it like the function, which updates the tensors and returns None,
    as eager does. It is the step op of the same statements (fusegen.FusedStep):
    `.op` is torch.ops.fusegen.<name>, `.foreach(...)` the update over lists of tensors
    (torch.ops.fusegen.<name>_foreach), `.step` the FusedStep; `.eager` is the undecorated
    function, the reference. Built on first use, as the other @fused functions."""

    def __init__(self, fn, signature: inspect.Signature, parsed, name: str, command: str):
        functools.update_wrapper(self, fn)
        self.eager = fn
        self._signature = signature
        self._key = api.step_key(parsed, name)
        self._step = None
        # Checked now, so a bad body fails at its `def`, not at first use.
        self._generated = api.generate_step(parsed, name, command)
        self.name = self._generated[0].name
        with _PENDING_LOCK:
            _PENDING.append(self)
        _build_before_compiling()

    @property
    def step(self):
        """The FusedStep (building it and every other waiting @fused function, if not built yet)."""
        if self._step is None:
            build_pending()
        return self._step

    def _load(self):
        self._step = api.load_step(self._key, *self._generated)

    @property
    def op(self):
        return self.step.op

    @property
    def foreach_op(self):
        return self.step.foreach_op

    @property
    def inputs(self) -> tuple[str, ...]:
        return self._generated[0].inputs

    @property
    def scalars(self) -> tuple[str, ...]:
        return self._generated[0].scalars

    @property
    def updated(self) -> tuple[str, ...]:
        return self._generated[0].updated

    def _ready(self):
        if self._step is None and torch.compiler.is_compiling():
            raise RuntimeError(f"@fused function {self.name!r} is not built yet and torch.compile is tracing it; "
                               "call fusegen.build_pending() before compiling")
        return self.step

    def __call__(self, *args, **kwargs):
        values = dict(zip(self._signature.parameters, api.bind(
            self._signature, args, kwargs, f"@fused function '{self.__name__}'", self.__name__)))
        step = self._ready()
        step(*(values[p] for p in step.inputs + step.scalars))

    def foreach(self, *args, **kwargs):
        """The update over lists, one list per tensor parameter (FusedStep.foreach); scalars
        as for a call, their defaults included."""
        values = dict(zip(self._signature.parameters, api.bind(
            self._signature, args, kwargs, f"@fused function '{self.__name__}'.foreach", self.__name__)))
        step = self._ready()
        step.foreach(*(values[p] for p in step.inputs + step.scalars))

    def __repr__(self):
        return f"<@fused step {self.eager.__module__}.{self.eager.__qualname__}>"


_PENDING: list = []  # FusedFunction and FusedStepFunction
_PENDING_LOCK = threading.Lock()


def _build_before_compiling():
    """torch.compile traces a function's bytecode, and a build (locks, a compiler run, a
    dlopen) cannot be traced: dynamo would stop at the first lock. So when a @fused function
    waits, dynamo's compile-start callback builds the waiting ones before it traces anything.
    Only a process with a build to do imports torch._dynamo for it (a second, next to the
    build's seconds)."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # a torch without the callback: __call__ names build_pending() instead
        return
    if _on_compile_start not in callback_handler.start_callbacks:  # torch._dynamo.reset() clears them
        callback_handler.register_start_callback(_on_compile_start)


def _on_compile_start(_args):
    if _PENDING:
        build_pending()


def build_pending():
    """Build every @fused function not built yet, all into one library, in one compiler run."""
    with _PENDING_LOCK:
        waiting, _PENDING[:] = list(_PENDING), []
    ops = [f for f in waiting if isinstance(f, FusedFunction)]
    steps = [f for f in waiting if isinstance(f, FusedStepFunction)]
    try:
        api.load_requests([(f._request, f._generated) for f in ops])
    except BaseException:
        with _PENDING_LOCK:  # nothing built: they wait for the next try
            _PENDING[:0] = waiting
        raise
    for function in ops:
        function._op = api.cached(function._request)
    for k, function in enumerate(steps):  # a library each, as fusegen.fuse builds a step op
        try:
            function._load()
        except BaseException:
            with _PENDING_LOCK:
                _PENDING[:0] = steps[k:]
            raise

"""The driver: `fuse` runs the pipeline, stage by stage, and returns a FusedOp.

    text --parse--> sympy --differentiate+cse--> OpSpec --print--> C strings
         --render--> files --build--> .so --load--> torch.ops.fusegen.<name>
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass

import torch

from . import build as _build
from .errors import LoadError
from .parse import Parsed, parse
from .printer import print_op
from .render import render
from .spec import OpSpec, differentiate


@dataclass(frozen=True)
class Generated:
    """An op's spec and its rendered files: everything but the binary."""

    spec: OpSpec
    files: dict


def generate(parsed: Parsed, name: str | None = None, command: str | None = None) -> Generated:
    """parse -> differentiate -> print -> render, without building."""
    spec = differentiate(parsed, name=name, command=command)
    return Generated(spec, render(spec, print_op(spec)))


class FusedOp:
    """A built, loaded fusegen op. Call it like the expression: `op(a, b, c, alpha=0.5)`.

    Tensors come first in `inputs` order, then scalars (positional or by keyword).
    `op.op` is `torch.ops.fusegen.<name>`; calling that directly skips the Python binding."""

    def __init__(self, generated: Generated, library: _build.Library):
        self.spec = generated.spec
        self.files = generated.files
        self.library = library
        self.name = self.spec.name
        self.op = getattr(torch.ops.fusegen, self.name)
        self.params = self.spec.inputs + self.spec.scalars
        self._signature = inspect.Signature(
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in self.params])

    @property
    def backward_op(self):
        """torch.ops.fusegen.<name>_backward, or None when every gradient passes grad through."""
        return getattr(torch.ops.fusegen, f"{self.name}_backward") if self.spec.kernel_gradients else None

    def __call__(self, *args, **kwargs):
        if kwargs or len(args) != len(self.params):
            try:
                bound = self._signature.bind(*args, **kwargs)
            except TypeError as err:
                raise TypeError(f"fusegen op '{self.name}': {err}; expected "
                                f"{self.name}({', '.join(self.params)})") from None
            args = tuple(bound.arguments[p] for p in self.params)
        return self.op(*args)

    def __repr__(self):
        return f"FusedOp(torch.ops.fusegen.{self.name}: {self.spec.text})"


# Ops this process has made, by name: the same request returns the same object, and a
# different expression under a name already registered is an error, not a crash.
_OPS: dict[str, FusedOp] = {}
_MEMO: dict[tuple, FusedOp] = {}
_LOCK = threading.Lock()


def _request_key(expr, name, inputs, scalars):
    inputs = tuple(inputs.split(",")) if isinstance(inputs, str) else (tuple(inputs) if inputs else None)
    return (expr, name, inputs, tuple(scalars or ()))


def fuse(expr: str, *, name: str | None = None, inputs=None, scalars=()) -> FusedOp:
    """Turn one elementwise expression into a fused, differentiable op.

    `expr` is Python syntax over tensor names (`"a*b+c"`, `"x*sigmoid(x)"`); `inputs`
    fixes the argument order (default: order of first appearance); `scalars` names
    runtime float arguments (changing their value never rebuilds). The op is registered
    as `torch.ops.fusegen.<name>`; its backward is one fused kernel."""
    key = _request_key(expr, name, inputs, scalars)
    with _LOCK:
        if key in _MEMO:
            return _MEMO[key]
    op = fuse_parsed(parse(expr, inputs=inputs, scalars=scalars), name=name)
    with _LOCK:
        _MEMO[key] = op
    return op


def fuse_parsed(parsed: Parsed, name: str | None = None, command: str | None = None) -> FusedOp:
    return fuse_many([generate(parsed, name=name, command=command)])[0]


def fuse_many(generated: list[Generated]) -> list[FusedOp]:
    """Build several ops into one library (one compile instead of many), load, wrap."""
    with _LOCK:
        todo = []
        for g in generated:
            known = _OPS.get(g.spec.name)
            if known is not None and known.files != g.files:
                raise LoadError(f"fusegen op '{g.spec.name}' is already defined in this process as "
                                f"{known.spec.text!r}; expected the same expression, got {g.spec.text!r}. "
                                "Pick another name.")
            if known is None:
                todo.append(g)
        if todo:
            library = _build.build([(g.spec.name, g.files) for g in todo])
            _build.load(library)
            for g in todo:
                _OPS[g.spec.name] = FusedOp(g, library)
        return [_OPS[g.spec.name] for g in generated]

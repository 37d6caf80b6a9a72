"""Step ops in Python: `fusegen.fuse` of a program that updates inputs returns a FusedStep.

    step = fusegen.fuse("m = b1*m + (1-b1)*g; p = p - lr*m", scalars="lr,b1")
    step(p, g, m, lr=1e-3, b1=0.9)            # torch.ops.fusegen.<name>: one tensor each
    step.foreach(ps, gs, ms, lr=lr_tensor, b1=0.9)  # torch.ops.fusegen.<name>_foreach: lists

A scalar is a Python number, or a 0-d float32/float64 tensor; on the tensors' device the
kernel reads it there, so a learning rate that changes every step is neither a host sync
nor, under torch.compile, a recompile, and a CUDA graph replays it. The plain op's schema
takes numbers only: a call with a tensor scalar goes through `<name>_foreach` with lists
of one.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from fusegen.errors import LoadError, SpecError
from fusegen.pytorch.binding import bind

FOREACH_SUFFIX = "_foreach"  # as ir/step.py names it (this stage reads no ir module)
_LOCK = threading.RLock()  # api's pipeline runs under it too
_STEPS: dict[str, "FusedStep"] = {}        # by name: one program per name in a process
_MEMO: dict[tuple, "FusedStep"] = {}        # by request


@dataclass(frozen=True)
class StepRequest:
    """A step op to make: `fuse`'s arguments as given (its key in the memo and the index).
    Here, not in api, so that a cached load of an op creates neither dataclass."""

    expr: str
    name: str | None = None
    inputs: tuple[str, ...] | None = None
    scalars: tuple[str, ...] = ()


@dataclass(frozen=True)
class Loaded:
    """What a FusedStep needs, from its spec or from the request index (no sympy): its
    parameters, the inputs it updates, its text, a digest of its files and its library.
    `generate()` gives (spec, files) when they are asked for."""

    name: str
    inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    updated: tuple[str, ...]
    text: str
    digest: str
    library: object
    generate: Callable[[], tuple] = field(compare=False, repr=False, default=None)


class FusedStep:
    """A built, loaded step op: updates its `updated` inputs in place, returns None."""

    def __init__(self, loaded: Loaded):
        self._loaded = loaded
        self.library = loaded.library
        self.digest = loaded.digest
        self.name = loaded.name
        self.inputs = loaded.inputs
        self.updated = loaded.updated
        self.scalars = loaded.scalars
        self.text = loaded.text
        self.op = getattr(torch.ops.fusegen, self.name)
        self.foreach_op = getattr(torch.ops.fusegen, self.name + FOREACH_SUFFIX)
        self._signature = inspect.Signature(
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in self.inputs + self.scalars])

    @functools.cached_property
    def _generated(self) -> tuple:
        return self._loaded.generate()

    @property
    def spec(self):
        """The StepSpec (ir/step.py); for a step op found in the index, its pipeline runs now."""
        return self._generated[0]

    @property
    def files(self) -> dict:
        return self._generated[1]

    def __call__(self, *args, **kwargs):
        values = bind(self._signature, args, kwargs, f"fusegen step op '{self.name}'", self.name)
        tensors, scalars = values[:len(self.inputs)], values[len(self.inputs):]
        for name, t in zip(self.inputs, tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"fusegen step op '{self.name}': argument '{name}' must be a tensor, "
                                f"got {type(t).__name__}")
        numbers_, tensor_scalars = self._scalars(scalars)
        if not any(t is not None for t in tensor_scalars):
            self.op(*tensors, *numbers_)
        else:
            self.foreach_op(*[[t] for t in tensors], numbers_, tensor_scalars)

    def foreach(self, *args, **kwargs):
        """The update over lists: one list per tensor input (equal lengths; index k of each
        list forms one update, of one shape), one launch per (device, dtypes) group."""
        values = bind(self._signature, args, kwargs, f"fusegen step op '{self.name}'.foreach", self.name)
        lists, scalars = values[:len(self.inputs)], values[len(self.inputs):]
        checked = []
        for name, items in zip(self.inputs, lists):
            if isinstance(items, torch.Tensor) or not isinstance(items, (list, tuple)):
                raise TypeError(f"fusegen step op '{self.name}'.foreach: argument '{name}' must be a list "
                                f"of tensors, got {type(items).__name__}")
            checked.append(list(items))
        numbers_, tensor_scalars = self._scalars(scalars)
        self.foreach_op(*checked, numbers_, tensor_scalars)

    def _scalars(self, scalars):
        """(the numbers, with 0.0 where a tensor is given; per scalar None or its 0-d tensor)."""
        values, tensors = [], []
        for name, s in zip(self.scalars, scalars):
            if isinstance(s, torch.Tensor):
                if s.dim() != 0 or not s.is_floating_point():
                    raise TypeError(f"fusegen step op '{self.name}': scalar '{name}' must be a number or a "
                                    f"0-d floating-point tensor, got a {s.dim()}-d {s.dtype} tensor")
                if s.dtype not in (torch.float32, torch.float64):
                    s = s.float()
                values.append(0.0)
                tensors.append(s)
            elif isinstance(s, numbers.Real) and not isinstance(s, bool):
                values.append(float(s))
                tensors.append(None)
            else:
                raise TypeError(f"fusegen step op '{self.name}': scalar '{name}' must be a number or a 0-d "
                                f"tensor, got {type(s).__name__}")
        return values, tensors

    def __repr__(self):
        return f"FusedStep(torch.ops.fusegen.{self.name}: {self.text})"


def memo(key: tuple) -> "FusedStep | None":
    """The step op of a request made before in this process."""
    return _MEMO.get(key)


def add(key, name: str, digest: str, text: str, load) -> FusedStep:
    """Registers the step op `name` under `key`: the one loaded under that name when its
    files (`digest`) are the same, else `load()` (build or find and load its library,
    returning a Loaded) and a new FusedStep. The caller has checked the name is free."""
    with _LOCK:
        known = _STEPS.get(name)
        if known is not None:
            if known.digest != digest:
                raise LoadError(f"fusegen step op '{name}' is already defined in this process as "
                                f"{known.text!r}; expected the same program, got {text!r}. Pick another name.")
            _MEMO[key] = known
            return known
        step = _STEPS[name] = _MEMO[key] = FusedStep(load())
        from fusegen.pytorch import dtensor
        dtensor.register_step(step.name, step.scalars)  # its local-shard rule for DTensor arguments
        return step


def check_free(name: str):
    """Before a step op's library is loaded: no op of that name is registered yet."""
    if name not in _STEPS and hasattr(torch.ops.fusegen, name):
        raise SpecError(f"torch.ops.fusegen.{name} already exists in this process; pick another name")


def loaded_step(name: str) -> FusedStep | None:
    return _STEPS.get(name)

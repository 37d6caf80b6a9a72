"""Fusion across a fused op under torch.compile (opt-in): the op as ATen ops of its tree.

Two modes, per op (`fusegen.fuse(..., compile=...)`, `@fused(compile=...)`) or for every
op (`FUSEGEN_COMPILE`, read when fusegen is imported; `DEFAULT` when unset):

- "opaque": torch.compile keeps `fusegen::<name>` as one call (its Meta impl gives the
  shapes, its C++ autograd kernel the backward): the generated kernels run, but Inductor
  cannot fuse them with the ops around them.
- "decompose": while torch.compile traces (not torch.export, not eager), the op is its
  sympy tree evaluated as eager torch ops (composite.py, the same evaluator as third-order
  derivatives), so AOTAutograd records ATen pointwise ops that Inductor fuses with their
  neighbours. AOTAutograd differentiates those ops itself, so the gradients are eager
  PyTorch's, node by node, kinks included (relu'(0) = 0, maximum ties ½/½); the one
  documented difference from the fused kernels, an unchosen `where` branch, then follows
  eager (NaN) instead. Eager calls keep the generated kernels.

  Two choices keep a 16-bit op's float math out of the saved activations, which
  AOTAutograd's partitioner would otherwise write in the forward and read in the
  backward as float32 tensors of the input's size (composite.evaluate): a primitive
  whose derivative reads its result (sigmoid, exp, tanh) recomputes it from its input
  in the backward, with the same formula (derivatives.yaml's, the primitive table's);
  and an output that other outputs read (`h = x + r; (h, norm(h))`) is read as stored,
  rounded to the op's dtype, as the same statements compute in eager PyTorch and as the
  kernels' backward reads the saved output (docs/benchmarks.md, the decoder block's
  compiled step).

How (both call paths, one mechanism): a Python-dispatcher kernel at the Autograd key of
`<name>` and `<name>_backward` (`OpOverload.py_impl`). The C++ dispatcher consults Python
kernels only while the Python dispatcher is enabled, which AOTAutograd does for every
torch.compile trace (dynamo's fake tensors always carry a ShapeEnv) and eager never does;
the kernel wins over the runtime's C++ autograd kernel there because it sits at the same
alias key (`torch._ops.resolve_key`). So a FusedOp call (which `autograd.call` hands to the
op under compile) and `torch.ops.fusegen.<name>` called directly inside a compiled
function decompose alike. Outside torch.compile (torch.export, make_fx) it calls the C++
kernel it stands in front of. `py_impl`, `resolve_key` and `_op_dk` are the same on torch
2.11 and 2.13. An Inductor decomposition (`torch._decomp.register_decomposition` into
`torch._inductor.decomposition`'s registry) was the alternative and is worse: it applies
below autograd, so the C++ autograd kernel would still record the backward as a
`<name>_backward` call (fusegen's formulas, not eager's, and a second op to decompose);
it only serves Inductor (not aot_eager or a custom backend); importing that module costs
about 2 s (all of Inductor) on what should be a millisecond cached load; and Inductor
merges its registries into private tables at import (`decompositions`, copied again by
`fast_random_decomps`), so an op loaded later must be written into those.

Compiled artifacts: torch.compile's caches (AOTAutograd's and Inductor's, on disk) key a
graph by its ops' names, not their implementations (pytorch/pytorch#144344), so a graph
traced through one expression could be served after the expression behind the name
changed. While any op decomposes, its name and the digest of its generated files are
appended to `torch.compiler.config.cache_key_tag` (torch's documented way to separate
cache entries), so a changed expression or mode is a cache miss, never a stale graph.

A cached load stays light: registering the kernel is a dict entry; the op's sympy tree
(`autograd._info`) is derived the first time the kernel traces, under compile only.
"""

from __future__ import annotations

import os

import torch

from fusegen.errors import SpecError

OPAQUE = "opaque"
DECOMPOSE = "decompose"
MODES = (OPAQUE, DECOMPOSE)
DEFAULT = DECOMPOSE       # the mode of an op that was not given one (faster on the H200: docs/benchmarks.md)
ENV = "FUSEGEN_COMPILE"   # overrides DEFAULT for every op of the process

_MODES: dict[str, str] = {}         # op name -> the mode asked for (fuse / @fused compile=)
_LOADED: dict[str, tuple] = {}      # op name -> (its family, the digest of its files)
_KERNELS: set[str] = set()          # ops (and backward ops) holding the Autograd Python kernel
_TAG = "fusegen-decompose:"         # our part of torch.compiler.config.cache_key_tag


def check(mode, what: str) -> str:
    if mode not in MODES:
        raise SpecError(f"{what}: expected compile mode 'decompose' or 'opaque', got {mode!r}")
    return mode


_ENV_MODE = check(os.environ.get(ENV) or DEFAULT, f"environment variable {ENV}")


def mode(name: str) -> str:
    """The op's mode under torch.compile: the one asked for, else FUSEGEN_COMPILE, else DEFAULT."""
    return _MODES.get(name, _ENV_MODE)


def set_mode(name: str, compile_mode: str | None):
    """Ask for a mode for op `name` (None: keep the current one). Read when torch.compile
    traces: set it before compiling (or call torch._dynamo.reset() after changing it)."""
    if compile_mode is None:
        return
    _MODES[name] = check(compile_mode, f"fusegen op '{name}'")
    if name in _LOADED:
        _apply(name)


def loaded(name: str, family: tuple, digest: str):
    """A loaded op (built or cached): install its decomposition if its mode asks for it."""
    _LOADED[name] = (family, digest)
    _apply(name)


def _apply(name: str):
    family, _ = _LOADED[name]
    if mode(name) == DECOMPOSE:
        for member in family:
            if member.name in (name, name + "_backward") and member.name not in _KERNELS:
                _install(member.name)
    _update_cache_tag()


def _compiling() -> bool:
    """Inside a torch.compile trace (dynamo's, and AOTAutograd's under its TracingContext,
    which torch 2.11's is_compiling() does not report), not torch.export's."""
    from torch._guards import TracingContext
    return ((torch.compiler.is_compiling() or TracingContext.try_get() is not None)
            and not torch.compiler.is_exporting())


def _install(op_name: str):
    """The Autograd Python-dispatcher kernel of fusegen::<op_name>: its composite while
    torch.compile traces and the family's mode is decompose; the C++ kernel otherwise."""
    from fusegen.pytorch import autograd
    overload = autograd._op(op_name)
    base = op_name.removesuffix("_backward")
    autograd_key = torch._C.DispatchKey.Autograd

    def kernel(*args):
        if mode(base) == DECOMPOSE and _compiling():
            from fusegen.pytorch.derivatives import composite_outputs
            return composite_outputs(autograd._info(op_name), args, compiled=True)
        return overload._op_dk(autograd_key, *args)

    overload.py_impl(autograd_key)(kernel)
    _KERNELS.add(op_name)


def _update_cache_tag():
    """torch.compiler.config.cache_key_tag: the user's tag, then ours (every decomposed op's
    name and digest), so compiled graphs are cached per expression and mode."""
    config = getattr(torch.compiler, "config", None)
    if not hasattr(config, "cache_key_tag"):
        return  # a torch without the tag: docs/architecture.md says how to clear its caches
    user = config.cache_key_tag.split(_TAG)[0]
    ours = ",".join(f"{n}={d}" for n, (_, d) in sorted(_LOADED.items()) if mode(n) == DECOMPOSE)
    config.cache_key_tag = user + (_TAG + ours if ours else "")

"""Autograd beyond first order, forward-mode AD and torch.func for fusegen ops.

Two paths, one set of fused kernels:

- `torch.ops.fusegen.<name>` called directly, and a FusedOp in plain reverse mode: the
  shared runtime's C++ autograd kernels, written as PyTorch's generated ones are (hand-written
  nodes whose work goes through the dispatcher, which torch.func accepts as it does aten's).
  The forward's node calls <name>_backward, whose own node (double backward) calls
  <name>_grad2_backward; a tangent on an input (forward_ad, torch.func.jvp / jacfwd) sets
  the output's tangent from one <name>_jvp call. Beyond that, `_composite_kernel`
  (registered here at the AutogradCPU/CUDA/Meta keys of <name>_grad2_backward and
  <name>_jvp_backward, which win over the runtime's kernel at the Autograd alias key)
  computes the op as eager torch ops of its expression, and the runtime calls
  fusegen::__composite (defined here) for the forward mode of an op with no fused one
  (<name>_backward under hessian = jacfwd(jacrev), <name>_jvp under jacfwd(jacfwd)).
  Fewest host µs. A standalone build (no fusegen Python) has no composite: it fuses first
  and second reverse order and first forward order, and names the op beyond.
- torch.func transforms and forward_ad, through a FusedOp (`call`): a Python
  `torch.autograd.Function` per op, with `setup_context`, `backward`, `jvp` and
  `generate_vmap_rule=True`, whose forward calls the op below autograd and whose backward
  and jvp call the fused auxiliary ops through `call` again. Same kernels, same results
  (tests/test_forward_ad.py checks every path against eager).

What differentiates each op of a family (both paths):

    op                      reverse mode (vjp)                    forward mode (jvp)
    <name>                  <name>_backward (fused)               <name>_jvp (fused)
    <name>_backward         <name>_grad2_backward (fused)         eager composite
    <name>_jvp              <name>_jvp_backward (fused)           eager composite
    <name>_grad2_backward   eager composite                       eager composite
    <name>_jvp_backward     eager composite                       eager composite

So first and second reverse-mode derivatives, first-order forward mode and reverse over
forward are fused kernels; anything beyond runs the op's sympy tree as eager torch ops
(composite.py), differentiated by autograd and torch.func to any order. That path logs
once per op and mode (logger "fusegen", INFO); it never compiles.

vmap (both paths): every op is elementwise with broadcasting, so a batched call is one
call with the batch dimension moved to the front and the ranks aligned
(`torch.library.register_vmap` for every op; no per-sample loop, no fallback warning).

The auxiliary ops (<name>_grad2, <name>_jvp and their backwards) are compiled on first
use, not with the op: `register(..., auxiliary_loader)` leaves them pending, and the first
call that needs one (the runtime's double-backward node and forward-mode tangent, through
fusegen::__auxiliary; torch.func's path, through `_op`) builds and loads its library, then
registers it here as it registers the op. An op used only in plain forward and backward
never compiles them.

The registration itself is light: a `Member` describes each op of a family by its name, its
number of tensor arguments, whether it is a backward op and whether it has a fused
derivative, which is all torch.library needs. A cached load (index.py) registers from that
description without sympy; the derivatives (derivatives.py) are derived on first need.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch.autograd import forward_ad

from fusegen.build import builder as _builder
from fusegen.errors import FusegenError
from fusegen.ir.family import Member
from fusegen.ir import names
from fusegen.pytorch import dtensor as _dtensor

_LIBRARIES: list = []                   # torch.library.Library objects: alive for the process
_MEMBERS: dict[str, Member] = {}        # op name -> Member, every op of every loaded family
_INFOS: dict = {}                       # op name -> derivatives.OpInfo, once derived
_PROVIDERS: dict[str, Callable] = {}    # op name -> () -> (spec, auxiliary), for a cached load
_OPS: dict = {}                         # op name -> torch.ops.fusegen.<name>.default
_FAMILIES: dict[str, tuple[Member, ...]] = {}  # op name -> its family, the op first
# Auxiliary ops not built yet: op name (<name>_grad2, <name>_jvp) -> the loader that builds
# and loads its library (returning the auxiliary ops it loaded: this one, and any built
# with it), and the family's members it holds, registered once it is loaded.
_PENDING: dict[str, tuple[Callable, tuple[Member, ...]]] = {}
_OWNER: dict[str, str] = {}             # a pending member's name -> its auxiliary op's name
_PENDING_LOCK = threading.RLock()       # one build per auxiliary op, whichever thread asks
_unpack_dual = torch._C._VariableFunctions._unpack_dual
_is_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_Tensor = torch.Tensor


def _op(name: str):
    op = _OPS.get(name)
    if op is None:
        owner = _OWNER.get(name)
        if owner is not None:
            load_auxiliary(owner)
        op = _OPS[name] = getattr(torch.ops.fusegen, name).default
    return op


def load_auxiliary(name: str):
    """Build (or find in the cache) and load the auxiliary op `name` and register it, once;
    nothing when it is loaded already or is no pending auxiliary op (the runtime asks for
    any op it does not find)."""
    with _PENDING_LOCK:
        pending = _PENDING.get(name)
        if pending is None:
            return
        loader = pending[0]
        for loaded in loader(name):  # `name` and the ops built with it
            if loaded in _PENDING:  # (else registered as its library loaded)
                _adopt(loaded)


def adopt_loaded_auxiliary():
    """Register the members of every pending auxiliary op that a loaded library has brought
    along (`_loaded`): the runtime finds such an op and never asks for it."""
    with _PENDING_LOCK:
        for name in [n for n in _PENDING if _loaded(n)]:
            _adopt(name)


def _adopt(name: str):
    """Register pending auxiliary op `name`'s members, its library loaded (_PENDING_LOCK held)."""
    _, members = _PENDING.pop(name)
    for m in members:
        _OWNER.pop(m.name, None)
    _register_members(members, torch.library.Library("fusegen", "IMPL"))


_builder.AFTER_LOAD.append(adopt_loaded_auxiliary)


def _info(name: str):
    """The op's derivatives, derived on first need (sympy; once per family)."""
    info = _INFOS.get(name)
    if info is None:
        from fusegen.pytorch import derivatives
        spec, auxiliary = _PROVIDERS[name]()
        for i in derivatives.infos(spec, auxiliary, _call_op, _op):
            _INFOS.setdefault(i.name, i)
        info = _INFOS[name]
    return info


def _has_tangent(tensors) -> bool:
    """A forward-mode tangent on any tensor (only possible inside `forward_ad.dual_level()`,
    which torch.func.jvp enters too)."""
    return (forward_ad._current_level >= 0 and torch._C._is_fwd_grad_enabled()
            and any(_unpack_dual(t, 0).tangent is not None for t in tensors))


def eager() -> bool:
    """Whether a FusedOp call may go straight to the op (api.FusedOp.__call__'s fast path,
    which spells this condition out in its own frame):
    not traced by torch.compile, no torch.func transform, no forward-mode level. Then `call`
    would call the op as it is, whatever its arguments (a number among the tensors, which
    the op refuses, takes the full path of `as_tensors` and `call`)."""
    return not (_is_compiling() or _functorch_active() or forward_ad._current_level >= 0)


def call(name: str, *args):
    """Call fusegen::<name> with autograd, forward-mode AD and torch.func support. Plain
    reverse mode (no torch.func transform, no forward-mode tangent) calls the op itself:
    its C++ autograd kernel fuses first and second order, and the composite kernel
    (`_composite_kernel`) of <name>_grad2_backward takes any order beyond. Under torch.func
    or forward_ad it applies the op's autograd.Function (fused derivatives where the family
    has them, the composite beyond)."""
    # Every call comes through here: plain loops and names bound once (a generator or an
    # attribute chain per call costs a few hundred ns, at n = 4096 a tenth of the op).
    op = _OPS.get(name) or _op(name)
    if _is_compiling():
        from fusegen.pytorch.onnx_trace import onnx_composite
        if onnx_composite(name):  # torch.onnx.export without fusegen's translation table
            from fusegen.pytorch.derivatives import composite_outputs
            return composite_outputs(_info(name), args)
        return op(*args)  # traced as the op (C++ autograd kernel, Meta impl) or decomposed (decompose.py)
    tensors = args[:_MEMBERS[name].tensors]
    for t in tensors:
        if not isinstance(t, _Tensor):
            return op(*args)  # the op's own checks name the argument
    if not (_functorch_active() or _has_tangent(tensors)):
        return op(*args)
    if _MEMBERS[name].random:
        raise FusegenError(f"fusegen op '{name}' draws random numbers: torch.func transforms (vmap, grad, "
                           "jacrev, ...) and forward-mode AD of it are not supported; call it under "
                           "plain autograd (loss.backward(), torch.autograd.grad)")
    info = _info(name)
    if info.backward:
        from fusegen.pytorch.derivatives import _Mask
        return list(info.function.apply(*args[:-1], _Mask(args[-1])))
    return info.function.apply(*args)


def _call_op(name: str, *args):
    """`call`, looked up when called: what the fused derivatives (derivatives.py) call the
    family's ops through, so a replaced `call` (a wrapper that records calls) sees them too."""
    return call(name, *args)


def _refused_order(name: str) -> str:
    return (f"fusegen::{name}: a third derivative, or forward-mode AD through a double backward, of an "
            "op that draws random numbers is not supported; its first and second reverse-mode derivatives are")


class _RefusedOrder(torch.autograd.Function):
    """The second derivative of an op that draws random numbers, computed by its fused
    kernel, with a node that refuses to be differentiated again: create_graph=True on a
    double backward (a gradient penalty written with it out of habit) works, and only a
    third derivative, when asked for, raises."""

    @staticmethod
    def forward(ctx, name, compute, *tensors):
        ctx.name = name
        return tuple(compute())

    @staticmethod
    def backward(ctx, *grads):
        raise FusegenError(_refused_order(ctx.name))


def _composite_kernel(member: Member):
    """The autograd kernel (AutogradCPU/CUDA/Meta, which win over the shared runtime's C++
    kernel at the Autograd alias key) of an op with no fused derivative
    (<name>_grad2_backward, <name>_jvp_backward): when something differentiates it (reverse
    or forward mode), its composite; otherwise the kernel below autograd."""
    after = torch._C._after_autograd_keyset

    def kernel(keyset, *args):
        tensors = [t for t in args[:member.tensors] if isinstance(t, torch.Tensor)]
        if len(tensors) == member.tensors and (
                (torch.is_grad_enabled() and torch._C._any_requires_grad(*tensors)) or _has_tangent(tensors)):
            if member.random:  # its composite would draw other numbers than the forward did
                if _has_tangent(tensors):
                    raise FusegenError(_refused_order(member.name))

                def below():
                    with torch._C._AutoDispatchBelowAutograd():
                        return _op(member.name).redispatch(keyset & after, *args)
                return list(_RefusedOrder.apply(member.name, below, *tensors))
            from fusegen.pytorch.derivatives import _composite_forward
            return _composite_forward(_info(member.name), args)
        with torch._C._AutoDispatchBelowAutograd():
            return _op(member.name).redispatch(keyset & after, *args)
    return kernel


# -- vmap: broadcasting, no loop --------------------------------------------------------------

def _vmap_rule(member: Member):
    n = member.tensors

    def rule(vinfo, in_dims, *args):
        if member.random:  # as torch.vmap's randomness="error"
            raise FusegenError(f"fusegen op '{member.name}' draws random numbers: vmap of it is not supported")
        dims = in_dims[:n]
        tensors = list(args[:n])
        rank = max(t.dim() - (d is not None) for t, d in zip(tensors, dims))
        for i, (t, d) in enumerate(zip(tensors, dims)):
            if d is not None:
                t = t.movedim(d, 0)
                for _ in range(rank - (t.dim() - 1)):
                    t = t.unsqueeze(1)
                tensors[i] = t
        out = _op(member.name)(*tensors, *args[n:])
        if member.backward:
            return out, [0] * len(out)
        return out, ((0,) * len(out) if member.outputs > 1 else 0)
    return rule


_AUTOGRAD_KEYS = ("AutogradCPU", "AutogradCUDA", "AutogradMeta")

# The shared runtime's autograd kernels call this op when an op of a family that has no fused
# forward-mode derivative (<name>_backward, <name>_jvp, <name>_grad2) gets an input with a
# tangent (hessian = jacfwd(jacrev), jacfwd(jacfwd)): the op computed as eager torch ops of
# its expression, whose forward mode (and anything else) is PyTorch's. `__`: no user's op
# can be named so (names.name_problem).
COMPOSITE_SCHEMA = "__composite(str op, Tensor[] tensors, float[] scalars, bool[] mask) -> Tensor[]"
# The shared runtime calls this op when an op of a family needs an auxiliary op that is not
# loaded (templates/runtime/fusegen-autograd.cpp, find_auxiliary): `load_auxiliary`.
AUXILIARY_SCHEMA = "__auxiliary(str op) -> ()"
# ... and this one on the first CPU call of an op whose library left its CPU kernels for
# later (templates/runtime/fusegen-registration.cpp, cpu_kernels_of): builder.load_cpu_kernels.
CPU_KERNELS_SCHEMA = "__cpu_kernels(str op) -> ()"


def _load_cpu_kernels(name: str):
    from fusegen.build import builder
    builder.load_cpu_kernels(name)


def _composite_op(op: str, tensors, scalars, mask):
    from fusegen.pytorch.derivatives import _note, composite_outputs
    info = _info(op)
    _note(info, "its forward-mode derivative")
    out = composite_outputs(info, (*tensors, *scalars, *([list(mask)] if info.backward else [])))
    return list(out) if info.backward or info.several else [out]


def _define_composite():
    lib = torch.library.Library("fusegen", "FRAGMENT")
    _LIBRARIES.append(lib)
    lib.define(COMPOSITE_SCHEMA)
    lib.impl("__composite", _composite_op, "CompositeImplicitAutograd")
    lib.define(AUXILIARY_SCHEMA)
    lib.impl("__auxiliary", load_auxiliary, "CompositeImplicitAutograd")
    lib.define(CPU_KERNELS_SCHEMA)
    lib.impl("__cpu_kernels", _load_cpu_kernels, "CompositeImplicitAutograd")


def _register_members(members, lib):
    _LIBRARIES.append(lib)
    for m in members:
        torch.library.register_vmap(f"fusegen::{m.name}", _vmap_rule(m), lib=lib)
        if m.composite:
            kernel = _composite_kernel(m)
            for key in _AUTOGRAD_KEYS:
                lib.impl(m.name, kernel, key, with_keyset=True)
    _dtensor.register(members)  # DTensor's pointwise sharding rule, when DTensor is in use


def _auxiliary_of(op: str, member: str) -> str | None:
    """The auxiliary op (<op>_grad2, <op>_jvp) that defines `member`, or None for the op's own."""
    for suffix in (names.GRAD2_SUFFIX, names.JVP_SUFFIX):
        if member in (op + suffix, op + suffix + names.BACKWARD_SUFFIX):
            return op + suffix
    return None


def _loaded(name: str) -> bool:
    """Whether fusegen::<name> is in the dispatcher already. An auxiliary op built on first use
    goes into its op's library, so a later process that loads the library has it without
    asking: the runtime then never calls `__auxiliary` for it, and its members must be
    registered with the family's (the composite kernel of <name>_grad2_backward, which a
    third derivative needs)."""
    try:
        torch._C._dispatch_find_schema_or_throw(f"fusegen::{name}", "")
    except RuntimeError:
        return False
    return True


def _register(members: tuple[Member, ...], auxiliary_loader: Callable | None):
    """vmap rules for every op of the family, the composite autograd kernel for those with
    no fused derivative. With `auxiliary_loader(name)`, which builds and loads auxiliary op
    `name`, the auxiliary ops' members wait for their first use (`load_auxiliary`)."""
    with _PENDING_LOCK:
        if not _FAMILIES:
            _define_composite()
        now, later = [], {}
        for m in members:
            _MEMBERS[m.name] = m
            owner = _auxiliary_of(members[0].name, m.name) if auxiliary_loader else None
            if owner is None:
                now.append(m)
            else:
                later.setdefault(owner, []).append(m)
                _OWNER[m.name] = owner
        for owner, held in later.items():
            _PENDING[owner] = (auxiliary_loader, tuple(held))
        _register_members(now, torch.library.Library("fusegen", "IMPL"))
        _FAMILIES[members[0].name] = members
        adopt_loaded_auxiliary()  # those an earlier process built into the loaded library


def register(spec, auxiliary, auxiliary_loader: Callable | None = None) -> tuple[Member, ...]:
    """A built op: derive its family's derivatives and register them (the auxiliary ops on
    first use when `auxiliary_loader` is given, see `_register`). Returns the family's
    description, which the index keeps for a cached load (`register_cached`)."""
    if spec.name not in _FAMILIES:
        from fusegen.ir import rows
        from fusegen.pytorch import derivatives
        infos = derivatives.infos(spec, auxiliary, _call_op, _op)
        for info in infos:
            _INFOS[info.name] = info
        random = bool(spec.random)
        _register(tuple(Member(i.name, len(i.tensors) + int(random and i.backward), i.backward, i.vjp is None,
                               i.count, i.joined, rows.has_reduction(i.outputs), random)
                        for i in infos),
                  auxiliary_loader)
    return _FAMILIES[spec.name]


def register_cached(members: tuple[Member, ...], provider: Callable, auxiliary_loader: Callable | None = None):
    """A cached op: register from the family's description; `provider()` returns (spec,
    auxiliary) when a derivative is first needed."""
    if members[0].name in _FAMILIES:
        return
    for m in members:
        _PROVIDERS[m.name] = provider
    _register(members, auxiliary_loader)


def load_family(op: str):
    """Build and load every auxiliary op of op `op`'s family that waits for its first use."""
    for name in pending_auxiliary():
        if _auxiliary_of(op, name) == name:
            load_auxiliary(name)


def pending_auxiliary() -> list[str]:
    """The auxiliary ops registered to be built on first use that have not been, sorted."""
    with _PENDING_LOCK:
        return sorted(_PENDING)

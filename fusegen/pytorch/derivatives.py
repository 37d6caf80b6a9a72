"""The derivatives of a fusegen op family as autograd sees them (autograd.py registers them).

The fused derivatives call the family's ops through the entry point autograd.py hands to
`infos` (its `call`), so this module does not import autograd.py.

Everything here needs the op's sympy trees, so it is imported only when a derivative beyond
the C++ kernels' plain reverse mode is asked for (a torch.func transform, a forward-mode
tangent, third order), or when an op is built; a cached load never imports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import sympy
import torch

from fusegen.pytorch import composite
from fusegen.ir import dag
from fusegen.ir import primitives as fn
from fusegen.ir import names
from fusegen.ir.expr import symbol
from fusegen.ir import rows
from fusegen.ir.spec import GRAD, OpSpec, backward as reverse_pass, forward_tangents

log = logging.getLogger("fusegen")


@dataclass
class OpInfo:
    """One registered op as autograd sees it: its arguments and its outputs as sympy trees."""

    name: str                           # fusegen::<name>
    tensors: tuple[sympy.Symbol, ...]   # tensor arguments, schema order (none is spec.GRAD)
    scalars: tuple[sympy.Symbol, ...]
    outputs: tuple[sympy.Expr, ...]     # one tree per output (a backward op: per kernel gradient)
    backward: bool                      # a `<x>_backward` op: Tensor[] result, trailing mask
    count: int = 1                      # its results (a backward op: its douts)
    joined: bool = False                # two outputs returned as the halves of one tensor
    vjp: object = None                  # fused reverse mode: vjp(ctx, *grads), or None
    jvp: object = None                  # fused forward mode: jvp(ctx, *tangents), or None
    function: object = None             # the op's torch.autograd.Function
    saved_output: int | None = None     # the output its backward reads (saved after the inputs)
    find_op: object = None              # name -> OpOverload (autograd's: builds an auxiliary op)
    _derived: dict = field(default_factory=dict)

    @property
    def op(self):
        return self.find_op(self.name)  # an auxiliary op is built on its first call

    @property
    def several(self) -> bool:
        """A forward op of several outputs: its result is a tuple of tensors."""
        return not self.backward and not self.joined and len(self.outputs) > 1


def _forward_info(spec: OpSpec) -> OpInfo:
    return OpInfo(spec.name, tuple(map(symbol, spec.inputs)), tuple(map(symbol, spec.scalars)),
                  spec.outputs, False, 1 if spec.joined else len(spec.outputs), spec.joined)


def _backward_info(spec: OpSpec) -> OpInfo:
    # The backward's douts become ordinary arguments, so that differentiating its outputs
    # again (whose reverse pass seeds the douts) cannot confuse the two.
    douts = tuple(sympy.Dummy(d.name) for d in spec.douts)
    return OpInfo(spec.name + names.BACKWARD_SUFFIX, douts + tuple(map(symbol, spec.backward_inputs)),
                  tuple(map(symbol, spec.backward_scalars)),
                  tuple(dag.substitute(spec.backward_exprs, dict(zip(spec.douts, douts)))), True, len(douts))


def _halves(grad):
    """A joined op's result gradient as its two outputs' (views; None stays None)."""
    return grad.chunk(2, -1) if grad is not None else (None, None)


def _complete(douts):
    """The incoming gradients as the backward kernel reads them (the runtime's
    complete_douts): None when none arrived, else a missing one as a zero of the others'
    shape (an output not used in the loss)."""
    given = next((d for d in douts if d is not None), None)
    if given is None:
        return None
    return [d if d is not None else torch.zeros((), dtype=given.dtype, device=given.device).expand(given.shape)
            for d in douts]


# -- reduction to an input's shape and dtype, as the C++ runtime's reduce_to_input --------------

def _reduce(grad, like):
    if grad.shape != like.shape:
        grad = grad.sum_to_size(like.shape)
    return grad if grad.dtype == like.dtype else grad.to(like.dtype)


# -- fused vjp / jvp of each family member ------------------------------------------------------

def _dout_op(steps, dout):
    """A gradient of dout alone: eager's ops, in order (the runtime's apply_steps)."""
    g = dout
    for op, value in steps:
        g = -g if op == "-" else (g * value if op == "*" else g / value)
    return g


def _gradients_of(spec: OpSpec, dout, needs, call, like):
    """Each input's gradient where needs[i], as the runtime's gradients_of computes them:
    one kernel output per distinct gradient (requested when an input that has it needs
    it), eager ops on dout when every requested output is a function of dout alone.
    `call(mask)` returns the requested kernel outputs; like(i) the tensor to reduce to."""
    grads = {}
    mask = [False] * len(spec.kernel_gradients)
    kernel = False
    for i, g in enumerate(spec.gradients):
        if needs[i] and g.output is not None:
            mask[g.output] = True
            kernel = kernel or g.dout_steps is None
    computed = {}
    if kernel:
        it = iter(call(mask))
        computed = {k: next(it) for k, m in enumerate(mask) if m}
    for i, g in enumerate(spec.gradients):
        if not needs[i]:
            continue
        full = computed.get(g.output)
        if full is None and g.dout_steps is not None:
            full = _dout_op(g.dout_steps, dout)
        if full is not None:
            grads[i] = _reduce(full, like(i))
    return grads


def _vjp_of_forward(spec: OpSpec, call_op):
    """<name>'s reverse mode: <name>_backward, plus the gradients of dout alone."""
    index = {x: i for i, x in enumerate(spec.inputs)}
    scalar_args = [spec.scalars.index(s) for s in spec.backward_scalars]

    def vjp(ctx, *douts):
        tensors = ctx.saved_tensors  # the inputs, then the output when the backward reads it
        grads = [None] * (len(spec.inputs) + len(spec.scalars))
        douts = _complete(_halves(douts[0]) if spec.joined else douts)
        if douts is None:
            return grads
        reads = [tensors[-1] if x == spec.saved_output else tensors[index[x]] for x in spec.backward_inputs]

        def call(mask):
            return call_op(spec.name + names.BACKWARD_SUFFIX,
                           *douts, *reads, *[ctx.scalars[i] for i in scalar_args], mask)
        for i, g in _gradients_of(spec, douts[0], ctx.needs_input_grad, call, lambda i: tensors[i]).items():
            grads[i] = g
        return grads
    return vjp


def _vjp_of_backward(spec: OpSpec, grad2: OpSpec, call_op):
    """<name>_backward's reverse mode (double backward): <name>_grad2_backward called with
    incoming gradient 1 and gg_<x> = the gradients arriving at each computed gradient."""
    own = tuple(d.name for d in spec.douts) + spec.backward_inputs  # <name>_backward's tensors
    # grad2's inputs: the douts, the backward's inputs, gg_<x> per kernel gradient, in order.
    grad2_own = {n: i for i, n in enumerate(grad2.inputs[:len(own)])}
    gg_names = grad2.inputs[len(own):]
    scalar_args = [spec.backward_scalars.index(s) for s in grad2.backward_scalars]
    op_name = grad2.name + names.BACKWARD_SUFFIX

    def vjp(ctx, *ggs):
        tensors = ctx.saved_tensors                   # the douts, the backward's inputs
        requested = [k for k, m in enumerate(ctx.mask) if m]
        arriving = dict(zip(requested, ggs))
        grads = [None] * (len(own) + len(spec.backward_scalars) + 1)
        if all(g is None for g in arriving.values()):
            return grads
        dtype = composite.promoted_dtype(tensors)
        device = tensors[0].device
        values = {n: tensors[i] for n, i in grad2_own.items()}
        for k, gname in enumerate(gg_names):
            g = arriving.get(k)
            values[gname] = g if g is not None else torch.zeros((), dtype=dtype, device=device)
        needs = ctx.needs_input_grad
        one = torch.ones((), dtype=dtype, device=device)
        ones = one.expand(torch.broadcast_shapes(*[v.shape for v in values.values()]))
        wanted = [n in grad2_own and needs[grad2_own[n]] for n in grad2.inputs]

        def call(mask):
            return call_op(op_name, one, *[values[n] for n in grad2.backward_inputs],
                           *[ctx.scalars[i] for i in scalar_args], mask)
        for j, g in _gradients_of(grad2, ones, wanted, call, lambda j: tensors[grad2_own[grad2.inputs[j]]]).items():
            grads[grad2_own[grad2.inputs[j]]] = g
        return grads
    return vjp


def _jvp_of_forward(spec: OpSpec, jvp_spec: OpSpec, call_op):
    """<name>'s forward mode: <name>_jvp(<inputs it reads>, t_<x>..., <scalars it reads>)."""
    index = {x: i for i, x in enumerate(spec.inputs)}
    # jvp_spec's inputs: the primals it reads, then one tangent per input with a nonzero
    # gradient, in input order.
    moving = [index[g.input] for g in spec.gradients if g.expr != 0]
    tangent_of = dict(zip(jvp_spec.inputs[len(jvp_spec.inputs) - len(moving):], moving))
    op_name = jvp_spec.name

    def jvp(ctx, *tangents):
        tensors = ctx.saved_tensors
        dtype = composite.promoted_dtype(tensors)
        args = []
        any_tangent = False
        for n in jvp_spec.inputs:
            if n in tangent_of:
                t = tangents[tangent_of[n]]
                any_tangent = any_tangent or t is not None
                args.append(t if t is not None else torch.zeros((), dtype=dtype, device=tensors[0].device))
            else:
                args.append(tensors[index[n]])
        several = len(spec.outputs) > 1
        if not any_tangent:
            outs = [torch.zeros(ctx.out_shape, dtype=dtype, device=tensors[0].device) for _ in spec.outputs]
        else:
            scalars = [ctx.scalars[spec.scalars.index(s)] for s in jvp_spec.scalars]
            out = call_op(op_name, *args, *scalars)
            outs = [o if tuple(o.shape) == tuple(ctx.out_shape) else o.expand(ctx.out_shape).clone()
                    for o in (out if several else (out,))]
        return _results(spec.joined, several, outs)
    return jvp


# -- derivatives by the expression: the eager composite -----------------------------------------

def _split(info: OpInfo, args):
    n = len(info.tensors)
    return list(args[:n]), list(args[n:n + len(info.scalars)]), (list(args[-1]) if info.backward else None)


def _note(info: OpInfo, what: str):
    key = "logged " + what
    if key not in info._derived:
        info._derived[key] = True
        log.info("fusegen::%s: %s is not fused; it runs as eager torch ops of its expression "
                 "(correct, slower, nothing is compiled)", info.name, what)


def _composite_vjp(info: OpInfo):
    """Reverse mode by the expression: d/dx_j of sum_k gg_k * out_k, from the same reverse
    pass (PyTorch's formulas), evaluated with torch ops (differentiable again)."""
    def derive():
        gg = tuple(sympy.Dummy(f"gg{k}") for k in range(len(info.outputs)))
        h = None
        for g, o in zip(gg, info.outputs):
            term = fn.mul(g, o)
            h = term if h is None else fn.add(h, term)
        d = reverse_pass(h, list(info.tensors))
        return gg, [d[t] for t in info.tensors]

    def vjp(ctx, *grads):
        _note(info, "its derivative")
        if "vjp" not in info._derived:
            info._derived["vjp"] = derive()
        gg, exprs = info._derived["vjp"]
        tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad
        out = [None] * (len(info.tensors) + len(info.scalars) + info.backward)
        if info.joined:
            grads = _halves(grads[0])
        arriving = dict(zip([k for k, m in enumerate(ctx.mask) if m], grads)) if info.backward \
            else dict(enumerate(grads))
        wanted = [i for i in range(len(tensors)) if needs[i]]
        if not wanted or all(g is None for g in arriving.values()):
            return out
        values = _values(info, tensors, ctx.scalars)
        values[GRAD] = 1.0
        values.update((gg[k], arriving.get(k) if arriving.get(k) is not None else 0.0) for k in range(len(gg)))
        present = list(tensors) + [g for g in arriving.values() if g is not None]
        # in the compute dtype, unrounded: _reduce sums a broadcast input's gradient first
        computed = composite.evaluate([exprs[i] for i in wanted], values, _shape(present),
                                      composite.compute_dtype(composite.promoted_dtype(tensors)),
                                      tensors[0].device)
        for i, g in zip(wanted, computed):
            out[i] = _reduce(g, tensors[i])
        return out
    return vjp


def _composite_jvp(info: OpInfo):
    """Forward mode by the expression: sum_j d out_k/dx_j * t_j per output."""
    def derive():
        tangents = tuple(sympy.Dummy(f"t{j}") for j in range(len(info.tensors)))
        if rows.has_reduction(info.outputs):  # not diagonal: pushed forward (spec.forward_tangents)
            return tangents, list(forward_tangents(info.outputs, dict(zip(info.tensors, tangents))))
        exprs = []
        for o in info.outputs:
            d = reverse_pass(o, list(info.tensors))
            total = None
            for t, x in zip(tangents, info.tensors):
                if d[x] != 0:
                    (term,) = dag.substitute([d[x]], {GRAD: t})
                    total = term if total is None else fn.add(total, term)
            exprs.append(sympy.Integer(0) if total is None else total)
        return tangents, exprs

    def jvp(ctx, *tangents):
        _note(info, "its forward-mode derivative")
        if "jvp" not in info._derived:
            info._derived["jvp"] = derive()
        names_t, exprs = info._derived["jvp"]
        tensors = ctx.saved_tensors
        values = _values(info, tensors, ctx.scalars)
        values.update((n, t if t is not None else 0.0) for n, t in zip(names_t, tangents))
        if info.backward:
            exprs = [e for e, m in zip(exprs, ctx.mask) if m]
        out = _evaluate(exprs, values, ctx.out_shape, tensors, tensors[0].device)
        return tuple(out) if info.backward else _results(info.joined, info.several, out)
    return jvp


def _values(info: OpInfo, tensors, scalars) -> dict:
    """Symbol -> value: each tensor in the dtype the expression is computed in (float32 for
    a 16-bit op, as its kernels; a gather's index in the dtype it is compared in), each
    scalar as it came."""
    dtype = composite.promoted_dtype(tensors)
    index = info._derived.get("index")
    if index is None:
        index = info._derived["index"] = fn.index_symbols(info.outputs)
    values = {s: t.to(composite.index_dtype(dtype) if s in index else composite.compute_dtype(dtype))
              for s, t in zip(info.tensors, tensors)}
    values.update(zip(info.scalars, scalars))
    return values


def _shape(tensors):
    return torch.broadcast_shapes(*[t.shape for t in tensors])


# -- the autograd.Function, the entry point, the composite kernel --------------------------------

class _Mask:
    """A backward op's output_mask as one opaque argument of an autograd.Function: a list
    would be a pytree of bools to torch.func (vmap's in_dims, jvp's tangents)."""

    __slots__ = ("bits",)

    def __init__(self, bits):
        self.bits = tuple(bool(b) for b in bits)

    def __iter__(self):
        return iter(self.bits)


def _function(info: OpInfo):
    """The torch.autograd.Function of one op: forward calls the op (below autograd), backward
    and jvp call the fused ops; vmap is generated from the ops' own batching rules."""

    def forward(*args):
        if info.backward:
            args = args[:-1] + (list(args[-1]),)
        with torch._C._AutoDispatchBelowAutograd():
            out = info.op(*args)
        return tuple(out) if info.backward else out

    def setup_context(ctx, inputs, output):
        tensors, scalars, mask = _split(info, inputs)
        ctx.scalars = scalars
        ctx.mask = mask
        ctx.out_shape = (output[0].shape if output else ()) if info.backward or info.several else output.shape
        if info.joined:  # each output's: half of the result's last dimension
            ctx.out_shape = (*ctx.out_shape[:-1], ctx.out_shape[-1] // 2)
        # The output the backward reads, if any (output k of several): saved as an output, so
        # autograd's version counter catches an in-place change of it before backward.
        saved = () if info.saved_output is None else (output[info.saved_output] if info.several else output,)
        ctx.save_for_backward(*tensors, *saved)
        ctx.save_for_forward(*tensors)

    vjp = info.vjp or _composite_vjp(info)
    jvp = info.jvp or _composite_jvp(info)

    def backward(ctx, *grads):
        return tuple(vjp(ctx, *grads))

    return type(f"fusegen_{info.name}", (torch.autograd.Function,), {
        "generate_vmap_rule": True,
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "jvp": staticmethod(lambda ctx, *tangents: jvp(ctx, *tangents)),
    })


def _composite_forward(info: OpInfo, args):
    """The op's outputs as eager torch ops, for a derivative beyond the fused ones."""
    _note(info, "its derivative (third order and above)")
    return composite_outputs(info, args)


def composite_outputs(info: OpInfo, args, compiled: bool = False):
    """The op's outputs computed by eager torch ops of its expression (the op's own
    arguments and result: a backward op's requested gradients as a list), in float for a
    16-bit op as its kernels compute: differentiable by autograd to any order. `compiled`:
    the form torch.compile traces in "decompose" mode, whose backward AOTAutograd's
    partitioner plans (composite.evaluate's recompute_results, and a forward's outputs
    read by others as stored)."""
    tensors, scalars, mask = _split(info, args)
    values = _values(info, tensors, scalars)
    exprs = list(info.outputs) if mask is None else [e for e, m in zip(info.outputs, mask) if m]
    # A 0-d CPU tensor may come with CUDA tensors (as in eager): the result is on theirs.
    device = next((t.device for t in tensors if t.dim() > 0), tensors[0].device)
    out = _evaluate(exprs, values, _shape(tensors), tensors, device, compiled, stored=compiled and not info.backward)
    return out if info.backward else _results(info.joined, info.several, out)


def _evaluate(exprs, values: dict, shape, tensors, device, recompute_results: bool = False,
              stored: bool = False) -> list[torch.Tensor]:
    """The expressions over `values` in the op's compute dtype (float32 for a 16-bit op),
    each rounded to the op's dtype once, at the end, as the kernels store their outputs
    (and where `stored`, before other outputs read it: composite.evaluate)."""
    dtype = composite.promoted_dtype(tensors)
    compute = composite.compute_dtype(dtype)
    outs = composite.evaluate(exprs, values, shape, compute, device, recompute_results,
                              stored=dtype if stored and dtype != compute else None)
    return [o if o.dtype == dtype else o.to(dtype) for o in outs]


def _results(joined: bool, several: bool, outs):
    """A forward op's outputs as it returns them: joined (torch.cat along the last
    dimension), a tuple, or the one tensor."""
    return torch.cat(outs, -1) if joined else tuple(outs) if several else outs[0]


def infos(spec: OpSpec, auxiliary: tuple[OpSpec, ...], call_op, find_op) -> list[OpInfo]:
    """Every op of the family (the op, its auxiliary ops, the backward of each) with its
    fused derivatives where the family has them, and its autograd.Function. The fused
    derivatives call the family's ops as `call_op(name, *args)` (autograd.call), and an
    OpInfo finds its op as `find_op(name)` (autograd._op)."""
    by_suffix = {a.name[len(spec.name):]: a for a in auxiliary}
    grad2 = by_suffix.get(names.GRAD2_SUFFIX)
    jvp = by_suffix.get(names.JVP_SUFFIX)
    out = []
    for s in (spec,) + tuple(auxiliary):
        main = s is spec
        forward = _forward_info(s)
        forward.vjp = _vjp_of_forward(s, call_op)
        forward.saved_output = s.saved_index
        forward.jvp = _jvp_of_forward(s, jvp, call_op) if main and jvp is not None else None
        out.append(forward)
        if s.kernel_gradients:
            backward = _backward_info(s)
            backward.vjp = _vjp_of_backward(s, grad2, call_op) if main and grad2 is not None else None
            out.append(backward)
    for info in out:
        info.find_op = find_op
        info.function = _function(info)
    return out

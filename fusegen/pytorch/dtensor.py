"""DTensor sharding rules for every op of a family: pointwise, as eager's elementwise ops.

Every fusegen op is elementwise with broadcasting, so each gets the rule DTensor gives
eager's pointwise ops (`aten.mul`, `aten.add`, ...): for each dimension of the broadcast
shape, the output sharded on it and each input sharded on the dimension that broadcasts to
it (replicated where it has none, or has size 1), or everything replicated. DTensor's own
machinery does the rest: it picks the cheapest entry for the inputs it is given (no
redistribution when one matches, else the cheapest collective), runs the op's local kernel
on each rank's shard, and wraps the results.

- `<name>`, `<name>_grad2`, `<name>_jvp` (one Tensor out): torch's own registration of
  its pointwise ops, `_pointwise_ops._register_single_dim_pointwise` (torch 2.13), so they
  behave exactly as `aten.silu` does, Partial inputs included (an elementwise function of
  a sum is not the sum of the function: a Partial input is reduced first). An earlier
  torch (before the single-dim strategies) gets its `pointwise_strategy`, which its aten
  pointwise ops use; a torch with neither, the table below with one output.
- `*_backward` (`Tensor[]` out, one tensor per gradient its `bool[K] output_mask`
  requests): torch's pointwise registration and the public `register_sharding` both count
  one output for a `Tensor[]`, so these get the table below through
  `register_op_strategy` and `expand_to_full_mesh_op_strategy` (which expands it over
  every mesh dimension), with as many outputs as the mask asks for. A backward op is
  linear in its incoming gradient (its first argument), so a Partial("sum"/"avg")
  gradient with the other inputs replicated stays Partial, as it does through eager's
  `grad * f'(x)` (`aten.mul`'s rule). The mask is in the propagator's cache key.

- step ops, `<name>` and `<name>_foreach` (ir/step.py: Tensor(a!) arguments, no result):
  `register_step`, a handler of DTensor's dispatcher that runs the op on the local shards.
  An update is pointwise over arguments of one shape, so it is the same update shard by
  shard when every tensor of a call (of one index of the lists, for `_foreach`) is a
  DTensor of the same mesh, placements and global shape, Shard and Replicate only. Any
  other call is an error that names the argument: a mutated argument cannot be
  redistributed (the update would land on a copy), and a Partial one holds summands, not
  the values the update reads. A scalar given as a 0-d tensor may be a replicated DTensor.

Float scalars never change the sharding, so they are kept out of the cache key (a new
`alpha` reuses the propagation). A failed registration (a torch whose private DTensor API
moved) is a RuntimeWarning, never an error in `fuse` or in `import torch.distributed.tensor`.

Registration is lazy: importing torch.distributed.tensor costs about 0.4 s, which a cached
`fusegen.fuse` (a few ms) must not pay. A family loaded while torch.distributed.tensor is
not imported waits here, and a one-shot import hook registers the waiting families right
after torch.distributed.tensor is first imported, so either import order works.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings

import torch

_MODULE = "torch.distributed.tensor"
_WAITING: list = []      # (register function, family or step op) loaded before _MODULE was imported
_HOOK: list = []         # the installed _AfterImport finder, at most one


def register(members) -> None:
    """Give every op of a family (family.Member tuples) its pointwise sharding rule, now
    if torch.distributed.tensor is imported, otherwise right after it is."""
    if not torch.distributed.is_available():
        return
    _now_or_later(_register_now, members)


def _now_or_later(register_fn, what) -> None:
    if _MODULE in sys.modules:
        register_fn(what)
        return
    _WAITING.append((register_fn, what))
    if not _HOOK:
        _HOOK.append(_AfterImport())
        sys.meta_path.insert(0, _HOOK[0])


def _register_waiting() -> None:
    while _WAITING:
        register_fn, what = _WAITING.pop(0)
        register_fn(what)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds torch.distributed.tensor with the other finders and wraps its loader so that
    the waiting families register once the module has executed; then steps aside."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)
        _HOOK.clear()
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _register_waiting()
        spec.loader.exec_module = exec_module  # this module's own loader instance
        return spec


def _register_now(members) -> None:
    """Register, or warn: a DTensor whose private API moved must not break `fusegen.fuse`
    nor the user's `import torch.distributed.tensor` (DTensor inputs then fail, naming
    the op, as they did before this module)."""
    if any(m.random for m in members):
        # Each rank would draw its shard's numbers from the same seed and local indices (the
        # same mask on every rank): no rule, so DTensor refuses the op, naming it.
        return
    try:
        _register_rules(members)
    except Exception as error:
        warnings.warn(f"fusegen: no DTensor sharding rule for {members[0].name} and its family: {error!r}",
                      RuntimeWarning, stacklevel=2)


def _register_rules(members) -> None:
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops import _pointwise_ops
    from torch.distributed.tensor._ops.utils import register_op_strategy

    single_dim = getattr(_pointwise_ops, "_register_single_dim_pointwise", None)  # torch 2.13
    earlier = getattr(_pointwise_ops, "pointwise_strategy", None)                  # torch before it
    for m in members:
        op = getattr(torch.ops.fusegen, m.name).default
        arguments = len(op._schema.arguments)  # a static_argnum past them all: no scalar is hashed
        if m.backward:  # except output_mask, the last, which decides the outputs
            register_op_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum=arguments - 1))(
                _strategy(True, m.outputs, whole_rows=m.rows))
        elif m.outputs > 1 or m.joined or m.rows:  # torch's pointwise registrations: ops of one output
            register_op_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum=arguments))(
                _strategy(False, m.outputs, m.joined or m.rows))
        elif single_dim is not None:
            single_dim(op, static_argnum=arguments)
        else:
            register_op_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum=arguments))(
                earlier or _strategy(False))


def _strategy(backward: bool, count: int = 1, whole_rows: bool = False):
    """The op's strategy function: the pointwise table for one mesh dimension (plus the
    linear-in-the-gradient Partial rows of a backward op), expanded by DTensor. `count`: a
    forward op's outputs, a backward op's douts (its forward's outputs); `whole_rows`: the
    last dimension is never sharded (the result is two outputs side by side along it, or the
    op reduces over it: each shard must hold whole rows)."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, infer_broadcast_dims_map

    def strategy(op_schema):
        args = op_schema.args_schema
        tensors = [a for a in args if isinstance(a, OpStrategy)]
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        outputs = sum(bool(k) for k in args[-1]) if backward else count  # one per requested gradient
        dims = [infer_broadcast_dims_map(shape, t.shape) for t in tensors]
        rules = [[Replicate()] * (outputs + len(tensors))]
        for d in range(len(shape) - whole_rows):
            rules.append([Shard(d)] * outputs + [Shard(m[d]) if m[d] >= 0 else Replicate() for m in dims])
        if backward:
            for reduce in ("sum", "avg"):
                rules.append([Partial(reduce)] * (outputs + count) + [Replicate()] * (len(tensors) - count))
        expanded = expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, rules,
                                                   input_index=outputs)
        if backward and outputs < 2:  # a Tensor[] of one or none: DTensor wants a tuple of specs
            for spec in expanded.strategies:
                spec.output_specs = (spec.output_specs,) if outputs else ()
        return expanded
    return strategy


# -- step ops ---------------------------------------------------------------------------------

def register_step(name: str, scalars=()) -> None:
    """Give the step op `name` and `<name>_foreach` the local-shard handler (module docstring),
    now if torch.distributed.tensor is imported, otherwise right after it is. `scalars`: the
    op's scalar names, for its errors."""
    if torch.distributed.is_available():
        _now_or_later(_register_step_now, (name, tuple(scalars)))


def _register_step_now(step) -> None:
    name, scalars = step
    try:
        from torch.distributed.tensor import DTensor

        def handler(op_call, args, kwargs):
            return _on_local_shards(op_call, args, kwargs, scalars)
        handlers = DTensor._op_dispatcher._custom_op_handlers
        for op_name in (name, name + "_foreach"):
            handlers[getattr(torch.ops.fusegen, op_name).default] = handler
    except Exception as error:
        warnings.warn(f"fusegen: no DTensor rule for step op {name}: {error!r}", RuntimeWarning, stacklevel=2)


def _on_local_shards(op_call, args, kwargs, scalars=()):
    """The step op on each rank's shards: every DTensor of one update swapped for its local
    tensor, after the checks that make that the same update as on the full tensors."""
    from torch.distributed.tensor import DTensor, Partial

    schema = op_call._schema
    values = list(args) + [kwargs[a.name] for a in schema.arguments[len(args):]]
    where = f"fusegen step op '{schema.name.partition('::')[2]}' on DTensors"
    groups: dict[int, list] = {}  # update index (0 for the plain op) -> [(argument, value)]
    local = []
    for arg, value in zip(schema.arguments, values):
        kind = str(arg.type)
        if kind == "Tensor" or kind == "List[Tensor]":
            items = [value] if kind == "Tensor" else list(value)
            for k, t in enumerate(items):
                groups.setdefault(k, []).append((arg.name if kind == "Tensor" else f"{arg.name}[{k}]", t))
            swapped = [t._local_tensor if isinstance(t, DTensor) else t for t in items]
            local.append(swapped[0] if kind == "Tensor" else swapped)
        elif kind == "List[Optional[Tensor]]":  # the scalars given as 0-d tensors, in the op's scalar order
            local.append([_replicated_scalar(where, scalars[k] if k < len(scalars) else f"{arg.name}[{k}]", t)
                          for k, t in enumerate(value)])
        else:
            local.append(value)
    for members in groups.values():
        first_name, first = members[0]
        for arg_name, t in members:
            if not isinstance(t, DTensor):
                raise RuntimeError(f"{where}: argument '{arg_name}' is a torch.Tensor while '{first_name}' is a "
                                   "DTensor; expected DTensors of one mesh and placements for every tensor of an "
                                   "update (distribute_tensor it alike)")
            if any(isinstance(p, Partial) for p in t.placements):
                raise RuntimeError(f"{where}: argument '{arg_name}' has placements {t.placements}; a Partial "
                                   "tensor holds summands, not the values the update reads: reduce it first "
                                   "(redistribute to Shard or Replicate)")
            if t.device_mesh != first.device_mesh or t.placements != first.placements or t.shape != first.shape:
                raise RuntimeError(f"{where}: argument '{arg_name}' has placements {t.placements} and shape "
                                   f"{tuple(t.shape)}, '{first_name}' {first.placements} and {tuple(first.shape)}; "
                                   "expected the same mesh, placements and shape for every tensor of an update "
                                   "(the updated ones cannot be redistributed: the update would land on a copy)")
    op_call(*local)
    return None


def _replicated_scalar(where: str, name: str, t):
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if not all(p.is_replicate() for p in t.placements):
        raise RuntimeError(f"{where}: scalar tensor '{name}' has placements {t.placements}; expected a "
                           "replicated 0-d DTensor, or a plain tensor")
    return t._local_tensor

"""`fusegen.Optimizer`: a `torch.optim.Optimizer` whose update is one fused step op.

    step = fusegen.fuse("m = b1*m + (1-b1)*g; p = p - lr*sign(m)", name="signum_step",
                        inputs="p,g,m", scalars="lr,b1")
    opt = fusegen.Optimizer(model.parameters(), step=step, state=("m",),
                            scalars=lambda group, count: {"lr": group["lr"], "b1": group["beta"]},
                            lr=1e-3, beta=0.9)

One `step()` makes one `step.foreach(...)` call per param group (the op launches one kernel
per device and dtypes), with the group's params that have a gradient, their gradients and
their state tensors, in the order of the op's inputs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping

import torch

_DTENSOR = "torch.distributed.tensor"
STATE_INITS = ("zeros", "grad")


def _dtensor_type():
    """DTensor's class when torch.distributed.tensor is imported (a DTensor param implies it
    is), else None: an optimizer of plain tensors never pays for importing it."""
    module = sys.modules.get(_DTENSOR)
    return getattr(module, "DTensor", None) if module is not None else None


def _local(t, dtensor):
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


class Optimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer that applies a fusegen step op to every param group.

    - `step`: a `fusegen.FusedStep` (from `fusegen.fuse` of a statement program) whose
      inputs are the parameter (`param`, default "p"), its gradient (`grad`, default "g")
      and the state tensors; it must assign the parameter.
    - `state`: the names of the state inputs, each created at a param's first step as zeros
      like the param; or a mapping name -> "zeros" | "grad" ("grad": a copy of the first
      gradient, as the previous-gradient state of Adan wants).
    - `scalars(group, count) -> dict`: every scalar of the op, from the group's
      hyper-parameters and `count`, the step count after this update (1 at the first step):
      a Python int, or with `capturable=True` a 0-d float32 tensor on the params' device.
      Write it with operators that work for both (`1 - beta1 ** count`).
    - `state_dtype`: the state tensors are in the wider of it and the param's dtype: with the
      default float32, bf16 and fp16 params keep fp32 moments and fp64 params fp64 ones;
      None keeps the param's dtype.
    - `capturable`: every float hyper-parameter of a group (and each float of a tuple such as
      `betas`) is held as a 0-d float32 tensor on the group's device, and so is the step
      count, so the scalars the op reads are device tensors: a CUDA graph replays the step
      with the values of the moment, and torch.compile traces one graph whatever the LR
      (torch's LR schedulers `fill_` a tensor LR in place). The params of a capturable group
      are on one device and step together: the group's step count is its first param's.
    - any other keyword: a default hyper-parameter of every group (lr, betas, ...).
    """

    # state names of other implementations -> this one's, accepted by load_state_dict (a
    # torch.optim.AdamW checkpoint's exp_avg is fusegen.optim.AdamW's m)
    state_aliases: dict[str, str] = {}

    def __init__(self, params, step, state: Iterable[str] | Mapping[str, str] = ("m", "v"),
                 scalars: Callable[[dict, object], dict] | None = None, param: str = "p", grad: str = "g", *,
                 state_dtype: torch.dtype | None = torch.float32, capturable: bool = False, **defaults):
        if scalars is None or not callable(scalars):
            raise TypeError("fusegen.Optimizer needs scalars=, a callable (group, count) -> dict of the "
                            "step op's scalars")
        self.fused_step = step
        self.state_init = self._state_init(state)
        self.param_name, self.grad_name = param, grad
        self.scalars_fn = scalars
        self.state_dtype = state_dtype
        self._check_step(step)
        super().__init__(params, {**defaults, "capturable": bool(capturable)})

    # -- construction ---------------------------------------------------------------------

    @staticmethod
    def _state_init(state) -> dict[str, str]:
        if isinstance(state, str):
            raise TypeError(f"state= takes names, e.g. ({state!r},), not the string {state!r}")
        init = dict(state) if isinstance(state, Mapping) else {name: "zeros" for name in state}
        for name, how in init.items():
            if how not in STATE_INITS:
                raise ValueError(f"state {name!r}: expected one of {', '.join(STATE_INITS)}, got {how!r}")
        return init

    def _check_step(self, step):
        name = getattr(step, "name", type(step).__name__)
        inputs = tuple(getattr(step, "inputs", ()))
        updated = tuple(getattr(step, "updated", ()))
        if not hasattr(step, "foreach") or not inputs:
            raise TypeError(f"step= expects a fusegen.FusedStep (fusegen.fuse of a statement program), got {step!r}")
        supplied = [self.param_name, self.grad_name, *self.state_init]
        if len(set(supplied)) != len(supplied):
            raise ValueError(f"param={self.param_name!r}, grad={self.grad_name!r} and state="
                             f"{tuple(self.state_init)} must be distinct names")
        unknown = [n for n in supplied if n not in inputs]
        if unknown:
            raise ValueError(f"step op {name} has no input {', '.join(map(repr, unknown))}; its inputs are "
                             f"{', '.join(inputs)}")
        unsupplied = [n for n in inputs if n not in supplied]
        if unsupplied:
            raise ValueError(f"step op {name}: nothing supplies its input {', '.join(map(repr, unsupplied))}; "
                             f"name it in state= (expected inputs {', '.join(supplied)})")
        if self.param_name not in updated:
            raise ValueError(f"step op {name} does not assign its parameter input {self.param_name!r}")

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["capturable"]:
            self._tensorize(group)

    def _tensorize(self, group: dict) -> None:
        """A capturable group's float hyper-parameters as 0-d float32 tensors on its device
        (a tensor already there is kept: a scheduler may hold it)."""
        device = self._group_device(group)

        def held(value):
            if isinstance(value, torch.Tensor):
                return value if value.device == device else value.to(device)
            if isinstance(value, float):
                return torch.tensor(value, dtype=torch.float32, device=device)
            return value

        for key in self.defaults:
            if key == "capturable" or key not in group:
                continue
            value = group[key]
            if isinstance(value, tuple) and any(isinstance(v, (float, torch.Tensor)) for v in value):
                group[key] = tuple(held(v) for v in value)
            else:
                group[key] = held(value)

    def _group_device(self, group: dict) -> torch.device:
        dtensor = _dtensor_type()
        devices = {_local(p, dtensor).device for p in group["params"]}
        if len(devices) != 1:
            raise ValueError(f"a capturable param group holds params of one device, got "
                             f"{', '.join(sorted(map(str, devices)))}")
        return devices.pop()

    # -- the update -----------------------------------------------------------------------

    def step(self, closure=None):
        """One update of every param that has a gradient; returns closure()'s loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        dtensor = _dtensor_type()
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        if not group["capturable"]:
            self._refuse_capture()
        grads = [p.grad for p in params]
        for p, g in zip(params, grads):
            if g.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not take sparse gradients")
        states = [self._state_of(p, g, group) for p, g in zip(params, grads)]
        counts = [s["step"] for s in states]
        torch._foreach_add_(counts, 1)
        if group["capturable"]:
            buckets = {counts[0]: list(range(len(params)))}
        else:  # params that skipped steps have other counts, hence other bias corrections
            buckets: dict = {}
            for i, count in enumerate(counts):
                buckets.setdefault(int(count.item()), []).append(i)
        for count, chosen in buckets.items():
            lists = {self.param_name: [_local(params[i], dtensor) for i in chosen],
                     self.grad_name: [self._local_grad(params[i], grads[i], dtensor) for i in chosen]}
            for name in self.state_init:
                lists[name] = [_local(states[i][name], dtensor) for i in chosen]
            self.fused_step.foreach(*(lists[n] for n in self.fused_step.inputs), **self._scalars(group, count))

    def _local_grad(self, p, g, dtensor):
        """A DTensor's gradient in the param's placements, as its local shard: the update is
        pointwise, so each rank steps its own shard (FSDP2's sharded params and grads)."""
        if dtensor is None or not isinstance(p, dtensor):
            return g
        if not isinstance(g, dtensor) or g.placements != p.placements or g.device_mesh != p.device_mesh:
            where = getattr(g, "placements", "a plain tensor")
            raise RuntimeError(f"{type(self).__name__}: a DTensor param with placements {p.placements} has a "
                               f"gradient with placements {where}; redistribute the gradient like the param")
        return g.to_local()

    def _state_of(self, p, g, group: dict) -> dict:
        state = self.state[p]
        if not state:
            device = _local(p, _dtensor_type()).device if group["capturable"] else torch.device("cpu")
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            for name, how in self.state_init.items():
                t = torch.zeros_like(p, dtype=self._dtype_for(p), memory_format=torch.preserve_format)
                if how == "grad":
                    t.copy_(g)
                state[name] = t
        return state

    def _dtype_for(self, p) -> torch.dtype:
        """The wider of state_dtype and the param's dtype: fp32 moments for bf16 params, and
        fp64 params never narrowed."""
        if self.state_dtype is None or not p.is_floating_point():
            return p.dtype
        return torch.promote_types(self.state_dtype, p.dtype)

    def _scalars(self, group: dict, count) -> dict:
        values = self.scalars_fn(group, count)
        if not group["capturable"]:  # a tensor LR of a plain group: read once here, as torch.optim does
            values = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        # Checked on every step (a few names): a flag set on the optimizer would be a setattr
        # inside a torch.compile'd step, which dynamo refuses.
        wanted, got = list(self.fused_step.scalars), list(values)
        missing, extra = [s for s in wanted if s not in got], [s for s in got if s not in wanted]
        if missing or extra:
            raise ValueError(f"scalars= of {type(self).__name__} returned {', '.join(got) or 'nothing'}; step op "
                             f"{self.fused_step.name} takes {', '.join(wanted) or 'no scalars'}"
                             + (f" (missing {', '.join(missing)})" if missing else "")
                             + (f" (unknown {', '.join(extra)})" if extra else ""))
        return values

    @staticmethod
    def _refuse_capture():
        """A CUDA graph would replay a step whose step count and scalars are host values frozen
        at capture: refuse, as torch's optimizers do."""
        if torch.compiler.is_compiling() or not torch.cuda.is_available():
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("CUDA graph capture of an optimizer step with capturable=False: construct it "
                               "with capturable=True (hyper-parameters and step counts as device tensors)")

    # -- state dict -----------------------------------------------------------------------

    def _renamed(self, saved_id, state: dict) -> dict:
        """A saved param state with state_aliases' names replaced; every state tensor there."""
        state = {self.state_aliases.get(k, k): v for k, v in state.items()}
        missing = [n for n in ("step", *self.state_init) if n not in state]
        if missing and state:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state of param {saved_id} has "
                             f"{', '.join(map(str, state))}; expected {', '.join(('step', *self.state_init))} "
                             f"(missing {', '.join(missing)})")
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict (state names of state_aliases renamed: a torch.optim.AdamW
        state dict loads into fusegen.optim.AdamW), then each state tensor as kept here: in
        state_dtype (torch would cast it to the param's dtype), the step count a float32
        tensor on the device if capturable, else on the CPU; capturable groups' hyper-
        parameters as device tensors again."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        saved_state = {i: self._renamed(i, s) for i, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": saved_state})
        params = [p for g in self.param_groups for p in g["params"]]
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        dtensor = _dtensor_type()
        for saved_id, p in zip(saved_ids, params):
            if saved_id not in saved_state:
                continue
            state, group = self.state[p], group_of[id(p)]
            for key, value in saved_state[saved_id].items():
                if not isinstance(value, torch.Tensor):
                    continue
                if key == "step":
                    device = _local(p, dtensor).device if group["capturable"] else torch.device("cpu")
                    state[key] = value.to(dtype=torch.float32, device=device)
                elif value.is_floating_point():
                    state[key] = value.to(dtype=self._dtype_for(p), device=p.device)
        for group in self.param_groups:
            if group["capturable"]:
                self._tensorize(group)

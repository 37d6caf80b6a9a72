"""The shipped optimizers, each a statement program for `fusegen.fuse` and the function that
gives its scalars from a param group and the step count.

The scalars that depend on the step count alone (bias corrections) are computed once per
call on the host, in double precision as torch.optim computes them, or with capturable=True
as 0-d tensor ops on the device; everything per element is in the program.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from fusegen.optim.base import Optimizer


@dataclass(frozen=True)
class Program:
    """One step op: its name in torch.ops.fusegen, its statements, inputs and scalars."""

    name: str
    text: str
    inputs: str
    scalars: str


ADAMW = Program(
    "optim_adamw",
    """
m = beta1*m + (1 - beta1)*g
v = beta2*v + (1 - beta2)*g*g
p = p*(1 - lr*wd) - step_size*m/(sqrt(v)/bc2_sqrt + eps)
""",
    "p,g,m,v", "lr,wd,beta1,beta2,eps,step_size,bc2_sqrt")

# Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms": the update interpolates
# with beta1, the momentum it keeps with beta2.
LION = Program(
    "optim_lion",
    """
p = p - lr*(sign(beta1*m + (1 - beta1)*g) + wd*p)
m = beta2*m + (1 - beta2)*g
""",
    "p,g,m", "lr,wd,beta1,beta2")

# Xie et al. 2022, "Adan: Adaptive Nesterov Momentum Algorithm", as its reference code steps
# (sail-sg/Adan): gp is the previous gradient (the first gradient at a param's first step,
# so the first difference is zero); decay and shrink are the decoupled (no_prox) and the
# proximal weight decay, one of them 1.
ADAN = Program(
    "optim_adan",
    """
m = beta1*m + (1 - beta1)*g
d = beta2*d + (1 - beta2)*(g - gp)
u = g + beta2*(g - gp)
n = beta3*n + (1 - beta3)*u*u
p = (p*decay - lr*(m/bc1 + beta2*d/bc2)/(sqrt(n)/bc3_sqrt + eps))/shrink
gp = g
""",
    "p,g,m,d,n,gp", "lr,beta1,beta2,beta3,eps,bc1,bc2,bc3_sqrt,decay,shrink")

PROGRAMS = (ADAMW, LION, ADAN)
_BUILT: dict[str, object] = {}
_LOCK = threading.Lock()


def _fuse(program: Program):
    import fusegen
    return fusegen.fuse(program.text, name=program.name, inputs=program.inputs, scalars=program.scalars)


def step_op(program: Program):
    """The program's FusedStep, built (or loaded from the cache) once per process."""
    with _LOCK:
        if program.name not in _BUILT:
            _BUILT[program.name] = _fuse(program)
        return _BUILT[program.name]


def _check(name: str, value, low: float, high: float | None = None, closed_high: bool = False):
    v = float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or v < low or (
            high is not None and (v > high if closed_high else v >= high)):
        bound = f"in [{low}, {high}{']' if closed_high else ')'}" if high is not None else f">= {low}"
        raise ValueError(f"invalid {name}: {value!r} (expected a number {bound})")


def _betas(betas, count: int):
    betas = tuple(betas)
    if len(betas) != count:
        raise ValueError(f"invalid betas: {betas!r} (expected {count} numbers)")
    for i, beta in enumerate(betas):
        _check(f"beta{i + 1}", beta, 0.0, 1.0)
    return tuple(float(b) if isinstance(b, int) else b for b in betas)


# -- AdamW ------------------------------------------------------------------------------------

def adamw_scalars(group: dict, count) -> dict:
    """torch.optim.AdamW's: step_size = lr / (1 - beta1^t), sqrt(1 - beta2^t)."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    return {"lr": lr, "wd": group["weight_decay"], "beta1": beta1, "beta2": beta2, "eps": group["eps"],
            "step_size": lr / (1 - beta1 ** count), "bc2_sqrt": (1 - beta2 ** count) ** 0.5}


class AdamW(Optimizer):
    """AdamW (Loshchilov & Hutter) as torch.optim.AdamW computes it, one fused kernel per
    device and dtypes: p <- p*(1 - lr*wd) - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
    The moments are float32 whatever the params' dtype (state_dtype=None: the param's)."""

    program = ADAMW
    state_aliases = {"exp_avg": "m", "exp_avg_sq": "v"}  # torch.optim.AdamW's

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 capturable: bool = False, state_dtype: torch.dtype | None = torch.float32):
        _check("lr", lr, 0.0)
        _check("eps", eps, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        super().__init__(params, step=step_op(self.program), state=("m", "v"), scalars=adamw_scalars,
                         lr=lr, betas=_betas(betas, 2), eps=eps, weight_decay=weight_decay,
                         capturable=capturable, state_dtype=state_dtype)


# -- Lion -------------------------------------------------------------------------------------

def lion_scalars(group: dict, count) -> dict:
    beta1, beta2 = group["betas"]
    return {"lr": group["lr"], "wd": group["weight_decay"], "beta1": beta1, "beta2": beta2}


class Lion(Optimizer):
    """Lion (Chen et al. 2023): c = b1*m + (1-b1)*g; p <- p - lr*(sign(c) + wd*p);
    m <- b2*m + (1-b2)*g. One state tensor (m); its LR is typically 3-10x smaller than
    AdamW's and its weight decay as many times larger."""

    program = LION
    state_aliases = {"exp_avg": "m"}  # lion-pytorch's

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 capturable: bool = False, state_dtype: torch.dtype | None = torch.float32):
        _check("lr", lr, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        super().__init__(params, step=step_op(self.program), state=("m",), scalars=lion_scalars,
                         lr=lr, betas=_betas(betas, 2), weight_decay=weight_decay,
                         capturable=capturable, state_dtype=state_dtype)


# -- Adan -------------------------------------------------------------------------------------

def adan_scalars(group: dict, count) -> dict:
    beta1, beta2, beta3 = group["betas"]
    lr, wd = group["lr"], group["weight_decay"]
    decay, shrink = (1 - lr * wd, 1.0) if group["no_prox"] else (1.0, 1 + lr * wd)
    return {"lr": lr, "beta1": beta1, "beta2": beta2, "beta3": beta3, "eps": group["eps"],
            "bc1": 1 - beta1 ** count, "bc2": 1 - beta2 ** count, "bc3_sqrt": (1 - beta3 ** count) ** 0.5,
            "decay": decay, "shrink": shrink}


class Adan(Optimizer):
    """Adan (Xie et al. 2022) as its reference implementation steps it: m, the gradient's
    difference d and n = EMA of (g + b2*(g - g_prev))^2, bias-corrected; weight decay
    proximal (p <- (p - lr*update)/(1 + lr*wd), the default) or, with no_prox=True, decoupled
    (p <- p*(1 - lr*wd) - lr*update). Four state tensors: m, d, n and the previous gradient."""

    program = ADAN
    state_aliases = {"exp_avg": "m", "exp_avg_diff": "d", "exp_avg_sq": "n", "pre_grad": "gp"}  # sail-sg/Adan's

    def __init__(self, params, lr=1e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.0,
                 no_prox: bool = False, *, capturable: bool = False,
                 state_dtype: torch.dtype | None = torch.float32):
        _check("lr", lr, 0.0)
        _check("eps", eps, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        super().__init__(params, step=step_op(self.program), state={"m": "zeros", "d": "zeros", "n": "zeros",
                                                                    "gp": "grad"},
                         scalars=adan_scalars, lr=lr, betas=_betas(betas, 3), eps=eps,
                         weight_decay=weight_decay, no_prox=bool(no_prox), capturable=capturable,
                         state_dtype=state_dtype)

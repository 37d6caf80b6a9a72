"""The numeric corpus, by category (numexpr style).

Each entry is an op fusegen builds and an eager PyTorch oracle written by hand, so the
check is independent of fusegen's own reference evaluator. The whole corpus is built once
per test run into one library (see conftest.py: `corpus_ops`).

Names carry a `cp_` prefix so they never clash with ops other test files register in the
same process under the seed names (fma, silu, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

# Input domains: how to draw one input's values. Kinks (0 for abs/relu/sign, ties for
# maximum/minimum) are hit with probability zero by these continuous draws, so gradcheck's
# finite differences stay away from them; test_spec.py tests the kinks on purpose.
REAL = "real"          # standard normal
POSITIVE = "positive"  # [0.1, 2]: log, sqrt, rsqrt, pow base
SMALL = "small"        # (-1, 1): tan stays far from its poles


def draw(domain: str, shape, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    if domain == REAL:
        x = torch.randn(shape, generator=generator, dtype=torch.float64)
    elif domain == POSITIVE:
        x = 0.1 + 1.9 * torch.rand(shape, generator=generator, dtype=torch.float64)
    elif domain == SMALL:
        x = 2 * torch.rand(shape, generator=generator, dtype=torch.float64) - 1
    else:
        raise ValueError(domain)
    return x.to(dtype)


@dataclass(frozen=True)
class Case:
    name: str
    category: str
    expr: str
    eager: Callable                       # hand-written oracle: eager(*tensors, *scalars)
    domains: tuple[str, ...]              # one per tensor input, in the op's input order
    scalars: tuple[str, ...] = ()
    scalar_values: tuple[float, ...] = ()
    inputs: tuple[str, ...] | None = None
    # Shape of input k for a problem of size n; default: every input is (n,).
    broadcast: bool = False
    tags: frozenset = field(default_factory=frozenset)
    golden: str | None = None             # seeds: the folder in generated/ that holds it

    def shapes(self, n: int) -> list[tuple[int, ...]]:
        if self.broadcast:
            # (m, n) against a (1, n) row and an (n,) vector: eager broadcasting rules.
            return [(3, n), (1, n), (n,)][: len(self.domains)]
        return [(n,)] * len(self.domains)

    def sample(self, n: int, dtype=torch.float64, seed: int = 0, shapes=None) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        shapes = shapes or self.shapes(n)
        return [draw(d, s, g, dtype) for d, s in zip(self.domains, shapes)]

    def __repr__(self):  # short pytest ids
        return self.name


GELU_TANH = "0.5*x*(1+tanh(0.7978845608*(x+0.044715*x*x*x)))"

CORPUS: list[Case] = [
    # -- seed examples ---------------------------------------------------------------
    Case("cp_fma", "seed", "a*b+c", lambda a, b, c: a * b + c, (REAL, REAL, REAL),
         tags=frozenset({"compile"}), golden="fma"),
    Case("cp_add_mul", "seed", "(x+y)*w", lambda x, y, w: (x + y) * w, (REAL, REAL, REAL), golden="addmul"),
    Case("cp_add", "seed", "a+b", lambda a, b: a + b, (REAL, REAL), golden="add"),
    Case("cp_relu_gate", "seed", "(x+y)*((x+y)>0)", lambda x, y: (x + y) * ((x + y) > 0), (REAL, REAL),
         golden="masked_add"),
    Case("cp_distribute", "seed", "(a*b)+(a*c)", lambda a, b, c: a * b + a * c, (REAL, REAL, REAL),
         golden="mul_add_mul"),
    Case("cp_silu", "seed", "x*sigmoid(x)", lambda x: x * torch.sigmoid(x), (REAL,),
         tags=frozenset({"compile"}), golden="silu"),
    Case("cp_gelu_tanh", "seed", GELU_TANH,
         lambda x: 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x))), (REAL,),
         golden="gelu_tanh"),
    # -- transcendental functions -------------------------------------------------------
    Case("cp_exp_log", "function", "torch.exp(x) + log(y)", lambda x, y: torch.exp(x) + torch.log(y),
         (REAL, POSITIVE)),
    Case("cp_expm1_log1p", "function", "expm1(x) * torch.log1p(y)",
         lambda x, y: torch.expm1(x) * torch.log1p(y), (REAL, POSITIVE)),
    Case("cp_sqrt_rsqrt", "function", "sqrt(x) + x*rsqrt(y)",
         lambda x, y: torch.sqrt(x) + x * torch.rsqrt(y), (POSITIVE, POSITIVE)),
    Case("cp_trig", "function", "sin(x)*cos(y) + tan(x)",
         lambda x, y: torch.sin(x) * torch.cos(y) + torch.tan(x), (SMALL, REAL)),
    Case("cp_atan_tanh", "function", "atan(x) - torch.tanh(y)*x",
         lambda x, y: torch.atan(x) - torch.tanh(y) * x, (REAL, REAL)),
    Case("cp_erf_erfc", "function", "erf(x) + torch.special.erfc(y)*x",
         lambda x, y: torch.erf(x) + torch.special.erfc(y) * x, (REAL, REAL)),
    # -- piecewise functions ------------------------------------------------------------
    Case("cp_abs_sign", "piecewise", "abs(x) + sign(y)*x", lambda x, y: torch.abs(x) + torch.sign(y) * x,
         (REAL, REAL)),
    Case("cp_relu_mul", "piecewise", "F.relu(x) * y", lambda x, y: F.relu(x) * y, (REAL, REAL)),
    Case("cp_max_min", "piecewise", "torch.maximum(x, y) - 0.5*minimum(x, y)",
         lambda x, y: torch.maximum(x, y) - 0.5 * torch.minimum(x, y), (REAL, REAL)),
    Case("cp_clamp", "piecewise", "clamp(x, -0.5, 0.5) + torch.clamp(y, min=0.0)",
         lambda x, y: torch.clamp(x, -0.5, 0.5) + torch.clamp(y, min=0.0), (REAL, REAL)),
    # Eager torch.clamp's backward fails when x is smaller than its broadcast bounds
    # ("output with shape [1, 33] doesn't match the broadcast shape [4, 33]", torch 2.13),
    # so the oracle broadcasts first; the values and gradients are the same.
    Case("cp_clamp_tensor", "piecewise", "clamp(x, lo, hi)",
         lambda x, lo, hi: torch.clamp(*torch.broadcast_tensors(x, lo, hi)), (REAL, REAL, REAL)),
    Case("cp_pow", "piecewise", "pow(x, y) + x**2.5", lambda x, y: torch.pow(x, y) + x ** 2.5,
         (POSITIVE, REAL)),
    Case("cp_where", "piecewise", "where(x > y, x*y, x - y)", lambda x, y: torch.where(x > y, x * y, x - y),
         (REAL, REAL)),
    # -- operators and constants ----------------------------------------------------------
    Case("cp_compare", "operator", "x*(x < y) + y*(x >= y) + (x <= 0.5) - (y == x) + x*(x != 0)",
         lambda x, y: x * (x < y) + y * (x >= y) + (x <= 0.5).to(x.dtype) - (y == x).to(x.dtype) + x * (x != 0),
         (REAL, REAL)),
    Case("cp_neg_pi", "operator", "-x*math.pi + torch.sin(-y)/2 - x/y**2",
         lambda x, y: -x * math.pi + torch.sin(-y) / 2 - x / y ** 2, (REAL, POSITIVE)),
    # -- what the backward reads (spec._plan): the output, gradients of dout alone ----------
    # relu(x+y): one gradient for both inputs, computed from the saved output.
    Case("cp_relu_add", "plan", "relu(x+y)", lambda x, y: F.relu(x + y), (REAL, REAL)),
    # every gradient is eager ops on dout: no backward kernel at all
    Case("cp_sub_scaled", "plan", "a - 2*b + c/4", lambda a, b, c: a - 2 * b + c / 4, (REAL, REAL, REAL)),
    # a kernel for x and y; z's -dout/4 is one more kernel output, or eager ops alone
    Case("cp_mul_sub", "plan", "x*y - z/4", lambda x, y, z: x * y - z / 4, (REAL, REAL, REAL)),
    # -- runtime scalar and broadcasting ---------------------------------------------------
    Case("cp_swish_beta", "scalar", "x*torch.sigmoid(beta*x) + alpha*y",
         lambda x, y, beta, alpha: x * torch.sigmoid(beta * x) + alpha * y, (REAL, REAL),
         scalars=("beta", "alpha"), scalar_values=(1.702, -0.75), tags=frozenset({"compile"})),
    Case("cp_bias_gelu", "broadcast", "x*sigmoid(1.702*(x + b)) * s",
         lambda x, b, s: x * torch.sigmoid(1.702 * (x + b)) * s, (REAL, REAL, REAL), broadcast=True),
]

BY_NAME = {c.name: c for c in CORPUS}
SEEDS = [c for c in CORPUS if c.category == "seed"]
# The one seed table: generated/<golden>/ holds each seed's files (tests/test_golden.py).
GOLDEN = {c.golden: c.expr for c in SEEDS}
# An op of several outputs (RoPE's rotation of a pair of halves), beside the seeds.
GOLDEN["rope_pair"] = "(x1*c - x2*s, x2*c + x1*s)"
# Row ops (reductions over the last dimension): one pass, and two passes with a maximum.
GOLDEN["rms_norm"] = "x * torch.rsqrt((x*x).mean(-1, keepdim=True) + 1e-6) * w"
GOLDEN["softmax"] = ("torch.exp(x - torch.amax(x, -1, keepdim=True)) / "
                     "torch.exp(x - torch.amax(x, -1, keepdim=True)).sum(-1, keepdim=True)")
# A gather along the rows (an integer index per row): the cross-entropy of each row.
GOLDEN["cross_entropy"] = "torch.logsumexp(x, -1, keepdim=True) - x.gather(-1, label)"
# An op that draws random numbers: Megatron's bias-dropout-add.
GOLDEN["bias_dropout_add"] = "torch.nn.functional.dropout(x + bias, 0.1) + residual"

# Step ops (ir/step.py), rendered into generated/<name>/ beside the seeds: name -> (program,
# inputs, scalars), as `fusegen PROGRAM --name NAME --inputs .. --scalar ..` writes them.
ADAMW = ("m = beta1*m + (1-beta1)*g; v = beta2*v + (1-beta2)*g*g; "
         "p = p*(1-lr*wd) - lr*(m/bc1)/(sqrt(v/bc2)+eps)")
GOLDEN_STEPS = {"adamw_step": (ADAMW, ("p", "g", "m", "v"), ("lr", "beta1", "beta2", "eps", "wd", "bc1", "bc2"))}


def step_cli_args(name: str) -> list[str]:
    """The CLI's arguments that write generated/<name>/ for a step op of GOLDEN_STEPS."""
    program, inputs, scalars = GOLDEN_STEPS[name]
    return [program, "--name", name, "--inputs", ",".join(inputs)] + [a for s in scalars for a in ("--scalar", s)]

"""The tables: which function names an expression may use, and what they mean.

Only this file says which names exist. Each entry maps a user-facing name to its
parameters (so `clamp(x, min=0)` works as in torch) and a builder that returns a
sympy tree. The sympy functions defined here carry PyTorch's derivative
conventions in their `fdiff`, so `sympy.diff` yields exactly what autograd does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import sympy
from sympy.codegen.cfunctions import expm1, log1p


class Sigmoid(sympy.Function):
    """1 / (1 + exp(-x)). Kept opaque so its derivative is s*(1-s), finite for any x."""

    nargs = 1

    def _on_numbers(cls, x):
        if x.is_Number:
            return 1 / (1 + sympy.exp(-x))
        return None

    # sympy calls `cls.eval` when the function is built; bound by assignment so the name
    # never reads as a call of Python's eval in a security grep.
    eval = classmethod(_on_numbers)

    def fdiff(self, argindex=1):
        return self * (1 - self)


class Sign(sympy.Function):
    """sign(x) with a zero derivative everywhere, as torch.sign has."""

    nargs = 1

    def _on_numbers(cls, x):
        if x.is_Number:
            return sympy.sign(x)
        return None

    eval = classmethod(_on_numbers)  # sympy's construction hook (see Sigmoid)

    def fdiff(self, argindex=1):
        return sympy.Integer(0)


def indicator(condition) -> sympy.Expr:
    """A boolean as a number: 1 where `condition` holds, else 0 (gradient 0)."""
    return sympy.Piecewise((sympy.Integer(1), condition), (sympy.Integer(0), True))


class Clamp(sympy.Function):
    """clamp(x, lo, hi) = min(max(x, lo), hi), with torch.clamp's gradients:
    x gets the gradient inside [lo, hi] (bounds included); lo gets it where x < lo < hi;
    hi gets it where x > hi or hi < lo (torch returns hi when the bounds cross)."""

    nargs = 3

    def _on_numbers(cls, x, lo, hi):
        if x.is_Number and lo.is_Number and hi.is_Number:
            return sympy.Min(sympy.Max(x, lo), hi)
        return None

    eval = classmethod(_on_numbers)  # sympy's construction hook (see Sigmoid)

    def fdiff(self, argindex=1):
        x, lo, hi = self.args
        table = {
            1: sympy.And(x >= lo, x <= hi),
            2: sympy.And(x < lo, lo < hi),
            3: sympy.Or(x > hi, hi < lo),
        }
        return indicator(table[argindex])


class Power(sympy.Function):
    """a ** b for a non-constant exponent, with torch.pow's gradients:
    d/da = b * a**(b-1), zero where b == 0; d/db = a**b * log(a), zero where a == 0 and b >= 0.
    (sympy's own Pow gives b*a**b/a, which is NaN at a == 0.)"""

    nargs = 2

    def fdiff(self, argindex=1):
        a, b = self.args
        if argindex == 1:
            return sympy.Piecewise((sympy.Integer(0), sympy.Eq(b, 0)), (b * Power(a, b - 1), True))
        return sympy.Piecewise(
            (sympy.Integer(0), sympy.And(sympy.Eq(a, 0), b >= 0)), (self * sympy.log(a), True)
        )


def power(base: sympy.Expr, exponent: sympy.Expr) -> sympy.Expr:
    """`**` and pow(): sympy's Pow where the exponent is a constant (x**2 -> 2*x is right
    everywhere), our Power where it varies."""
    if exponent.is_Number or exponent.free_symbols == set():
        return sympy.Pow(base, exponent)
    return Power(base, exponent)


def relu(x):
    return sympy.Piecewise((x, x > 0), (sympy.Integer(0), True))


def where(condition, a, b):
    """`condition` is a sympy relational from the parser, or a number that is tested != 0."""
    # Not `Boolean`: a sympy Symbol is a Boolean too, and where(x, a, b) must test x != 0.
    if not isinstance(condition, (sympy.core.relational.Relational, sympy.logic.boolalg.BooleanFunction,
                                  sympy.logic.boolalg.BooleanAtom)):
        condition = sympy.Ne(condition, 0)
    return sympy.Piecewise((a, condition), (b, True))


def clamp(x, lo=None, hi=None):
    lo = -sympy.oo if lo is None else lo
    hi = sympy.oo if hi is None else hi
    return Clamp(x, lo, hi)


@dataclass(frozen=True)
class Function:
    """One callable name: its parameters (for keyword calls and arity errors) and builder."""

    params: tuple[str, ...]
    build: Callable[..., sympy.Expr]
    optional: int = 0  # how many trailing params may be omitted (they pass None)


def _unary(f):
    return Function(("input",), f)


FUNCTIONS: dict[str, Function] = {
    "abs": _unary(sympy.Abs),
    "exp": _unary(sympy.exp),
    "expm1": _unary(expm1),
    "log": _unary(sympy.log),
    "log1p": _unary(log1p),
    "sqrt": _unary(sympy.sqrt),
    "rsqrt": _unary(lambda x: 1 / sympy.sqrt(x)),
    "sin": _unary(sympy.sin),
    "cos": _unary(sympy.cos),
    "tan": _unary(sympy.tan),
    "tanh": _unary(sympy.tanh),
    "atan": _unary(sympy.atan),
    "sigmoid": _unary(Sigmoid),
    "relu": _unary(relu),
    "erf": _unary(sympy.erf),
    "erfc": _unary(sympy.erfc),
    "sign": _unary(Sign),
    "maximum": Function(("input", "other"), sympy.Max),
    "minimum": Function(("input", "other"), sympy.Min),
    "clamp": Function(("input", "min", "max"), clamp, optional=2),
    "pow": Function(("input", "exponent"), power),
    "where": Function(("condition", "input", "other"), where),
}

# Aliases PyTorch users type without thinking: torch.clip, math.fabs, torch.absolute.
ALIASES = {"clip": "clamp", "fabs": "abs", "absolute": "abs", "max": "maximum", "min": "minimum"}

# Module prefixes accepted before a function name, as dotted paths.
PREFIXES = ("torch", "torch.nn.functional", "F", "nn.functional", "math", "torch.special")

CONSTANTS = {"math.pi": sympy.pi, "math.e": sympy.E, "torch.pi": sympy.pi, "torch.e": sympy.E,
             "math.inf": sympy.oo, "torch.inf": sympy.oo}

# Names an input may not take: they would shadow a function or a C/CUDA spelling in the
# generated code, or collide with the generated code's own variables.
_C_KEYWORDS = """alignas alignof and and_eq asm auto bitand bitor bool break case catch char
char8_t char16_t char32_t class compl concept const consteval constexpr constinit const_cast
continue co_await co_return co_yield decltype default delete do double dynamic_cast else enum
explicit export extern false float for friend goto if inline int long mutable namespace new
noexcept not not_eq nullptr operator or or_eq private protected public register
reinterpret_cast requires restrict return short signed sizeof static static_assert static_cast
struct switch template this thread_local throw true try typedef typeid typename union unsigned
using virtual void volatile wchar_t while xor xor_eq __global__ __device__ __host__ __shared__
__constant__ __restrict__ __forceinline__ half nv_bfloat16 dim3 threadIdx blockIdx blockDim
gridDim warpSize INFINITY NAN int64_t size_t at c10 std torch fusegen""".split()
_C_MATH = """exp expf expm1 expm1f log logf log1p log1pf sqrt sqrtf rsqrt rsqrtf sin sinf cos cosf
tan tanf tanh tanhf atan atanf erf erff erfc erfcf pow powf fabs fabsf fmax fmaxf fmin fminf
isnan signbit""".split()
_GENERATED = "grad out n i k v stride scalar_t acc_t kVec self ctx m args".split()
RESERVED = frozenset(_C_KEYWORDS + _C_MATH + _GENERATED + list(FUNCTIONS) + list(ALIASES)
                     + ["pi", "e", "inf", "nan", "math", "torch", "F", "nn"])


def resolve(dotted: str) -> str | None:
    """'torch.nn.functional.relu' -> 'relu'; None when the name is not a known function."""
    prefix, _, base = dotted.rpartition(".")
    if prefix and prefix not in PREFIXES:
        return None
    base = ALIASES.get(base, base)
    return base if base in FUNCTIONS else None


def known_names() -> list[str]:
    """Every spelling a user may call, for 'did you mean' suggestions."""
    return sorted(set(FUNCTIONS) | set(ALIASES))


def literal_ok(value: float) -> bool:
    """Literals must be finite float32-representable magnitudes: the kernels compute in
    float for fp32/fp16/bf16, and a literal that overflows there is a bug, not a number."""
    return math.isfinite(value) and abs(value) <= 3.0e38

"""The tables: which function names an expression may use, and the nodes it is made of.

Only this file says which names exist. Each entry maps a user-facing name to its
parameters (so `clamp(x, min=0)` works as in torch) and a builder that returns a tree.

The tree is made of `Node`s, one per eager PyTorch operation (`Times` is `torch.mul`,
`Divide` is `torch.div`, `Clamp` is `torch.clamp`, ...), kept exactly as the user wrote
them. A Node is a sympy Function that sympy never evaluates: sympy's algebra would change
values that eager PyTorch gives (`a*0 -> 0` at a = inf, `a - a -> 0`, `exp(log(x)) -> x`
at x < 0, `Min(Min(a, b), c) -> Min(a, b, c)` at ties, `sqrt(x**2) -> |x|`, ...). sympy
still hashes, compares and shares (cse) these trees; differentiation is spec.py's reverse
pass, which applies PyTorch's own backward formula to each node.

The builders (`add`, `mul`, `div`, `power`, ...) fold numbers as Python would (in IEEE
double) and apply only rewrites that are exact in IEEE arithmetic for every input:
`x*1 -> x`, `x/1 -> x`, `x - 0 -> x`, `-(-x) -> x`, `x**1 -> x` and `x**0 -> 1` (torch
fills 1 there, NaN included). Nothing else is simplified, so `x*0` stays a product.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable

import sympy

from fusegen.ir import names
# The incoming gradient (d loss / d out) in every gradient expression: the one constant
# that names it. A Symbol without assumptions, so it never equals a user's name, even one
# spelled the same (expr.symbol makes those real=True, and names.for_c renames only
# those). In C it is names.DOUT, the backward's parameter; in text (notation.py), `grad`.
GRAD = sympy.Symbol(names.DOUT)


class Node(sympy.Function):
    """One eager operation. Never evaluated, reordered or simplified by sympy."""

    # The name in the expression language, for notation.py (infix operators print there).
    user_name: str | None = None
    # A condition (comparison, and, or): a bool in C, only ever the first argument of Where.
    boolean = False

    def __new__(cls, *args, **options):
        # One object per distinct node (hash-consing): sympy's own cache forgets after 1000
        # nodes, and two equal copies of a shared graph compare by walking every path of
        # both. Interned, equal nodes are the same object and compare at once.
        key = (cls, args)
        if options:
            return super().__new__(cls, *args, **options)
        node = _INTERNED.get(key)
        if node is not None:
            return node
        if len(args) == cls._nargs[0] and all(isinstance(a, sympy.Basic) for a in args):
            # What Function.__new__ makes of a node (nothing to evaluate, no evalf: see
            # _should_evalf), without its per-call bookkeeping (a FiniteSet of the arity,
            # argument sorting): a tenth of the cost, on the derivation's hottest path.
            node = sympy.Basic.__new__(cls, *args)
            node.nargs = _NARGS[cls._nargs[0]]
        else:
            node = super().__new__(cls, *args)
        _INTERNED[key] = node
        return node

    @classmethod
    def _should_evalf(cls, arg):
        return -1  # never replace a node of Float arguments by a number

    # Function.eval returns None by default: sympy builds the node as it is.


# Every node alive, by (class, arguments): an entry goes when its node does.
_INTERNED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_NARGS = {n: sympy.FiniteSet(n) for n in (1, 2, 3)}


def _node(name: str, nargs: int, user_name: str | None = None, condition: bool = False):
    return type(name, (Node,), {"nargs": nargs, "user_name": user_name or name.lower(),
                                "boolean": condition, "__module__": __name__})


# -- arithmetic (Python's operators on tensors) ---------------------------------------------
Plus = _node("Plus", 2, "+")              # torch.add
Minus = _node("Minus", 2, "-")            # torch.sub
Times = _node("Times", 2, "*")            # torch.mul
Divide = _node("Divide", 2, "/")          # torch.div (true division)
Negative = _node("Negative", 1, "-")      # torch.neg
Reciprocal = _node("Reciprocal", 1)       # torch.reciprocal (Python's `number / tensor`)
Power = _node("Power", 2, "pow")          # torch.pow: tensor ** number, number ** tensor, tensor ** tensor

# -- functions ---------------------------------------------------------------------------
Abs = _node("Abs", 1)
Exp = _node("Exp", 1)
Expm1 = _node("Expm1", 1)
Log = _node("Log", 1)
Log1p = _node("Log1p", 1)
Sqrt = _node("Sqrt", 1)
Rsqrt = _node("Rsqrt", 1)
Sin = _node("Sin", 1)
Cos = _node("Cos", 1)
Tan = _node("Tan", 1)
Tanh = _node("Tanh", 1)
Atan = _node("Atan", 1)
Sigmoid = _node("Sigmoid", 1)             # 1 / (1 + exp(-x)); derivative s*(1-s), finite for any x
Relu = _node("Relu", 1)                   # clamp_min(x, 0): NaN stays NaN
Erf = _node("Erf", 1)
Erfc = _node("Erfc", 1)
Sign = _node("Sign", 1)                   # -1, 0 or 1 (0 for NaN); zero gradient
Maximum = _node("Maximum", 2)             # NaN-propagating; ties split the gradient
Minimum = _node("Minimum", 2)
Clamp = _node("Clamp", 3)                 # clamp(x, lo, hi); an absent bound is -oo / oo
Where = _node("Where", 3)                 # where(condition, a, b)

# -- conditions (bool tensors) -------------------------------------------------------------
Less = _node("Less", 2, "<", condition=True)
LessEqual = _node("LessEqual", 2, "<=", condition=True)
Greater = _node("Greater", 2, ">", condition=True)
GreaterEqual = _node("GreaterEqual", 2, ">=", condition=True)
Equal = _node("Equal", 2, "==", condition=True)
NotEqual = _node("NotEqual", 2, "!=", condition=True)
LogicalAnd = _node("LogicalAnd", 2, "&", condition=True)  # torch.logical_and
LogicalOr = _node("LogicalOr", 2, "|", condition=True)  # torch.logical_or

COMPARISONS = (Less, LessEqual, Greater, GreaterEqual, Equal, NotEqual)


def is_condition(expr) -> bool:
    return isinstance(expr, Node) and expr.boolean


# -- numbers ---------------------------------------------------------------------------------

def number(value: float) -> sympy.Expr:
    """A Python number as a literal: integral values become exact integers (x**2.0 prints
    like x**2), infinities sympy's oo, NaN sympy's nan."""
    value = float(value)
    if math.isnan(value):
        return sympy.nan
    if math.isinf(value):
        return sympy.oo if value > 0 else -sympy.oo
    return sympy.Integer(int(value)) if value.is_integer() else sympy.Float(value)


def is_number(expr) -> bool:
    # oo, -oo and nan are singletons: `is`, not `==` (which every node of a large graph pays)
    return isinstance(expr, sympy.Expr) and (expr.is_Number or expr is sympy.oo or expr is sympy.S.NegativeInfinity
                                             or expr is sympy.nan)


def _value(expr) -> float:
    return float(expr)


def _fold(op: Callable[[float, float], float], *args) -> sympy.Expr:
    """Numbers only, computed as Python computes them (IEEE double); a division by zero is
    refused as Python refuses it."""
    values = [_value(a) for a in args]
    try:
        return number(op(*values))
    except ZeroDivisionError:
        raise ValueError("division by zero in a constant") from None
    except OverflowError:
        return number(math.inf)


# -- builders: the only way nodes are made --------------------------------------------------

def add(a, b):
    if is_number(a) and is_number(b):
        return _fold(lambda x, y: x + y, a, b)
    return Plus(a, b)


def sub(a, b):
    if is_number(a) and is_number(b):
        return _fold(lambda x, y: x - y, a, b)
    if b == 0:
        return a  # x - 0 == x, -0.0 and NaN included
    return Minus(a, b)


def mul(a, b):
    if is_number(a) and is_number(b):
        return _fold(lambda x, y: x * y, a, b)
    if b == 1:
        return a
    if a == 1:
        return b
    if b == -1:
        return neg(a)
    if a == -1:
        return neg(b)
    return Times(a, b)


def div(a, b):
    """Python's `/`: `tensor / x` is torch.div; `number / tensor` is Tensor.__rtruediv__,
    which eager computes as `tensor.reciprocal() * number`."""
    if is_number(a) and is_number(b):
        return _fold(lambda x, y: x / y, a, b)
    if is_number(a):
        return mul(Reciprocal(b), a)
    if b == 1:
        return a
    return Divide(a, b)


def neg(a):
    if is_number(a):
        return _fold(lambda x: -x, a)
    if isinstance(a, Negative):
        return a.args[0]
    return Negative(a)


def power(base, exponent):
    """`**` and pow(). torch.pow(x, 0) fills 1 and torch.pow(x, 1) copies x, so those two
    exponents fold; every other power is a node (the printer spells torch's special cases)."""
    if is_number(base) and is_number(exponent):
        return _fold(_float_pow, base, exponent)
    if is_number(exponent) and exponent == 0:
        return sympy.Integer(1)
    if is_number(exponent) and exponent == 1:
        return base
    return Power(base, exponent)


def _float_pow(x: float, y: float) -> float:
    value = x ** y
    if isinstance(value, complex):
        return math.nan  # (-8.0) ** (1/3): torch gives NaN
    return value


def relu(x):
    return Relu(x)


def where(condition, a, b):
    """`condition` is a comparison from the parser, or a number that is tested != 0."""
    if not is_condition(condition):
        condition = NotEqual(condition, sympy.Integer(0))
    return Where(condition, a, b)


def indicator(condition) -> sympy.Expr:
    """A comparison used as a number: 1 where it holds, else 0 (a bool tensor promoted to
    float in eager; no gradient flows into a comparison)."""
    return Where(condition, sympy.Integer(1), sympy.Integer(0))


def clamp(x, lo=None, hi=None):
    lo = -sympy.oo if lo is None else lo
    hi = sympy.oo if hi is None else hi
    return Clamp(x, lo, hi)


def has_bound(bound) -> bool:
    """An absent clamp bound is stored as -oo / oo (and behaves the same)."""
    return bound not in (sympy.oo, -sympy.oo)


def clamp_bounds_are_numbers(lo, hi) -> bool:
    """Whether torch computes this clamp as clamp(x, min=number, max=number) (std::max and
    std::min: a tie keeps x) rather than clamp.Tensor (NaN-propagating maximum/minimum)."""
    return not any(has_bound(b) and not is_number(b) for b in (lo, hi))


@dataclass(frozen=True)
class Function:
    """One callable name: its parameters (for keyword calls and arity errors) and builder."""

    params: tuple[str, ...]
    build: Callable[..., sympy.Expr]
    optional: int = 0  # how many trailing params may be omitted (they pass None)


def _unary(f):
    return Function(("input",), f)


FUNCTIONS: dict[str, Function] = {
    "abs": _unary(Abs),
    "exp": _unary(Exp),
    "expm1": _unary(Expm1),
    "log": _unary(Log),
    "log1p": _unary(Log1p),
    "sqrt": _unary(Sqrt),
    "rsqrt": _unary(Rsqrt),
    "sin": _unary(Sin),
    "cos": _unary(Cos),
    "tan": _unary(Tan),
    "tanh": _unary(Tanh),
    "atan": _unary(Atan),
    "sigmoid": _unary(Sigmoid),
    "relu": _unary(relu),
    "erf": _unary(Erf),
    "erfc": _unary(Erfc),
    "sign": _unary(Sign),
    "maximum": Function(("input", "other"), Maximum),
    "minimum": Function(("input", "other"), Minimum),
    "clamp": Function(("input", "min", "max"), clamp, optional=2),
    "pow": Function(("input", "exponent"), power),
    "where": Function(("condition", "input", "other"), where),
}

# Aliases PyTorch users type without thinking: torch.clip, math.fabs, torch.absolute.
ALIASES = {"clip": "clamp", "fabs": "abs", "absolute": "abs", "max": "maximum", "min": "minimum"}

# Module prefixes accepted before a function name, as dotted paths.
PREFIXES = ("torch", "torch.nn.functional", "F", "nn.functional", "math", "torch.special")

# Python's float values of the constants (math.pi is a double, as in eager Python).
CONSTANTS = {"math.pi": sympy.Float(math.pi), "math.e": sympy.Float(math.e),
             "torch.pi": sympy.Float(math.pi), "torch.e": sympy.Float(math.e),
             "math.inf": sympy.oo, "torch.inf": sympy.oo}

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


# PyTorch functions a user may reach for that fusegen does not take, and what to say instead
# of a spelling suggestion (softmax is not a misspelt max). The formulas parse (tests/test_parse.py).
_REDUCTION = ("{f} reduces over a dimension, so it is not elementwise; fusegen fuses elementwise "
              "expressions only: apply torch.{f} to the op's output (or input)")
_NOT_ELEMENTWISE = ("{f} is not elementwise (each output reads more than one element of its "
                    "inputs); fusegen fuses elementwise expressions only")
UNSUPPORTED: dict[str, str] = {
    **{f: _REDUCTION for f in ("sum", "mean", "prod", "softmax", "log_softmax", "logsumexp", "amax",
                              "amin", "argmax", "argmin", "std", "var", "norm", "cumsum", "cumprod",
                              "layer_norm", "rms_norm", "group_norm", "batch_norm", "normalize",
                              "cross_entropy", "nll_loss", "mse_loss", "all", "any")},
    **{f: _NOT_ELEMENTWISE for f in ("matmul", "mm", "bmm", "linear", "conv1d", "conv2d", "einsum",
                                    "cat", "stack", "reshape", "view", "transpose", "flip", "roll",
                                    "gather", "index_select")},
    **{f: "{f} draws random numbers, which fusegen does not support; expected a deterministic "
          "expression" for f in ("dropout", "rand_like", "randn_like", "bernoulli")},
    "silu": "{f} is not a built-in; write it: x * sigmoid(x)",
    "gelu": "{f} is not a built-in; write it: 0.5 * x * (1 + erf(x * 0.7071067811865476))",
    "softplus": "{f} is not a built-in; write it (torch's threshold 20): where(x > 20, x, log1p(exp(x)))",
    "mish": "{f} is not a built-in; write it: x * tanh(where(x > 20, x, log1p(exp(x))))",
    "elu": "{f} is not a built-in; write it: where(x > 0, x, alpha * expm1(x)) with a scalar alpha",
    "leaky_relu": "{f} is not a built-in; write it: where(x > 0, x, 0.01 * x)",
    "hardtanh": "{f} is not a built-in; write it: clamp(x, -1, 1)",
    "clamp_min": "{f} is not a built-in; write it: clamp(x, min=m)",
    "clamp_max": "{f} is not a built-in; write it: clamp(x, max=m)",
    "square": "{f} is not a built-in; write it: x * x",
    "neg": "{f} is not a built-in; write it: -x",
    "reciprocal": "{f} is not a built-in; write it: 1 / x",
    "exp2": "{f} is not a built-in; write it: 2 ** x",
    "log2": "{f} is not a built-in; write it: log(x) * 1.4426950408889634",
    "log10": "{f} is not a built-in; write it: log(x) * 0.4342944819032518",
    "sinh": "{f} is not a built-in; write it: (exp(x) - exp(-x)) / 2",
    "cosh": "{f} is not a built-in; write it: (exp(x) + exp(-x)) / 2",
    **{f: "{f} is not supported; the functions fusegen knows: {known}"
       for f in ("asin", "acos", "asinh", "acosh", "atanh", "atan2", "floor", "ceil", "round", "trunc",
                 "frac", "fmod", "remainder", "lgamma", "digamma", "erfinv", "logit", "hypot", "fmax",
                 "fmin", "isnan", "isinf", "nan_to_num", "logaddexp")},
}


def unsupported_hint(base: str) -> str | None:
    """What to say about a PyTorch function fusegen does not take, or None."""
    text = UNSUPPORTED.get(base)
    return None if text is None else text.format(f=base, known=", ".join(known_names()))


def suggestions(base: str) -> list[str]:
    """Known spellings within one edit of `base` (two for names of 8 letters or more),
    an adjacent swap counting as one edit: `sigmod` -> sigmoid, `epx` -> exp; not
    `softmax` -> max, which shares letters but not a spelling."""
    limit = 1 if len(base) < 8 else 2
    scored = sorted((d, n) for n in known_names() if (d := _edit_distance(base, n)) <= limit)
    return [n for d, n in scored if d == scored[0][0]][:2] if scored else []


def _edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions, adjacent swaps."""
    prev2, prev = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            cost = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if prev2 is not None and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, prev2[j - 2] + 1)
            row.append(cost)
        prev2, prev = prev, row
    return prev[-1]


# float32's maximum as numpy prints it (3.4028234663852886e38 exactly, torch.finfo's max):
# every double up to it rounds to a finite float32 (inf starts halfway to 2**128).
LITERAL_MAX = 3.4028235e38
LITERAL_RANGE = "|value| <= 3.4028235e38"


def literal_ok(value: float) -> bool:
    """Literals must be finite float32-representable magnitudes: the kernels compute in
    float for fp32/fp16/bf16, and a literal that overflows there is a bug, not a number."""
    return math.isfinite(value) and abs(value) <= LITERAL_MAX

"""The primitive table: every function and operator of the language, declared once.

Only this file says which names exist. Each entry of PRIMITIVES (a `Primitive`) gives one
operation's sympy node, its name, aliases and parameters (so `clamp(x, min=0)` works as in
torch), its builder, PyTorch's backward formula, its C spelling, its eager torch callable,
its ONNX lowering and whether the CPU loop vectorizes it; spec.py, printer.py,
notation.py, reference.py, composite.py and onnx.py derive their tables from it.

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

import atexit
import importlib
import math
import weakref
from dataclasses import dataclass
from typing import Callable

import sympy

from fusegen.ir import dag
from fusegen.ir import names
# The incoming gradient (d loss / d out) in every gradient expression: the one constant
# that names it. A Symbol without assumptions, so it never equals a user's name, even one
# spelled the same (expr.symbol makes those real=True, and names.for_c renames only
# those). In C it is names.DOUT, the backward's parameter; in text (notation.py), `grad`.
GRAD = sympy.Symbol(names.DOUT)


# The random numbers of an op that draws them: stream k (the op's k-th torch.rand_like, or
# the one a dropout draws) is one uniform in [0, 1) per element, the symbol `rand<k>`
# (names.random), a Symbol without assumptions as GRAD (never a user's name); the kernels
# draw it (templates/runtime/fusegen-random.h). No gradient flows into it.
def random_stream(k: int) -> sympy.Symbol:
    return sympy.Symbol(names.random(k))


def is_random(expr) -> bool:
    return isinstance(expr, sympy.Symbol) and not expr.is_real and names.is_random(expr.name)


# torch's spellings of what draws random numbers (the parser reads their arguments itself).
RANDOM_NAMES = ("rand_like", "dropout")


def dropout(x, p, u):
    """F.dropout(x, p) with the uniform u: x times 1/(1-p) where u < 1 - p, else times 0, as
    torch's dropout multiplies by its scaled mask (so an infinite x dropped is NaN there too).
    p = 1 multiplies by zero, as torch does, and draws nothing."""
    if is_number(p) and p == 1:
        return mul(x, _ZERO)
    keep = Less(u, sub(_ONE, p))
    return mul(x, Where(keep, div(_ONE, sub(_ONE, p)), _ZERO))


def douts(count: int) -> tuple[sympy.Symbol, ...]:
    """The incoming gradients of an op's `count` outputs, in order: GRAD for one output,
    `dout0`, `dout1`, ... (names.dout) for several; Symbols without assumptions, as GRAD."""
    return (GRAD,) if count == 1 else tuple(sympy.Symbol(names.dout(k)) for k in range(count))


def is_dout(expr) -> bool:
    """Whether `expr` is an incoming gradient: GRAD or one of douts(n)'s."""
    return isinstance(expr, sympy.Symbol) and not expr.is_real and names.is_dout(expr.name)


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
# Emptied before the interpreter tears modules down: a node freed later would have its key
# (sympy numbers among its arguments) hashed when sympy can no longer import.
atexit.register(_INTERNED.clear)
_NARGS = {n: sympy.FiniteSet(n) for n in (1, 2, 3)}


def _node(name: str, nargs: int, condition: bool = False):
    """A node class; its user_name is set by its entry in PRIMITIVES."""
    return type(name, (Node,), {"nargs": nargs, "boolean": condition, "__module__": __name__})


# -- arithmetic (Python's operators on tensors) ---------------------------------------------
Plus = _node("Plus", 2)               # torch.add
Minus = _node("Minus", 2)             # torch.sub
Times = _node("Times", 2)             # torch.mul
Divide = _node("Divide", 2)           # torch.div (true division)
Negative = _node("Negative", 1)       # torch.neg
Reciprocal = _node("Reciprocal", 1)   # torch.reciprocal (Python's `number / tensor`)
Power = _node("Power", 2)             # torch.pow: tensor ** number, number ** tensor, tensor ** tensor

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
Sigmoid = _node("Sigmoid", 1)         # 1 / (1 + exp(-x)); derivative s*(1-s), finite for any x
Relu = _node("Relu", 1)               # clamp_min(x, 0): NaN stays NaN
Erf = _node("Erf", 1)
Erfc = _node("Erfc", 1)
Sign = _node("Sign", 1)               # -1, 0 or 1 (0 for NaN); zero gradient
Detach = _node("Detach", 1)           # Tensor.detach: the same value, no gradient through it
Maximum = _node("Maximum", 2)         # NaN-propagating; ties split the gradient
Minimum = _node("Minimum", 2)
Clamp = _node("Clamp", 3)             # clamp(x, lo, hi); an absent bound is -oo / oo
Where = _node("Where", 3)             # where(condition, a, b)

# -- conditions (bool tensors) -------------------------------------------------------------
Less = _node("Less", 2, condition=True)
LessEqual = _node("LessEqual", 2, condition=True)
Greater = _node("Greater", 2, condition=True)
GreaterEqual = _node("GreaterEqual", 2, condition=True)
Equal = _node("Equal", 2, condition=True)
NotEqual = _node("NotEqual", 2, condition=True)
LogicalAnd = _node("LogicalAnd", 2, condition=True)# torch.logical_and
LogicalOr = _node("LogicalOr", 2, condition=True)# torch.logical_or

COMPARISONS = (Less, LessEqual, Greater, GreaterEqual, Equal, NotEqual)

# -- row reductions: over the last dimension with keepdim=True, so that the value broadcasts
# back over its row (ir/rows.py schedules them into the row kernel's passes) -----------------
RowSum = _node("RowSum", 1)           # x.sum(-1, keepdim=True)
RowMean = _node("RowMean", 1)         # x.mean(-1, keepdim=True)
RowMax = _node("RowMax", 1)           # torch.amax(x, -1, keepdim=True): NaN-propagating
RowMin = _node("RowMin", 1)           # torch.amin(x, -1, keepdim=True)
RowLogSumExp = _node("RowLogSumExp", 1)  # torch.logsumexp(x, -1, keepdim=True)

REDUCTIONS = (RowSum, RowMean, RowMax, RowMin, RowLogSumExp)
# torch's spelling of each reduction: the function or method name
REDUCTION_NAMES = {"sum": RowSum, "mean": RowMean, "amax": RowMax, "amin": RowMin,
                   "logsumexp": RowLogSumExp}


def is_reduction(expr) -> bool:
    return type(expr) in _REDUCTION_SET


# x.gather(-1, index) with one index per row is no node of its own: it is written with the
# row sums below, so that its gradient (a scatter of the row's gradient into the element it
# picked) is derived like any other. COLUMN is an element's index along its row (0 .. n-1,
# in the compute type); it has no assumptions, so it never meets a user's name (real).
GATHER = "gather"
COLUMN = sympy.Symbol("col")


def gather(x, index) -> sympy.Expr:
    """The element of each row at `index`: sum(where(col == index, x, 0)), and NaN where
    the index names no element of the row (sum(col == index) is not 1), where torch's
    gather raises: a CUDA kernel cannot raise without a host synchronisation."""
    hit = Equal(COLUMN, index)
    picked = RowSum(Where(hit, x, _ZERO))
    return Where(Equal(RowSum(indicator(hit)), _ONE), picked, sympy.nan)


def index_symbols(exprs) -> set:
    """The symbols a gather's index reads (the inputs that hold indices), found in `exprs`."""
    out = set()
    for node in dag.postorder(list(exprs)):
        if type(node) is Equal and node.args[0] == COLUMN:
            out |= dag.free_symbols([node.args[1]])
    return out


_REDUCTION_SET = frozenset(REDUCTIONS)


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


def detach(x):
    """A number has no gradient to stop."""
    return x if is_number(x) else Detach(x)


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


# -- backward formulas (tools/autograd/derivatives.yaml, FunctionsManual.cpp) ------------------
# formula(args, result, grad) -> [(argument, gradient contribution)]: `result` is
# derivatives.yaml's `result`, the node itself.

_ZERO, _ONE, _TWO = sympy.Integer(0), sympy.Integer(1), sympy.Integer(2)
_TWO_OVER_SQRT_PI = sympy.Float(1.1283791670955126)  # 2.0 / sqrt(M_PI), in double as torch has it
# F.softplus's defaults (beta=1, threshold=20): above the threshold it is x itself.
SOFTPLUS_THRESHOLD = 20


def _erf_backward(c):
    """(+-2/sqrt(pi)) * exp(-(self.pow(2))) * grad."""
    return lambda a, r, g: [(a[0], mul(mul(c, Exp(neg(power(a[0], _TWO)))), g))]


def _min_max_backward(maximum: bool):
    """where(self == other, grad / 2, grad).masked_fill_(self < other, 0) for maximum's self."""
    def formula(a, r, g):
        x, y = a
        split = Where(Equal(x, y), div(g, _TWO), g)
        lose_x = Less(x, y) if maximum else Greater(x, y)
        lose_y = Greater(x, y) if maximum else Less(x, y)
        return [(x, Where(lose_x, _ZERO, split)), (y, Where(lose_y, _ZERO, split))]
    return formula


def _pow_backward(r, base, exponent, g):
    """pow_backward, pow_backward_self and pow_backward_exponent (FunctionsManual.cpp)."""
    if is_number(exponent):                             # tensor ** number
        if exponent == 0:
            return [(base, _ZERO)]                      # zeros_like(self)
        e = number(float(exponent))
        return [(base, mul(g, mul(e, power(base, sub(e, _ONE)))))]
    out = []
    if not is_number(base):                             # tensor ** tensor: d/dself
        d = mul(g, mul(exponent, power(base, sub(exponent, _ONE))))
        out.append((base, Where(Equal(exponent, _ZERO), _ZERO, d)))
        zero_base = LogicalAnd(Equal(base, _ZERO), GreaterEqual(exponent, _ZERO))
        out.append((exponent, mul(g, Where(zero_base, _ZERO, mul(r, Log(base))))))
        return out
    # number ** tensor: grad * (result * log(base)), masked where base == 0 and exponent >= 0
    log_base = number(_log(float(base)))
    if base == 0:
        return [(exponent, mul(g, Where(GreaterEqual(exponent, _ZERO), _ZERO, Times(r, log_base))))]
    return [(exponent, mul(g, Times(r, log_base)))]


def _log(x: float) -> float:
    """c10::Scalar::log of a real base: std::log in double."""
    if x == 0:
        return -math.inf
    return math.log(x) if x > 0 else math.nan


def _clamp_backward(x, lo, hi, g):
    """clamp_backward and clamp_backward_min_max: x gets grad inside [lo, hi] (bounds
    included); lo where x < lo < hi; hi where x > hi or hi < lo (torch returns hi then)."""
    has_lo, has_hi = has_bound(lo), has_bound(hi)
    if has_lo and has_hi:
        inside = LogicalAnd(GreaterEqual(x, lo), LessEqual(x, hi))
    elif has_lo:
        inside = GreaterEqual(x, lo)
    elif has_hi:
        inside = LessEqual(x, hi)
    else:
        return [(x, g)]
    out = [(x, Where(inside, g, _ZERO))]
    if has_lo:
        below = LogicalAnd(Less(x, lo), Less(lo, hi)) if has_hi else Less(x, lo)
        out.append((lo, Where(below, g, _ZERO)))
    if has_hi:
        above = LogicalOr(Greater(x, hi), Less(hi, lo)) if has_lo else Greater(x, hi)
        out.append((hi, Where(above, g, _ZERO)))
    return out


def _where_backward(a, r, g):
    """where's branches get grad under a guard (spec.py selects it after the branch's own
    backward): [(argument, contribution, ((condition, taken),))]."""
    c, x, y = a
    return [(x, g, ((c, True),)), (y, g, ((c, False),))]


def _softplus_backward(a, r, g):
    """softplus_backward (beta 1, threshold 20), as its kernel computes it: with z = exp(x),
    x > threshold ? grad : grad * z / (z + 1)."""
    (x,) = a
    z = Exp(x)
    return [(x, Where(Greater(x, sympy.Integer(SOFTPLUS_THRESHOLD)), g, div(mul(g, z), add(z, _ONE))))]


def _extreme_backward(a, r, g):
    """amax/amin: evenly_distribute_backward, as torch's scale_grad_by_count: the row's
    gradient divided by the number of elements equal to the result, on those elements."""
    hit = indicator(Equal(a[0], r))
    return [(a[0], mul(div(RowSum(g), RowSum(hit)), hit))]


# A reduction's value broadcasts over its row, so the gradient it receives is one value per
# element: the row's total (RowSum(g)) is the gradient of the reduced value, which then
# flows back to every element (a broadcast's gradient is a reduction, a reduction's
# gradient a broadcast).
_ROW_BACKWARDS = {
    RowSum: lambda a, r, g: [(a[0], RowSum(g))],
    RowMean: lambda a, r, g: [(a[0], RowMean(g))],  # grad.expand(...) / N
    RowMax: _extreme_backward,
    RowMin: _extreme_backward,
    RowLogSumExp: lambda a, r, g: [(a[0], mul(RowSum(g), Exp(sub(a[0], r))))],  # grad * (self - result).exp()
}


def _logsumexp_onnx(x):
    """torch's logsumexp: the row's maximum (0 where infinite), then log(sum(exp(x - max))) + max."""
    top = RowMax(x)
    shift = Where(Equal(Abs(top), sympy.oo), _ZERO, top)
    return add(Log(RowSum(Exp(sub(x, shift)))), shift)


_ROW_ONNX = {RowLogSumExp: _logsumexp_onnx}


# -- the table --------------------------------------------------------------------------------

class _OnnxFormula:
    """The `onnx` of a primitive that fusegen/pytorch/onnx.py spells as its own formula."""

    def __repr__(self):
        return "ONNX_FORMULA"


ONNX_FORMULA = _OnnxFormula()
UNARY = ("input",)


@dataclass(frozen=True)
class Primitive:
    """One function or operator of the language, everything about it in one place: every
    other table (the parser's names, spec.py's backward formulas, printer.py's C spellings,
    the eager torch callables of reference.py and composite.py, onnx.py's lowering,
    notation.py's spellings) is derived from PRIMITIVES."""

    node: type                      # the sympy node: one eager PyTorch operation
    name: str                       # the spelling in the language: a function name or an operator
    # derivatives.yaml's formula: (args, result, grad) -> [(argument, contribution)];
    # None for a condition (a bool: no gradient flows into it).
    backward: Callable | None
    # C: a math function ("exp": expf in float), "fusegen::<helper>" of templates/runtime/fusegen-math.h
    # (overloaded per compute type), or None where printer.py has its own _print_<Node>.
    c: str | None
    eager: str                      # the eager callable, dotted ("torch.exp"): reference and composite
    # ONNX: one operator of the same arguments ("Exp"); a decomposition into other primitives
    # (args -> tree), lowered node by node; or ONNX_FORMULA (onnx.py's own formula).
    onnx: str | Callable | ONNX_FORMULA
    params: tuple[str, ...] | None = None  # a function's parameters (torch's names); None: an operator
    build: Callable | None = None   # the builder a call goes through (default: the node)
    optional: int = 0               # trailing params that may be omitted
    aliases: tuple[str, ...] = ()   # other names a call may use
    # The C math function has a libmvec float variant (templates/runtime/fusegen-cpu.h declares
    # it `simd`), so the CPU loop vectorizes it.
    simd: bool = False
    # The eager callable takes tensors (a number argument becomes a 0-dim tensor); False for
    # Python's operators, which take a number as it is.
    tensor_args: bool = True

    def __post_init__(self):
        self.node.user_name = self.name

    @property
    def function(self) -> Function | None:
        if self.params is None:
            return None
        return Function(self.params, self.build or self.node, self.optional)


def _op(node, name, backward, c, eager, onnx, **kw):
    return Primitive(node, name, backward, c, eager, onnx, tensor_args=False, **kw)


def _cmp(node, name, python, onnx):
    return _op(node, name, None, None, f"operator.{python}", onnx)


PRIMITIVES: tuple[Primitive, ...] = (
    # -- arithmetic: Python's operators on tensors (the printer spells them infix) ----------
    _op(Plus, "+", lambda a, r, g: [(a[0], g), (a[1], g)], None, "operator.add", "Add"),
    _op(Minus, "-", lambda a, r, g: [(a[0], g), (a[1], neg(g))], None, "operator.sub", "Sub"),
    _op(Times, "*", lambda a, r, g: [(a[0], mul(g, a[1])), (a[1], mul(g, a[0]))],  # grad * other
        None, "operator.mul", "Mul"),
    # grad / other, -grad * ((self / other) / other)
    _op(Divide, "/", lambda a, r, g: [(a[0], div(g, a[1])), (a[1], mul(neg(g), div(r, a[1])))],
        None, "operator.truediv", "Div"),
    Primitive(Negative, "-", lambda a, r, g: [(a[0], neg(g))], None, "torch.neg", "Neg"),
    Primitive(Reciprocal, "reciprocal", lambda a, r, g: [(a[0], mul(neg(g), mul(r, r)))],  # -grad * (result * result)
              None, "torch.reciprocal", "Reciprocal"),
    # -- functions, in the order the parser lists them ----------------------------------------
    Primitive(Abs, "abs", lambda a, r, g: [(a[0], mul(g, Sign(a[0])))],  # grad * self.sgn()
              "fabs", "torch.abs", "Abs", UNARY, aliases=("fabs", "absolute")),
    Primitive(Exp, "exp", lambda a, r, g: [(a[0], mul(g, r))], "exp", "torch.exp", "Exp", UNARY, simd=True),
    Primitive(Expm1, "expm1", lambda a, r, g: [(a[0], mul(g, add(r, _ONE)))],
              "expm1", "torch.expm1", ONNX_FORMULA, UNARY, simd=True),
    Primitive(Log, "log", lambda a, r, g: [(a[0], div(g, a[0]))], "log", "torch.log", "Log", UNARY, simd=True),
    Primitive(Log1p, "log1p", lambda a, r, g: [(a[0], div(g, add(a[0], _ONE)))],
              "log1p", "torch.log1p", ONNX_FORMULA, UNARY, simd=True),
    Primitive(Sqrt, "sqrt", lambda a, r, g: [(a[0], div(g, mul(_TWO, r)))],  # grad / (2 * result)
              "sqrt", "torch.sqrt", "Sqrt", UNARY),
    # -0.5 * grad * result.pow(3)
    Primitive(Rsqrt, "rsqrt", lambda a, r, g: [(a[0], mul(mul(number(-0.5), g), power(r, sympy.Integer(3))))],
              None, "torch.rsqrt", ONNX_FORMULA, UNARY),
    Primitive(Sin, "sin", lambda a, r, g: [(a[0], mul(g, Cos(a[0])))], "sin", "torch.sin", "Sin", UNARY, simd=True),
    Primitive(Cos, "cos", lambda a, r, g: [(a[0], mul(g, neg(Sin(a[0]))))],
              "cos", "torch.cos", "Cos", UNARY, simd=True),
    Primitive(Tan, "tan", lambda a, r, g: [(a[0], mul(g, add(_ONE, power(r, _TWO))))],  # grad * (1 + result.pow(2))
              "tan", "torch.tan", "Tan", UNARY, simd=True),
    Primitive(Tanh, "tanh", lambda a, r, g: [(a[0], mul(g, sub(_ONE, mul(r, r))))],  # tanh_backward
              "tanh", "torch.tanh", "Tanh", UNARY, simd=True),
    Primitive(Atan, "atan", lambda a, r, g: [(a[0], div(g, add(mul(a[0], a[0]), _ONE)))],  # grad / (self*self + 1)
              "atan", "torch.atan", "Atan", UNARY, simd=True),
    # 1 / (1 + exp(-x)); grad * (1 - y) * y, finite for any x
    Primitive(Sigmoid, "sigmoid", lambda a, r, g: [(a[0], mul(mul(g, sub(_ONE, r)), r))],
              "fusegen::sigmoid", "torch.sigmoid", ONNX_FORMULA, UNARY),
    # clamp_min(x, 0): NaN stays NaN; threshold_backward(grad, result, 0)
    Primitive(Relu, "relu", lambda a, r, g: [(a[0], Where(LessEqual(r, _ZERO), _ZERO, g))],
              "fusegen::relu", "torch.relu", "Relu", UNARY),
    Primitive(Erf, "erf", _erf_backward(_TWO_OVER_SQRT_PI), "erf", "torch.erf", "Erf", UNARY, simd=True),
    Primitive(Erfc, "erfc", _erf_backward(-_TWO_OVER_SQRT_PI), "erfc", "torch.erfc", ONNX_FORMULA, UNARY, simd=True),
    # -1, 0 or 1 (0 for NaN); zeros_like(grad)
    Primitive(Sign, "sign", lambda a, r, g: [(a[0], _ZERO)], "fusegen::sign", "torch.sign", ONNX_FORMULA, UNARY),
    # the value itself; nothing flows back (a stable softmax's `x - x.amax(...).detach()`)
    Primitive(Detach, "detach", lambda a, r, g: [], None, "torch.detach", lambda x: x, UNARY, build=lambda x: detach(x)),
    # NaN-propagating; ties split the gradient
    Primitive(Maximum, "maximum", _min_max_backward(True), "fusegen::maximum", "torch.maximum", "Max",
              ("input", "other"), aliases=("max",)),
    Primitive(Minimum, "minimum", _min_max_backward(False), "fusegen::minimum", "torch.minimum", "Min",
              ("input", "other"), aliases=("min",)),
    # clamp(x, lo, hi); an absent bound is -oo / oo
    Primitive(Clamp, "clamp", lambda a, r, g: _clamp_backward(*a, g), None, "torch.clamp", ONNX_FORMULA,
              ("input", "min", "max"), build=clamp, optional=2, aliases=("clip",)),
    # tensor ** number, number ** tensor, tensor ** tensor; powf has a libmvec variant
    Primitive(Power, "pow", lambda a, r, g: _pow_backward(r, a[0], a[1], g), None, "torch.pow", ONNX_FORMULA,
              ("input", "exponent"), build=power, simd=True),
    Primitive(Where, "where", _where_backward, None, "torch.where", "Where",
              ("condition", "input", "other"), build=where),
    # F.softplus with beta 1, threshold 20
    Primitive(_node("Softplus", 1), "softplus", _softplus_backward, "fusegen::softplus",
              "torch.nn.functional.softplus",
              lambda x: Where(Greater(x, sympy.Integer(SOFTPLUS_THRESHOLD)), x, Log1p(Exp(x))), UNARY),
    # -- conditions (bool tensors) ------------------------------------------------------------
    _cmp(Less, "<", "lt", "Less"),
    _cmp(LessEqual, "<=", "le", "LessOrEqual"),
    _cmp(Greater, ">", "gt", "Greater"),
    _cmp(GreaterEqual, ">=", "ge", "GreaterOrEqual"),
    _cmp(Equal, "==", "eq", "Equal"),
    _cmp(NotEqual, "!=", "ne", ONNX_FORMULA),
    Primitive(LogicalAnd, "&", None, None, "torch.logical_and", "And"),
    Primitive(LogicalOr, "|", None, None, "torch.logical_or", "Or"),
    # -- row reductions (the parser reads their dim and keepdim itself: _Converter._reduce) --
    *(Primitive(node, name, _ROW_BACKWARDS[node], None, f"fusegen.pytorch.rows.{name}",
                _ROW_ONNX.get(node, ONNX_FORMULA)) for name, node in REDUCTION_NAMES.items()),
)

BY_NODE: dict[type, Primitive] = {p.node: p for p in PRIMITIVES}
# An entry may make its node inline (`_node("Softplus", 1)`): it is still this module's
# attribute of its class name (fn.Softplus), where pickle and readers look for it.
for _p in PRIMITIVES:
    globals().setdefault(_p.node.__name__, _p.node)
del _p

FUNCTIONS: dict[str, Function] = {p.name: p.function for p in PRIMITIVES if p.params is not None}

# Aliases PyTorch users type without thinking: torch.clip, math.fabs, torch.absolute.
ALIASES = {alias: p.name for p in PRIMITIVES for alias in p.aliases}

_EAGER: dict[type, Callable] = {}


def eager(p: Primitive) -> Callable:
    """The eager PyTorch callable of a primitive (imported on first use: the IR needs no torch)."""
    f = _EAGER.get(p.node)
    if f is None:
        module, _, attr = p.eager.rpartition(".")
        f = _EAGER[p.node] = getattr(importlib.import_module(module), attr)
    return f


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
    return base if base in FUNCTIONS or base in REDUCTION_NAMES or base in RANDOM_NAMES \
        or base == GATHER else None


def known_names() -> list[str]:
    """Every spelling a user may call, for 'did you mean' suggestions."""
    return sorted(set(FUNCTIONS) | set(ALIASES) | set(REDUCTION_NAMES) | set(RANDOM_NAMES) | {GATHER})


# PyTorch functions a user may reach for that fusegen does not take, and what to say instead
# of a spelling suggestion (softmax is not a misspelt max). The formulas parse (tests/test_parse.py).
_REDUCTION = ("{f} is not a built-in; fusegen reduces over the last dimension with sum, mean, "
              "amax, amin and logsumexp (dim=-1, keepdim=True): write {f} with those, or apply "
              "torch.{f} to the op's output")
_NOT_ELEMENTWISE = ("{f} is not elementwise (each output reads more than one element of its "
                    "inputs); fusegen fuses elementwise expressions only")
UNSUPPORTED: dict[str, str] = {
    **{f: _REDUCTION for f in ("prod", "softmax", "log_softmax", "argmax", "argmin", "std", "var",
                              "norm", "cumsum", "cumprod",
                              "layer_norm", "rms_norm", "group_norm", "batch_norm", "normalize",
                              "nll_loss", "mse_loss", "all", "any")},
    **{f: _NOT_ELEMENTWISE for f in ("matmul", "mm", "bmm", "linear", "conv1d", "conv2d", "einsum",
                                    "cat", "stack", "reshape", "view", "transpose", "flip", "roll",
                                    "index_select")},
    "cross_entropy": ("{f} is not a built-in; write each row's loss: torch.logsumexp(x, -1, "
                      "keepdim=True) - x.gather(-1, label), with label of shape (..., 1), and "
                      "take the mean outside"),
    **{f: "{f} is not supported; fusegen draws uniform numbers: torch.rand_like(x) and "
          "F.dropout(x, p)" for f in ("randn_like", "bernoulli", "rand", "randn", "normal",
                                     "alpha_dropout", "dropout1d", "dropout2d", "dropout3d")},
    "silu": "{f} is not a built-in; write it: x * sigmoid(x)",
    "gelu": "{f} is not a built-in; write it: 0.5 * x * (1 + erf(x * 0.7071067811865476))",
    "mish": "{f} is not a built-in; write it: x * tanh(softplus(x))",
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

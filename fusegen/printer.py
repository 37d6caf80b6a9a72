"""The only place that knows C spellings.

`CPrinter` subclasses sympy's C99 printer for one compute type ("float" or "double"):
`expf` vs `exp`, `2.0f` vs `2.0`, `x*x` instead of `powf(x, 2)`, literal pi instead of
the double macro `M_PI`, and NaN-propagating maximum/minimum (C's fmaxf drops NaN,
torch.maximum keeps it). The helpers it calls (`fusegen::maximum`, ...) live in
templates/fusegen.h.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
from sympy.codegen.ast import float32, float64, real
from sympy.printing.c import C99CodePrinter
from sympy.printing.precedence import PRECEDENCE, precedence

from . import functions as fn
from .spec import OpSpec, Program

COMPUTE_TYPES = {"float": float32, "double": float64}
LITERAL_SUFFIX = {"float": "f", "double": ""}

# Small integer powers as torch computes them (pow_tensor_scalar special-cases these).
_POW_BY_MULTIPLY = {2: 2, 3: 3}

# sympy relational class -> C operator
_REL_OPS = {"StrictGreaterThan": ">", "StrictLessThan": "<", "GreaterThan": ">=",
            "LessThan": "<=", "Equality": "==", "Unequality": "!="}


class CPrinter(C99CodePrinter):
    """sympy -> C for one compute type. Every override below exists because the default
    spelling is wrong for us (precision, NaN behaviour or readability)."""

    def __init__(self, compute_type: str):
        super().__init__({"type_aliases": {real: COMPUTE_TYPES[compute_type]}})
        self.ctype = compute_type
        self.suffix = LITERAL_SUFFIX[compute_type]

    # -- literals --------------------------------------------------------------
    def literal(self, value: float) -> str:
        text = repr(float(value))
        if "e" not in text and "." not in text and "inf" not in text:
            text += ".0"
        if text in ("inf", "-inf"):
            return ("-" if text[0] == "-" else "") + "INFINITY"
        return text + self.suffix

    def _print_Float(self, expr):
        return self.literal(float(expr))

    def _print_Integer(self, expr):
        return self.literal(int(expr))

    _print_One = _print_Integer
    _print_Zero = _print_Integer
    _print_NegativeOne = _print_Integer

    def _print_Rational(self, expr):
        return self.literal(float(expr))

    _print_Half = _print_Rational

    def _print_Pi(self, expr):
        return self.literal(3.141592653589793)

    def _print_Exp1(self, expr):
        return self.literal(2.718281828459045)

    def _print_Infinity(self, expr):
        return "INFINITY"

    def _print_NegativeInfinity(self, expr):
        return "-INFINITY"

    # -- powers ------------------------------------------------------------------
    def parenthesize(self, item, level, strict=False):
        # x**2 prints as x*x; inside a product (y/(x*x)) it needs its own parentheses.
        # (sympy's Add prints its terms without calling parenthesize, so `x*x + 1` stays bare.)
        if isinstance(item, sympy.Pow) and item.exp.is_Integer and int(item.exp) in _POW_BY_MULTIPLY:
            return f"({self._print(item)})"
        # A positive rational prints as one literal (0.5f), which needs no parentheses.
        if isinstance(item, sympy.Rational) and item > 0:
            return self._print(item)
        return super().parenthesize(item, level, strict)

    def _print_Pow(self, expr):
        base, exp = expr.args
        b = self.parenthesize(base, precedence(expr))
        if exp.is_Integer and abs(int(exp)) in _POW_BY_MULTIPLY:
            product = "*".join([b] * abs(int(exp)))
            return product if exp > 0 else f"{self.literal(1)}/({product})"
        if exp == -1:
            return f"{self.literal(1)}/{b}"
        if exp.is_Number and float(exp) == 0.5:  # 1/2 or 0.5: torch computes x**0.5 as sqrt
            return f"sqrt{self._fsuffix}({self._print(base)})"
        if exp.is_Number and float(exp) == -0.5:
            return f"{self.literal(1)}/sqrt{self._fsuffix}({self._print(base)})"
        return f"pow{self._fsuffix}({self._print(base)}, {self._print(exp)})"

    @property
    def _fsuffix(self):
        return "f" if self.ctype == "float" else ""

    def _print_Power(self, expr):
        return f"pow{self._fsuffix}({self._print(expr.args[0])}, {self._print(expr.args[1])})"

    # -- our functions -------------------------------------------------------------
    def _helper(self, name, expr):
        return f"fusegen::{name}({', '.join(self._print(a) for a in expr.args)})"

    def _nary(self, name, args):
        out = self._print(args[0])
        for a in args[1:]:
            out = f"fusegen::{name}({out}, {self._print(a)})"
        return out

    def _print_Max(self, expr):
        return self._nary("maximum", sorted(expr.args, key=sympy.default_sort_key))

    def _print_Min(self, expr):
        return self._nary("minimum", sorted(expr.args, key=sympy.default_sort_key))

    def _print_Heaviside(self, expr):
        return f"fusegen::heaviside({self._print(expr.args[0])})"

    def _print_sign(self, expr):
        return self._helper("sign", expr)

    _print_Sign = _print_sign

    def _print_Sigmoid(self, expr):
        return self._helper("sigmoid", expr)

    def _print_Clamp(self, expr):
        x, lo, hi = expr.args
        out = self._print(x)
        if lo != -sympy.oo:
            out = f"fusegen::maximum({out}, {self._print(lo)})"
        if hi != sympy.oo:
            out = f"fusegen::minimum({out}, {self._print(hi)})"
        return out

    # -- conditions ----------------------------------------------------------------
    def _print_Relational(self, expr):
        op = _REL_OPS[type(expr).__name__]
        return f"{self._print(expr.lhs)} {op} {self._print(expr.rhs)}"

    def _print_And(self, expr):
        return " && ".join(f"({self._print(a)})" for a in sorted(expr.args, key=sympy.default_sort_key))

    def _print_Or(self, expr):
        return " || ".join(f"({self._print(a)})" for a in sorted(expr.args, key=sympy.default_sort_key))

    def _print_BooleanTrue(self, expr):
        return "true"

    def _print_BooleanFalse(self, expr):
        return "false"

    def _print_Piecewise(self, expr):
        # One line of nested ternaries; sympy's own spreads one over five lines.
        *pieces, (last_value, last_cond) = expr.args
        if last_cond != sympy.true:
            raise ValueError("Piecewise without a default branch")
        out = self._print(last_value)
        for value, cond in reversed(pieces):
            out = f"({self._print(cond)} ? {self._print(value)} : {out})"
        return out


@dataclass(frozen=True)
class Statements:
    """A program printed for one compute type: `const T t0 = ...;` lines and results.

    temps are (C type, name, code): a comparison shared by cse is a `bool`."""

    temps: tuple[tuple[str, str, str], ...]
    results: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class PrintedOp:
    """C strings for every program of an op, per compute type."""

    forward: dict[str, Statements]
    backward: dict[str, Statements]


def fold_constants(expr):
    """Fold symbol-free factors and terms (2/sqrt(pi)) into one literal, so the kernel
    does not recompute constants and the printed code stays short."""
    if not expr.args:
        return expr
    if isinstance(expr, sympy.Expr) and expr.is_number and not isinstance(expr, sympy.Number):
        value = complex(expr.evalf(20))
        if value.imag == 0 and fn.literal_ok(value.real):
            return sympy.Float(value.real)
    args = [fold_constants(a) for a in expr.args]
    if isinstance(expr, (sympy.Mul, sympy.Add)):
        const = [a for a in args if isinstance(a, sympy.Number)]
        rest = [a for a in args if not isinstance(a, sympy.Number)]
        if len(const) > 1:
            folded = sympy.Float(float(expr.func(*const)))
            return expr.func(folded, *rest)
    return expr.func(*args) if args != list(expr.args) else expr


def _ctype_of(expr, ctype):
    return "bool" if isinstance(expr, sympy.logic.boolalg.Boolean) else ctype


def print_program(program: Program, ctype: str, scale: str | None = None) -> Statements:
    """`scale` multiplies every result (the backward's `grad * (d out / d x)`)."""
    p = CPrinter(ctype)

    def result(e):
        e = fold_constants(e)
        if scale is None:
            return p.doprint(e)
        return f"{scale} * {p.parenthesize(e, PRECEDENCE['Mul'])}"

    return Statements(
        temps=tuple((_ctype_of(e, ctype), s.name, p.doprint(fold_constants(e))) for s, e in program.temps),
        results=tuple((n, result(e)) for n, e in program.results),
    )


def print_op(spec: OpSpec) -> PrintedOp:
    return PrintedOp(
        forward={t: print_program(spec.forward_program, t) for t in COMPUTE_TYPES},
        backward={t: print_program(spec.backward_program, t, scale="dout") for t in COMPUTE_TYPES},
    )


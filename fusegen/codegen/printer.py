"""The only place that knows C spellings.

`CPrinter` prints functions.py's nodes for one compute type ("float" or "double"), one
eager PyTorch operation each, as that operation computes its element: `expf` vs `exp`,
`2.0f` vs `2.0`, true division as `/`, torch.pow's special exponents (`x*x`, `sqrtf`,
`1.0f/x`, ...), NaN-propagating maximum/minimum, clamp with std::max/std::min's ties. C's
left-to-right evaluation of `a + b + c` and `a*b*c` is the order eager uses, so operands
are parenthesised only where the tree nests the other way. The helpers it calls
(`fusegen::maximum`, ...) live in templates/runtime/fusegen-math.h.

In approx mode (float only: a row op's fp16 and bf16 CUDA kernels, its `approx::`
functions) an exp or a true division of values that vary along the row is fusegen-math.h's
approximate one, `fusegen::approx_exp(x)` or `fusegen::approx_div(a, b)`: those run once an
element. One of the row's values alone (RMSNorm's `1.0f/sqrtf(row[0] + in_eps)`) stays
exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sympy.codegen.ast import float32, float64, real
from sympy.printing.c import C99CodePrinter

import sympy

from fusegen.ir import dag
from fusegen.ir import names
from fusegen.ir import primitives as fn
from fusegen.ir import rows
from fusegen.ir.notation import _Memo
from fusegen.errors import SpecError
from fusegen.ir.spec import OpSpec, Program, straight_line

COMPUTE_TYPES = {"float": float32, "double": float64}
# A row op's printings are keyed by compute type, and by APPROX for float in approx mode.
APPROX = "approx"
LITERAL_SUFFIX = {"float": "f", "double": ""}

# C precedence levels (higher binds tighter).
_ATOM, _UNARY, _MUL, _ADD, _REL, _EQ, _AND, _OR = 100, 90, 50, 40, 30, 25, 15, 10

_INFIX = {fn.Plus: ("+", _ADD), fn.Minus: ("-", _ADD), fn.Times: ("*", _MUL), fn.Divide: ("/", _MUL),
          fn.Less: ("<", _REL), fn.LessEqual: ("<=", _REL), fn.Greater: (">", _REL),
          fn.GreaterEqual: (">=", _REL), fn.Equal: ("==", _EQ), fn.NotEqual: ("!=", _EQ)}

# Each primitive's C spelling (primitives.PRIMITIVES): a C math function of the same name
# (`expf` in float), or a helper of templates/runtime/fusegen-math.h.
_MATH = {p.node: p.c for p in fn.PRIMITIVES if p.c is not None and not p.c.startswith("fusegen::")}
_HELPERS = {p.node: p.c.removeprefix("fusegen::") for p in fn.PRIMITIVES
            if p.c is not None and p.c.startswith("fusegen::")}


class CPrinter(_Memo, C99CodePrinter):
    """functions.py's nodes -> C for one compute type."""

    def __init__(self, compute_type: str, approx: bool = False, uniform=()):
        """`uniform`: in approx mode, the names of the symbols that are the same along a
        row (row values, scalars); print_program adds the temps computed from them."""
        super().__init__({"type_aliases": {real: COMPUTE_TYPES[compute_type]}})
        if approx and compute_type != "float":
            raise ValueError("approx mode prints float only")
        self.ctype = compute_type
        self.suffix = LITERAL_SUFFIX[compute_type]
        self.approx = approx
        self.uniform = set(uniform)
        self._varies: dict = {}  # node -> whether it reads a symbol outside uniform

    def doprint(self, expr, *args, **kwargs):
        if self.approx:
            for node in dag.postorder([expr]):
                if node not in self._varies:
                    self._varies[node] = (node.name not in self.uniform if isinstance(node, sympy.Symbol)
                                          else any(self._varies[a] for a in node.args))
        return super().doprint(expr, *args, **kwargs)

    def varies(self, expr) -> bool:
        """Whether `expr` (printed) reads a value that varies along the row."""
        return self._varies.get(expr, True)

    def _approximates(self, expr) -> bool:
        return self.approx and self.varies(expr)

    def _handle_UnevaluatedExpr(self, expr):
        # sympy's pass replaces re(...) around UnevaluatedExpr, which fusegen's trees never
        # hold; it walks the tree recursively (every path), so it is skipped.
        return expr

    @property
    def _fsuffix(self):
        return "f" if self.ctype == "float" else ""

    # -- literals --------------------------------------------------------------
    def literal(self, value: float) -> str:
        if math.isnan(value):
            return "NAN"
        if math.isinf(value):
            return "INFINITY" if value > 0 else "-INFINITY"
        text = repr(float(value))
        if "e" not in text and "." not in text:
            text += ".0"
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

    def _print_Infinity(self, expr):
        return "INFINITY"

    def _print_NegativeInfinity(self, expr):
        return "-INFINITY"

    def _print_NaN(self, expr):
        return "NAN"

    # -- structure ---------------------------------------------------------------
    def precedence_of(self, expr) -> int:
        t = type(expr)
        if self._divides(expr) and self._approximates(expr):
            return _ATOM  # a call: fusegen::approx_div(a, b)
        if t in _INFIX:
            return _INFIX[t][1]
        if t is fn.Negative or (fn.is_number(expr) and expr.is_extended_negative):
            return _UNARY
        if t is fn.Reciprocal or t is fn.Rsqrt:
            return _MUL
        if t is fn.Power and fn.is_number(expr.args[1]) and expr.args[1] in (2, 3, -2, -1, -0.5):
            return _MUL
        if t is fn.LogicalAnd:
            return _AND
        if t is fn.LogicalOr:
            return _OR
        return _ATOM

    def operand(self, expr, level: int, right: bool = False) -> str:
        """`expr` as an operand of an operator of precedence `level`. A right operand of the
        same level needs parentheses (C groups a - b - c as (a - b) - c); so does a negative
        one, and a product that stands for one operation (x*x, 1.0f/x), for the reader."""
        p = self.precedence_of(expr)
        text = self._print(expr)
        if p < level or (right and p == level) or (right and p == _UNARY):
            return f"({text})"
        if p == _MUL and type(expr) in (fn.Reciprocal, fn.Rsqrt, fn.Power) and level >= _MUL:
            return f"({text})"
        return text

    def _infix(self, expr):
        op, level = _INFIX[type(expr)]
        left, right = expr.args
        joiner = op if level == _MUL else f" {op} "
        return f"{self.operand(left, level)}{joiner}{self.operand(right, level, right=True)}"

    _print_Plus = _print_Minus = _print_Times = _infix

    def _divides(self, expr) -> bool:
        """Whether `expr` prints as a true division (`a/b`, `1.0f/x`, `1.0f/sqrtf(x)`)."""
        t = type(expr)
        if t in (fn.Divide, fn.Reciprocal, fn.Rsqrt):
            return True
        return t is fn.Power and fn.is_number(expr.args[1]) and expr.args[1] in (-2, -1, -0.5)

    def _quotient(self, expr, numerator: str, denominator: str, operand: str | None = None) -> str:
        """`expr` as numerator / denominator; `operand`: the denominator as the right operand
        of `/` (parenthesised where it must be), if not the same."""
        if self._approximates(expr):
            return f"fusegen::approx_div({numerator}, {denominator})"
        return f"{numerator}/{operand or denominator}"

    def _over(self, expr, numerator: str, denominator) -> str:
        """`expr` as numerator / the node `denominator`."""
        return self._quotient(expr, numerator, self._print(denominator),
                              self.operand(denominator, _MUL, right=True))

    def _print_Divide(self, expr):
        if not self._approximates(expr):
            return self._infix(expr)
        a, b = expr.args
        return self._over(expr, self._print(a), b)
    _print_Less = _print_LessEqual = _print_Greater = _print_GreaterEqual = _infix
    _print_Equal = _print_NotEqual = _infix

    def _print_Negative(self, expr):
        (x,) = expr.args
        inner = self._print(x)
        if self.precedence_of(x) <= _UNARY:
            return f"-({inner})"
        return f"-{inner}"

    def _print_LogicalAnd(self, expr):
        return " && ".join(f"({self._print(a)})" for a in expr.args)

    def _print_LogicalOr(self, expr):
        return " || ".join(f"({self._print(a)})" for a in expr.args)

    def _print_Where(self, expr):
        c, a, b = expr.args
        return f"({self._print(c)} ? {self._print(a)} : {self._print(b)})"

    # -- operations ----------------------------------------------------------------
    def _call(self, name, *args):
        return f"{name}({', '.join(self._print(a) for a in args)})"

    def _print_Node(self, expr):
        t = type(expr)
        if t is fn.Exp and self._approximates(expr):
            return self._call("fusegen::approx_exp", *expr.args)
        if t in _MATH:
            return self._call(_MATH[t] + self._fsuffix, *expr.args)
        if t in _HELPERS:
            return self._call("fusegen::" + _HELPERS[t], *expr.args)
        raise ValueError(f"fusegen's C printer has no spelling for {t.__name__}")

    def _print_Function(self, expr):
        if isinstance(expr, fn.Node):
            return self._print_Node(expr)
        raise ValueError(f"fusegen's C printer has no spelling for {type(expr).__name__}")


    def _print_Detach(self, expr):                        # the value itself
        return f"({self._print(expr.args[0])})"

    def _print_Reciprocal(self, expr):                    # torch.reciprocal: 1 / x
        return self._over(expr, self.literal(1), expr.args[0])

    def _print_Rsqrt(self, expr):                         # torch.rsqrt: 1 / sqrt(x)
        return self._quotient(expr, self.literal(1), self._call("sqrt" + self._fsuffix, expr.args[0]))

    def _print_Power(self, expr):
        """torch.pow. A number exponent follows pow_tensor_scalar: 2, 3 and -2 multiply,
        0.5 is sqrt, -0.5 rsqrt, -1 reciprocal, others std::pow (0 and 1 never get here)."""
        base, exp = expr.args
        if fn.is_number(exp) and exp.is_finite:
            e = float(exp)
            if e in (2, 3, -2):
                b = self.operand(base, _MUL, right=True)
                product = "*".join([b] * abs(int(e)))
                if e > 0:
                    return product
                return self._quotient(expr, self.literal(1), product, f"({product})")
            if e == 0.5:
                return self._call("sqrt" + self._fsuffix, base)
            if e == -0.5:
                return self._quotient(expr, self.literal(1), self._call("sqrt" + self._fsuffix, base))
            if e == -1:
                return self._over(expr, self.literal(1), base)
        return self._call("pow" + self._fsuffix, base, exp)

    def _print_Clamp(self, expr):
        """torch.clamp. Number bounds: std::min(std::max(x, lo), hi), whose ties keep x;
        tensor bounds: NaN-propagating maximum/minimum, as clamp.Tensor computes."""
        x, lo, hi = expr.args
        numbers = fn.clamp_bounds_are_numbers(lo, hi)
        low, high = ("clamp_min", "clamp_max") if numbers else ("maximum", "minimum")
        out = self._print(x)
        if fn.has_bound(lo):
            out = f"fusegen::{low}({out}, {self._print(lo)})"
        if fn.has_bound(hi):
            out = f"fusegen::{high}({out}, {self._print(hi)})"
        return out


def _print_reduction(self, expr):
    raise SpecError(f"internal: {type(expr).__name__} reached the C printer; a row op's reductions are "
                    "printed by print_rows (ir/rows.py schedules them)")


for _cls in fn.REDUCTIONS:
    setattr(CPrinter, f"_print_{_cls.__name__}", _print_reduction)


# sympy's C printer has its own `_print_Exp`, `_print_Sqrt`, ... for classes of those names:
# route every one of our calls to _print_Node instead.
for _cls in list(_MATH) + list(_HELPERS):
    setattr(CPrinter, f"_print_{_cls.__name__}", CPrinter._print_Node)


@dataclass(frozen=True)
class Statements:
    """A program printed for one compute type: `const T t0 = ...;` lines and results.

    temps are (C type, name, code): a comparison shared by cse is a `bool`."""

    temps: tuple[tuple[str, str, str], ...]
    results: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class PrintedPass:
    """One pass of a row program over a row, printed for one compute type (ir/rows.py):
    what each element adds to the accumulators [begin, end), their initial values, how two
    partial values combine, and the row values they finish as. `params`: the C names the
    element function reads, in order (`row`: the row values of earlier passes)."""

    begin: int
    end: int
    params: tuple[str, ...]
    element: Statements          # results: ("v[k]", code)
    init: tuple[tuple[str, str], ...]     # ("acc[k]", code)
    combine: tuple[tuple[str, str], ...]  # ("acc[k]", code in acc[k] and other[k])
    finish: tuple[tuple[str, str], ...]   # ("row[k]", code in acc[k], n, row[j] and scalars)
    finish_reads_n: bool
    finish_params: tuple[str, ...] = ()   # the scalars the finish reads, in order


@dataclass(frozen=True)
class PrintedRows:
    """A row program printed for one compute type: its passes, then the outputs of one
    element (`params` read, as PrintedPass's)."""

    passes: tuple[PrintedPass, ...]
    params: tuple[str, ...]
    results: Statements


@dataclass(frozen=True)
class PrintedOp:
    """C strings for every program of an op, per compute type (a row op: rows)."""

    forward: dict[str, Statements]
    backward: dict[str, Statements]
    forward_rows: dict[str, PrintedRows] | None = None
    backward_rows: dict[str, PrintedRows] | None = None
    saved_backward_rows: dict[str, PrintedRows] | None = None  # reading the forward's row values


def _ctype_of(expr, ctype):
    return "bool" if fn.is_condition(expr) else ctype


def print_program(program: Program, ctype: str, approx: bool = False, uniform=()) -> Statements:
    """`approx`, `uniform`: CPrinter's (a temp computed from uniform values alone is one)."""
    p = CPrinter(ctype, approx, uniform)
    temps = []
    for s, e in program.temps:
        temps.append((_ctype_of(e, ctype), s.name, p.doprint(e)))
        if approx and not p.varies(e):
            p.uniform.add(s.name)
    return Statements(temps=tuple(temps), results=tuple((n, p.doprint(e)) for n, e in program.results))


def print_op(spec: OpSpec) -> PrintedOp:
    """`spec` with its user names already C names (api._with_c_names)."""
    if spec.forward_rows is not None:
        scalars = [names.value(s) for s in spec.scalars]
        forward = [names.value(x) for x in spec.inputs] + scalars
        tensors = [d.name for d in spec.douts] + [names.value(x) for x in spec.backward_inputs]
        backward = tensors + scalars
        saved = tensors + saved_row_names(spec) + scalars
        uniform = scalars + saved_row_names(spec)  # the same along a row (and the row values)

        def per_type(program, order):
            if program is None:
                return None
            return {**{t: print_rows(program, t, order) for t in COMPUTE_TYPES},
                    APPROX: print_rows(program, "float", order, approx=uniform)}

        return PrintedOp(forward={}, backward={}, forward_rows=per_type(spec.forward_rows, forward),
                         backward_rows=per_type(spec.backward_rows, backward),
                         saved_backward_rows=per_type(spec.saved_backward_rows, saved))
    return PrintedOp(
        forward={t: print_program(spec.forward_program, t) for t in COMPUTE_TYPES},
        backward={t: print_program(spec.backward_program, t) for t in COMPUTE_TYPES},
    )


def saved_row_names(spec: OpSpec) -> list[str]:
    """The C names of the row values a row op's forward saves for its backward."""
    return [rows.saved_row_symbol(k).name for k in range(len(spec.saved_rows))]


_IDENTITY = {rows.SUM: sympy.Integer(0), rows.MAX: -sympy.oo, rows.MIN: sympy.oo}
# How two partial values of an accumulator combine (fusegen-math.h): a sum never contracted
# into a multiply-add, so that a row value has the same bits in every kernel.
_COMBINE = {rows.SUM: "fusegen::row_add", rows.MAX: "fusegen::maximum", rows.MIN: "fusegen::minimum"}


def _slot(name: str, k: int) -> sympy.Symbol:
    return sympy.Symbol(f"{name}[{k}]")


def _params(exprs, order: list[str]) -> tuple[str, ...]:
    """The C names `exprs` read, in `order`, then `col` when they read the element's index
    along its row, then `row` when they read a row value."""
    used = dag.free_symbols(list(exprs))
    names_used = {x.name for x in used}
    out = [n for n in order if n in names_used]
    if fn.COLUMN in used:
        out.append(fn.COLUMN.name)
    if any(rows.is_row_symbol(x) for x in used):
        out.append("row")
    return tuple(out)


def print_rows(program, ctype: str, order: list[str], approx=None) -> PrintedRows:
    """A scheduled row program (ir/rows.RowProgram, user names already C names) in C;
    `order`: the C names it may read, in the order its functions take them. `approx`: None,
    or the C names that are the same along a row (scalars, saved row values) for the
    functions of an element in CPrinter's approx mode (a pass's finish, once a row, stays
    exact)."""
    slots = {rows.row_symbol(k): _slot("row", k) for k in range(len(program.accumulators))}
    p = CPrinter(ctype)
    exact = approx is None
    uniform = () if exact else [*approx, *(x.name for x in slots.values())]
    passes = []
    for level in range(program.levels):
        ks = program.level_accumulators(level)
        elements = [program.accumulators[k].element for k in ks]
        element = _cse_program([(f"v[{k}]", e) for k, e in zip(ks, elements)], slots)
        finishes = []
        for k in ks:
            a = program.accumulators[k]
            (f,) = dag.substitute([a.finish], {rows.ACC: _slot("acc", k), **slots})
            finishes.append((f"row[{k}]", p.doprint(f)))
        finish_free = dag.free_symbols([program.accumulators[k].finish for k in ks])  # n, scalars
        finish_names = {x.name for x in finish_free}
        passes.append(PrintedPass(
            begin=ks[0], end=ks[-1] + 1, params=_params(elements, order),
            element=print_program(element, ctype, not exact, uniform),
            init=tuple((f"acc[{k}]", p.doprint(_IDENTITY[program.accumulators[k].kind])) for k in ks),
            combine=tuple((f"acc[{k}]", f"{_COMBINE[program.accumulators[k].kind]}(acc[{k}], other[{k}])")
                          for k in ks),
            finish=tuple(finishes),
            finish_reads_n=rows.ROW_LENGTH in finish_free,
            finish_params=tuple(n for n in order if n in finish_names),
        ))
    results = _cse_program(list(program.results), slots)
    return PrintedRows(tuple(passes), _params([e for _, e in program.results], order),
                       print_program(results, ctype, not exact, uniform))


def _cse_program(results, slots) -> Program:
    """Straight-line code for `results` (name, expr) with one cse, row values as row[k]."""
    exprs = dag.substitute([e for _, e in results], slots)
    return straight_line([(n, e) for (n, _), e in zip(results, exprs)])


def print_step(spec) -> tuple[dict[str, Statements], list[tuple[str, str]]]:
    """A step op's program per compute type, and its derived scalars in double (ir/step.py)."""
    from fusegen.ir import names

    user = spec.inputs + spec.scalars
    program = names.for_c(spec.program, user)
    derived = names.for_c(Program(temps=(), results=tuple((s.name, e) for s, e in spec.derived)), user)
    return ({t: print_program(program, t) for t in COMPUTE_TYPES},
            list(print_program(derived, "double").results))

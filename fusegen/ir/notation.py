"""sympy -> the expression language users write (where, sigmoid, maximum), for headers,
spec.json and the CLI. Not C: that is printer.py's job."""

from __future__ import annotations

import sympy
from sympy.printing.str import StrPrinter

from fusegen.ir import dag
from fusegen.ir import names
from fusegen.ir import primitives as fn

# Longer than this written out (nodes, each path counted), an expression is described, not
# printed: a graph of 20 shared nodes can be thousands written out (a @fused body of ten
# lines `y = y*y + 1`), and the code, which shares them, is where to read it.
MAX_TEXT_NODES = 10_000

# Python precedence levels (higher binds tighter; `&` and `|` bind tighter than `<`).
_ATOM, _POW, _UNARY, _MUL, _ADD, _AND, _OR, _CMP = 100, 80, 70, 50, 40, 36, 34, 30

_INFIX = {fn.Plus: _ADD, fn.Minus: _ADD, fn.Times: _MUL, fn.Divide: _MUL,
          fn.Less: _CMP, fn.LessEqual: _CMP, fn.Greater: _CMP, fn.GreaterEqual: _CMP,
          fn.Equal: _CMP, fn.NotEqual: _CMP, fn.LogicalAnd: _AND, fn.LogicalOr: _OR}


def _level(expr) -> int:
    t = type(expr)
    if t in _INFIX:
        return _INFIX[t]
    if t is fn.Negative or (fn.is_number(expr) and expr.is_extended_negative):
        return _UNARY
    if t is fn.Power:
        return _POW
    if t is fn.Reciprocal:
        return _MUL
    return _ATOM


class TextPrinter(StrPrinter):
    def operand(self, expr, level, right=False):
        p = _level(expr)
        text = self._print(expr)
        return f"({text})" if p < level or (right and p <= level) else text

    def _infix(self, expr):
        level = _INFIX[type(expr)]
        left, right = expr.args
        op = type(expr).user_name
        joiner = op if level == _MUL else f" {op} "
        return f"{self.operand(left, level)}{joiner}{self.operand(right, level, right=True)}"

    _print_Plus = _print_Minus = _print_Times = _print_Divide = _infix
    _print_Less = _print_LessEqual = _print_Greater = _print_GreaterEqual = _infix
    _print_Equal = _print_NotEqual = _print_LogicalAnd = _print_LogicalOr = _infix

    def _print_Negative(self, expr):
        return f"-{self.operand(expr.args[0], _UNARY)}"

    def _print_Reciprocal(self, expr):
        return f"1/{self.operand(expr.args[0], _MUL, right=True)}"

    def _print_Power(self, expr):
        base, exp = expr.args
        return f"{self.operand(base, _POW, right=True)}**{self.operand(exp, _POW, right=True)}"

    def _print_Clamp(self, expr):
        x, lo, hi = expr.args
        parts = [self._print(x)]
        parts += [f"min={self._print(lo)}"] if fn.has_bound(lo) else []
        parts += [f"max={self._print(hi)}"] if fn.has_bound(hi) else []
        return f"clamp({', '.join(parts)})"

    def _print_Function(self, expr):
        if fn.is_reduction(expr):  # torch's call, which the parser reads back
            return f"torch.{type(expr).user_name}({self._print(expr.args[0])}, -1, keepdim=True)"
        name = type(expr).user_name if isinstance(expr, fn.Node) else expr.func.__name__
        return f"{name}({', '.join(self._print(a) for a in expr.args)})"

    _print_Abs = _print_Function

    def _print_Float(self, expr):
        return repr(float(expr))

    def _print_Symbol(self, expr):
        if fn.is_dout(expr):  # dout: grad; an output k's of several: grad<k>
            return "grad" + expr.name[len(names.DOUT):]
        return expr.name


class _Memo:
    """A printer that prints children before parents, each distinct node once: `_print` of
    an argument is then a lookup, so no call nests deeper than one node (no recursion
    limit at any depth) and a shared node is printed once."""

    def doprint(self, expr, *args, **kwargs):
        self._memo = {}
        for node in dag.postorder([expr]):
            self._memo[node] = self._print(node)
        return super().doprint(expr, *args, **kwargs)

    def _print(self, expr, **kwargs):
        memo = getattr(self, "_memo", None)
        if memo is not None and not kwargs and isinstance(expr, sympy.Basic):
            hit = memo.get(expr)
            if hit is not None:
                return hit
        return super()._print(expr, **kwargs)


class _Text(_Memo, TextPrinter):
    pass


def text(expr) -> str:
    if dag.written_size(expr, MAX_TEXT_NODES) > MAX_TEXT_NODES:
        return (f"<more than {MAX_TEXT_NODES} operations written out, fewer shared: "
                "read the code, which shares them>")
    return _Text({"order": "none"}).doprint(expr)

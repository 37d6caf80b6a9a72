"""sympy -> the expression language users write (where, sigmoid, maximum), for headers,
spec.json and the CLI. Not C: that is printer.py's job."""

from __future__ import annotations

import sympy
from sympy.printing.str import StrPrinter

# sympy class name -> the name a user writes.
_FUNCTION_NAMES = {"Sigmoid": "sigmoid", "Sign": "sign", "Clamp": "clamp", "Power": "pow",
                   "Max": "maximum", "Min": "minimum"}


class TextPrinter(StrPrinter):
    def _print_Piecewise(self, expr):
        *pieces, (last_value, _) = expr.args
        out = self._print(last_value)
        for value, cond in reversed(pieces):
            out = f"where({self._print(cond)}, {self._print(value)}, {out})"
        return out

    def _print_Function(self, expr):
        name = _FUNCTION_NAMES.get(type(expr).__name__, expr.func.__name__)
        return f"{name}({', '.join(self._print(a) for a in expr.args)})"

    _print_Max = _print_Function
    _print_Min = _print_Function

    def _print_And(self, expr):
        return " & ".join(f"({self._print(a)})" for a in sorted(expr.args, key=sympy.default_sort_key))

    def _print_Or(self, expr):
        return " | ".join(f"({self._print(a)})" for a in sorted(expr.args, key=sympy.default_sort_key))


def text(expr) -> str:
    return TextPrinter({"order": "lex"}).doprint(expr)

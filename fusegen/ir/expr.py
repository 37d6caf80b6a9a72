"""An expression as every stage carries it: names are real sympy symbols, and `Parsed` is
the tree with its ordered names (frontend/parse.py makes it, spec.differentiate takes it)."""

from __future__ import annotations

from dataclasses import dataclass

import sympy


@dataclass(frozen=True)
class Parsed:
    """What the parser hands on: the sympy tree and the ordered names it uses."""

    text: str
    tree: sympy.Expr
    inputs: tuple[str, ...]
    scalars: tuple[str, ...]


def symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, real=True)

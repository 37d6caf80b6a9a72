"""An expression as every stage carries it: names are real sympy symbols, and `Parsed` is
the tree with its ordered names (frontend/parse.py makes it, spec.differentiate takes it)."""

from __future__ import annotations

from dataclasses import dataclass

import sympy


@dataclass(frozen=True)
class Parsed:
    """What the parser hands on: the sympy tree and the ordered names it uses."""

    text: str
    outputs: tuple[sympy.Expr, ...]  # one tree per output of the op, in order
    inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    joined: bool = False  # the two outputs are the halves of one tensor (a final torch.cat, dim -1)
    random: int = 0       # random streams drawn (rand_like, dropout): symbols rand0, rand1, ...
    probabilities: tuple[str, ...] = ()  # the scalars that are a dropout's p (checked in [0, 1])
    coarse: tuple[int, ...] = ()  # the streams only compared with a probability (dropout's):
                                  # 16 bits a draw (fusegen-random.h)

    @property
    def tree(self) -> sympy.Expr:
        """The one output's tree (an op of one output)."""
        (tree,) = self.outputs
        return tree


@dataclass(frozen=True)
class ParsedProgram:
    """What a program of updates hands on: per updated input its new value (in the inputs'
    original values), and what the aliasing rules need (ir/step.py)."""

    text: str                                   # the statements as one line, `; `-joined
    inputs: tuple[str, ...]                     # tensor arguments, in schema order
    scalars: tuple[str, ...]
    updates: tuple[tuple[str, sympy.Expr], ...]  # (updated input, its final value), input order
    reads: tuple[str, ...]                      # the inputs whose original value is read
    first_write: dict                           # updated input -> index of its first assignment
    last_read: dict                             # input -> index of the last statement reading it


def symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, real=True)

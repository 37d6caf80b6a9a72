"""The OpSpec: the one IR object that flows from the parser to the renderer.

`differentiate` turns a parsed expression into an OpSpec: sympy.diff per tensor input
(the conventions at kinks live in functions.py), then one sympy.cse over the forward
and all gradients together, so the backward reuses what the forward computes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import sympy

from . import functions as fn
from .errors import SpecError
from .notation import text
from .parse import Parsed, check_op_name, symbol

FUSEGEN_VERSION = "0.1.0"


@dataclass(frozen=True)
class Gradient:
    """d(output)/d(input) for one tensor input."""

    input: str
    expr: sympy.Expr          # the local derivative, before multiplying by grad
    passthrough: bool         # derivative is exactly 1: grad flows through, no kernel work


@dataclass(frozen=True)
class Program:
    """Straight-line code: temporaries (name, expr) then named results.

    Temporaries are renumbered t0, t1, ... per program so each kernel reads on its own."""

    temps: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    results: tuple[tuple[str, sympy.Expr], ...]


@dataclass(frozen=True)
class OpSpec:
    name: str
    text: str                              # the expression as the user wrote it
    inputs: tuple[str, ...]                # tensor inputs, in schema order
    scalars: tuple[str, ...]               # runtime float arguments, after the tensors
    forward: sympy.Expr
    gradients: tuple[Gradient, ...]        # one per tensor input, schema order
    forward_program: Program
    backward_program: Program              # computes every non-passthrough gradient
    backward_inputs: tuple[str, ...]       # tensor inputs the backward reads
    backward_scalars: tuple[str, ...]      # scalars the backward reads
    command: str                           # the CLI line that regenerates the files

    @property
    def kernel_gradients(self) -> tuple[Gradient, ...]:
        """Gradients the backward kernel computes (the rest pass grad through)."""
        return tuple(g for g in self.gradients if not g.passthrough)

    def to_json(self, content_hash: str) -> str:
        doc = {
            "name": self.name,
            "expression": self.text,
            "inputs": list(self.inputs),
            "scalars": list(self.scalars),
            "forward": text(self.forward),
            "gradients": {g.input: text(g.expr) for g in self.gradients},
            "passthrough": [g.input for g in self.gradients if g.passthrough],
            "backward_reads": list(self.backward_inputs) + list(self.backward_scalars),
            "fusegen_version": FUSEGEN_VERSION,
            "content_hash": content_hash,
        }
        return json.dumps(doc, indent=2, sort_keys=False) + "\n"

    def summary(self) -> list[str]:
        """One line per derived gradient, for the CLI and the file headers."""
        return [f"d/d{g.input} = {'grad' if g.passthrough else 'grad * (' + text(g.expr) + ')'}"
                for g in self.gradients]


def differentiate(parsed: Parsed, name: str | None = None, command: str | None = None) -> OpSpec:
    """Derive every tensor input's gradient and share subexpressions across all of them."""
    name = check_op_name(name) if name is not None else default_name(parsed)
    forward = parsed.tree
    _check_printable(name, "the expression", forward)
    gradients = []
    for inp in parsed.inputs:
        # Abs' derivative comes back as sympy's sign; ours has the zero derivative and lets
        # cse see sign(x) from abs and from the user as the same thing.
        d = sympy.diff(forward, symbol(inp)).replace(sympy.sign, fn.Sign)
        _check_printable(name, f"the gradient for '{inp}'", d)
        gradients.append(Gradient(inp, d, d == sympy.Integer(1)))
    kernel_grads = [g for g in gradients if not g.passthrough]

    # One cse over forward + backward: shared subterms (sigmoid(x) in silu) are found once,
    # then each program keeps only the temporaries its own results reach.
    temps, reduced = sympy.cse([forward] + [g.expr for g in kernel_grads],
                               symbols=sympy.numbered_symbols("cse", real=True), order="canonical")
    forward_program = _program(temps, [("out", reduced[0])])
    backward_program = _program(temps, [(f"grad_{g.input}", e) for g, e in zip(kernel_grads, reduced[1:])])

    used = set()
    for g in kernel_grads:
        used |= {s.name for s in g.expr.free_symbols}
    if command is None:
        command = default_command(parsed, name)
    return OpSpec(
        name=name,
        text=parsed.text,
        inputs=parsed.inputs,
        scalars=parsed.scalars,
        forward=forward,
        gradients=tuple(gradients),
        forward_program=forward_program,
        backward_program=backward_program,
        backward_inputs=tuple(i for i in parsed.inputs if i in used),
        backward_scalars=tuple(s for s in parsed.scalars if s in used),
        command=command,
    )


def _check_printable(name: str, what: str, expr: sympy.Expr):
    """Constants such as log(0) fold to zoo/nan in sympy, and a derivative sympy cannot
    take stays a Derivative: neither has a C spelling, so refuse before rendering."""
    bad = [a for a in sympy.preorder_traversal(expr)
           if a in (sympy.zoo, sympy.nan) or isinstance(a, (sympy.Derivative, sympy.DiracDelta, sympy.Subs))]
    if bad:
        raise SpecError(f"fusegen op '{name}': {what} contains {bad[0]}, which has no finite value in C; "
                        "expected an expression defined for real inputs")


def _program(temps, results) -> Program:
    """Keep the temporaries `results` depend on, in order, renamed t0, t1, ..."""
    needed: set[sympy.Symbol] = set()
    frontier = set().union(*(e.free_symbols for _, e in results)) if results else set()
    defs = dict(temps)
    while frontier:
        s = frontier.pop()
        if s in defs and s not in needed:
            needed.add(s)
            frontier |= defs[s].free_symbols
    kept = [(s, e) for s, e in temps if s in needed]
    rename = {s: sympy.Symbol(f"t{i}", real=True) for i, (s, _) in enumerate(kept)}
    return Program(
        temps=tuple((rename[s], e.xreplace(rename)) for s, e in kept),
        results=tuple((n, e.xreplace(rename)) for n, e in results),
    )


def default_name(parsed: Parsed) -> str:
    """Unnamed ops get a stable name from their content: fused_<8 hex>."""
    key = json.dumps([parsed.text, parsed.inputs, parsed.scalars])
    return "fused_" + hashlib.sha256(key.encode()).hexdigest()[:8]


def default_command(parsed: Parsed, name: str) -> str:
    parts = ["fusegen", json.dumps(parsed.text), "--name", name]
    if parsed.inputs:
        parts += ["--inputs", ",".join(parsed.inputs)]
    for s in parsed.scalars:
        parts += ["--scalar", s]
    return " ".join(parts)

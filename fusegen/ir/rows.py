"""Row programs: an op whose expression reduces over the last dimension, scheduled into the
passes a row kernel makes over each row.

A reduction node (primitives.REDUCTIONS) stands for a value per row that broadcasts back
over it. `schedule` turns result trees that contain them into a `RowProgram`:

- each reduction becomes one or two accumulators (`Accumulator`: sum, max or min of an
  element expression, then a `finish` that makes the row's value of it): mean is a sum
  divided by the row's length `n`; logsumexp is torch's two steps, the row's maximum
  (0 where it is infinite, as torch masks it) and then log(sum(exp(x - max))) + max;
- an accumulator's element expression reads inputs, scalars and the row values of
  accumulators before it; those it reads set its level, and one pass over the row
  computes every accumulator of a level (RMSNorm: one pass, then the outputs; softmax:
  the maximum, the sum, then the outputs);
- a sum's factors of one value per row move into its finish (sum(c * f) = c * sum(f)), so
  that it starts in the pass its other factors allow: RMSNorm's backward sums
  `dout * w * x` in the pass that sums `x * x`, and multiplies by `rsqrt(mean + eps) ** 3`
  at the end of it;
- the results read inputs, scalars and row values: the last pass writes them. A result
  that reads no element value outside a reduction is one value per row (`per_row`).

Row values are Symbols `row0`, `row1`, ... without assumptions (a user's `row0` is
real=True, so they never meet), in accumulator order; `ACC` is an accumulator's value in
its finish and `ROW_LENGTH` the row's element count.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from fusegen.errors import LimitError
from fusegen.ir import dag
from fusegen.ir import limits
from fusegen.ir import names
from fusegen.ir import primitives as fn

ACC = sympy.Symbol("acc")
ROW_LENGTH = sympy.Symbol("n")
SUM, MAX, MIN = "sum", "max", "min"


def row_symbol(k: int) -> sympy.Symbol:
    return sympy.Symbol(f"{names.ROW_PREFIX}{k}")


def is_row_symbol(s) -> bool:
    return isinstance(s, sympy.Symbol) and not s.is_real and s.name.startswith(names.ROW_PREFIX) \
        and s.name[len(names.ROW_PREFIX):].isdigit()


@dataclass(frozen=True)
class Accumulator:
    kind: str              # SUM, MAX or MIN over the row
    element: sympy.Expr    # what each element contributes, in inputs, scalars and earlier rows
    finish: sympy.Expr     # the row's value, in ACC, ROW_LENGTH and earlier rows
    level: int             # the pass that computes it (0: the first)


@dataclass(frozen=True)
class RowProgram:
    accumulators: tuple[Accumulator, ...]  # in level order; accumulator k's value is row<k>
    results: tuple[tuple[str, sympy.Expr], ...]  # (name, expr in inputs, scalars and rows)
    per_row: tuple[bool, ...]              # per result: one value per row

    @property
    def levels(self) -> int:
        return 1 + max((a.level for a in self.accumulators), default=-1)

    def level_accumulators(self, level: int) -> list[int]:
        return [k for k, a in enumerate(self.accumulators) if a.level == level]

    def substituted(self, rules: dict) -> "RowProgram":
        """The program with symbols renamed (user names to their C names)."""
        exprs = dag.substitute([a.element for a in self.accumulators] + [a.finish for a in self.accumulators]
                               + [e for _, e in self.results], rules)
        n = len(self.accumulators)
        accs = tuple(Accumulator(a.kind, e, f, a.level)
                     for a, e, f in zip(self.accumulators, exprs[:n], exprs[n:2 * n]))
        return RowProgram(accs, tuple((name, e) for (name, _), e in zip(self.results, exprs[2 * n:])),
                          self.per_row)


def is_row_value(expr, elementwise) -> bool:
    """Whether `expr` has one value per row: it holds a reduction and reads no tensor element
    (`elementwise`: the symbols of the tensor inputs) nor an incoming gradient outside one."""
    seen, stack, found = set(), [expr], False
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if fn.is_reduction(node):
            found = True
            continue
        if node in elementwise or fn.is_dout(node):
            return False
        stack.extend(node.args)
    return found


def has_reduction(exprs) -> bool:
    return any(fn.is_reduction(node) for node in dag.postorder(list(exprs)))


def _lowered(node, arg) -> list[tuple[str, object, object]]:
    """(kind, element, finish) per accumulator of one reduction; `finish` may read the
    previous accumulator's row value as PREV (logsumexp's second step)."""
    t = type(node)
    if t is fn.RowSum:
        return [(SUM, arg, ACC)]
    if t is fn.RowMean:
        return [(SUM, arg, fn.div(ACC, ROW_LENGTH))]
    if t is fn.RowMax:
        return [(MAX, arg, ACC)]
    if t is fn.RowMin:
        return [(MIN, arg, ACC)]
    # logsumexp_out: maxes.masked_fill_(maxes.abs() == inf, 0), then log(sum(exp(x - maxes))) + maxes
    shifted = fn.Where(fn.Equal(fn.Abs(ACC), sympy.oo), sympy.Integer(0), ACC)
    return [(MAX, arg, shifted), (SUM, fn.Exp(fn.sub(arg, _PREV)), fn.add(fn.Log(ACC), _PREV))]


_PREV = sympy.Symbol("prev")


def _row_factor(element, per_row):
    """(c, f) with element == c * f, c the product of its factors of one value per row
    (`per_row(e)`) through products, negations and divisions by them; c is None when there
    is none."""
    constant, rest = [], []

    def walk(e):
        t = type(e)
        if t is fn.Times:
            walk(e.args[0])
            walk(e.args[1])
        elif t is fn.Negative:
            constant.append(sympy.Integer(-1))
            walk(e.args[0])
        elif t is fn.Divide and per_row(e.args[1]):
            walk(e.args[0])
            constant.append(fn.div(sympy.Integer(1), e.args[1]))
        elif per_row(e):
            constant.append(e)
        else:
            rest.append(e)

    walk(element)
    if not any(not fn.is_number(c) for c in constant):
        return None, element
    c, f = constant[0], sympy.Integer(1)
    for e in constant[1:]:
        c = fn.mul(c, e)
    for e in rest:
        f = fn.mul(f, e)
    return c, f


def schedule(results: list[tuple[str, sympy.Expr]], scalars=(), op: str = "") -> RowProgram:
    """The passes and results of row trees (see the module's docstring); `scalars`: the
    names that are runtime scalars, not tensors; `op`: the op's name, for the limit's error."""
    scalars = set(scalars)
    exprs = [e for _, e in results]
    made: dict = {}     # reduction node -> its row symbol
    pending = []        # (kind, element, finish, level), in the order made
    level_of: dict = {}  # row symbol -> level

    def per_row(e) -> bool:  # one value per row: reads row values, scalars and numbers only
        return all(is_row_symbol(s) or s.name in scalars for s in dag.free_symbols([e]))

    for node in dag.postorder(exprs):
        if not fn.is_reduction(node) or node in made:
            continue
        (arg,) = dag.substitute([node.args[0]], made)
        lowered = _lowered(node, arg)
        if len(lowered) == 1 and lowered[0][0] == SUM:
            c, f = _row_factor(arg, per_row)
            if c is not None:
                (finish,) = dag.substitute([lowered[0][2]], {ACC: fn.mul(c, ACC)})
                lowered = [(SUM, f, finish)]
        prev = None
        for kind, element, finish in lowered:
            sym = row_symbol(len(pending))
            if prev is not None:
                (element, finish) = dag.substitute([element, finish], {_PREV: prev})
            # after the passes of the rows its elements read, and no earlier than those its
            # finish reads (finished before it in the same pass: they were made first)
            level = max([1 + level_of[s] for s in dag.free_symbols([element]) if s in level_of]
                        + [level_of[s] for s in dag.free_symbols([finish]) if s in level_of] + [0])
            pending.append((kind, element, finish, level))
            level_of[sym] = level
            prev = sym
        made[node] = prev
    if len(pending) > limits.MAX_ROW_VALUES:
        raise LimitError(f"fusegen op '{op}': its kernel would accumulate {len(pending)} values per row "
                         f"(its reductions, in the forward or a derivative), over the limit "
                         f"MAX_ROW_VALUES={limits.MAX_ROW_VALUES}; split it into several ops",
                         "MAX_ROW_VALUES", limits.MAX_ROW_VALUES)
    # Renumber by level (a stable sort), so that each pass's accumulators are adjacent.
    order = sorted(range(len(pending)), key=lambda k: pending[k][3])
    rename = {row_symbol(old): row_symbol(new) for new, old in enumerate(order)}
    accumulators = []
    for old in order:
        kind, element, finish, level = pending[old]
        element, finish = dag.substitute([element, finish], rename)
        accumulators.append(Accumulator(kind, element, finish, level))
    made = {node: rename[s] for node, s in made.items()}
    out = dag.substitute(exprs, made)
    # (a gather's index is one value per row: reading it keeps a result one per row)
    tensors = {x for x in dag.free_symbols(exprs) if x.name not in scalars} - fn.index_symbols(exprs)
    per_row = tuple(is_row_value(e, tensors) for e in exprs)
    return RowProgram(tuple(accumulators), tuple((n, e) for (n, _), e in zip(results, out)), per_row)

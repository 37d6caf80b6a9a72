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

import random
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


def saved_row_symbol(k: int) -> sympy.Symbol:
    return sympy.Symbol(f"{names.SAVED_ROW_PREFIX}{k}")


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
        """The program with symbols renamed (user names to their C names, saved row values
        renumbered)."""
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


def schedule(results: list[tuple[str, sympy.Expr]], scalars=(), op: str = "", given=None) -> RowProgram:
    """The passes and results of row trees (see the module's docstring); `scalars`: the
    names that are runtime scalars, not tensors; `op`: the op's name, for the limit's error;
    `given`: reduction node -> a symbol that holds its row value already (`saved_rows`),
    which no accumulator computes."""
    scalars = set(scalars)
    exprs = [e for _, e in results]
    made: dict = dict(given or {})  # reduction node -> its row symbol
    pending = []        # (kind, element, finish, level), in the order made
    level_of: dict = {}  # row symbol -> level

    # One value per row: reads row values (given ones too: a finish reads them as the row's
    # per-row inputs), scalars and numbers only.
    given_symbols = set((given or {}).values())

    def per_row(e) -> bool:
        return all(is_row_symbol(s) or s in given_symbols or s.name in scalars for s in dag.free_symbols([e]))

    indices = fn.index_symbols(exprs)  # (a gather's index: one value per row)
    zero = ZeroTest(indices)
    for node in dag.postorder(exprs):
        if not fn.is_reduction(node) or node in made:
            continue
        arg = node.args[0]
        if type(node) in (fn.RowSum, fn.RowMean):
            arg = zero.without_vanishing_terms(arg)
            if arg == 0:
                made[node] = sympy.Integer(0)
                continue
        (arg,) = dag.substitute([arg], made)
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
    made = {node: rename.get(s, s) for node, s in made.items()}  # (given, or 0: as they are)
    out = dag.substitute(exprs, made)
    # (a gather's index is one value per row: reading it keeps a result one per row)
    tensors = {x for x in dag.free_symbols(exprs) if x.name not in scalars} - indices
    per_row = tuple(is_row_value(e, tensors) for e in exprs)
    return RowProgram(tuple(accumulators), tuple((n, e) for (n, _), e in zip(results, out)), per_row)


def saved_rows(outputs, backward_results, recomputing: RowProgram, scalars=(), op: str = ""):
    """(the forward's reductions whose row values its backward reads, the backward's program
    reading them as the per-row values saved0, saved1, ...), or ((), None) when reading them
    saves the backward (scheduled without them: `recomputing`) no pass over the row. The
    forward writes them (one more result of one value per row each, `saved<k>`), in the
    compute type."""
    forward_nodes = {n for n in dag.postorder(list(outputs)) if fn.is_reduction(n)}
    exprs = [e for _, e in backward_results]
    shared = [n for n in dag.postorder(exprs) if fn.is_reduction(n) and n in forward_nodes]
    if not shared:
        return (), None
    program = schedule(backward_results, scalars, op, {n: saved_row_symbol(k) for k, n in enumerate(shared)})
    if program.levels >= recomputing.levels:
        return (), None
    read = dag.free_symbols([a.element for a in program.accumulators] + [a.finish for a in program.accumulators]
                            + [e for _, e in program.results])
    used = [k for k in range(len(shared)) if saved_row_symbol(k) in read]
    # (numbered by what it reads)
    program = program.substituted({saved_row_symbol(k): saved_row_symbol(i) for i, k in enumerate(used)})
    return tuple(shared[k] for k in used), program


# -- a row sum that cancels ------------------------------------------------------------------
#
# The reverse pass sends a reduction the gradient of its row value, RowSum(g) of what flows
# into it. For a shift a body does not depend on, that sum is zero: a stable softmax's
# maximum, exp(x - m) / sum(exp(x - m)), receives sum((dout / S + c) * -exp(x - m)) with
# c = -sum(dout * exp(x - m)) / S**2, which is -(A / S - A / S). Eager computes such a term
# (rounding noise) and, for amax, a count of the row's ties to split it; `ZeroTest` finds
# it zero, so the backward leaves the reduction's gradient out (as `.detach()` would), one
# pass and two row values fewer.
#
# The test is algebra on exact integers: the element expression is expanded into monomials
# (a coefficient of row values times a product of element factors); a row sum is then a
# linear combination of opaque symbols, one per product, and every other row value (a
# maximum, an exp of one) is a symbol too, so the total is a rational function of
# independent symbols; zero as such, it is zero for every input. It is evaluated with each
# symbol a random integer modulo the prime 2**61 - 1, at SAMPLES independent points (fixed
# seeds: the same decision on every run). A nonzero function whose numerator has degree d
# vanishes at a random point with probability at most d / 2**61 (Schwartz-Zippel), so a
# nonzero sum passes all SAMPLES with probability at most (d / 2**61) ** SAMPLES: about 1e-48
# for a norm's or softmax's (d < 100), and 1e-10 even at d = 2**50.
# sympy's own cancel() gives the same answers, too slowly: 33 s for a chain of four softmax
# and LayerNorm layers that this derives in under a second.

# Bounds (past one, the sum is taken as not zero): monomials of one expansion.
MAX_MONOMIALS = 64
SAMPLES = 3
_PRIME = 2**61 - 1


class _Unproven(Exception):
    pass


class _Residue:
    """An integer modulo _PRIME: the quick evaluation's numbers."""

    __slots__ = ("v",)

    def __init__(self, v: int):
        self.v = v % _PRIME

    @staticmethod
    def of(x) -> "_Residue":
        return x if isinstance(x, _Residue) else _Residue(int(x))

    def __add__(self, o):
        return _Residue(self.v + _Residue.of(o).v)

    __radd__ = __add__

    def __sub__(self, o):
        return _Residue(self.v - _Residue.of(o).v)

    def __rsub__(self, o):
        return _Residue(_Residue.of(o).v - self.v)

    def __mul__(self, o):
        return _Residue(self.v * _Residue.of(o).v)

    __rmul__ = __mul__

    def __neg__(self):
        return _Residue(-self.v)

    def __truediv__(self, o):
        d = _Residue.of(o).v
        if d == 0:
            raise _Unproven  # zero here, perhaps not in the rationals: no conclusion
        return _Residue(self.v * pow(d, -1, _PRIME))

    def __rtruediv__(self, o):
        return _Residue.of(o) / self

    def __eq__(self, o):
        return isinstance(o, (_Residue, int)) and self.v == _Residue.of(o).v

    def __hash__(self):
        return hash(self.v)


class _RowAlgebra:
    """Row values as rational functions of opaque symbols, evaluated at one random point:
    each symbol a random _Residue from `seed`. `per_row_symbols`: the free symbols that are
    one value per row (a gather's index)."""

    def __init__(self, per_row_symbols, seed: int):
        self.per_row_symbols = set(per_row_symbols)
        self._random = random.Random(seed)
        self.opaque: dict = {}
        self.zero, self.one = _Residue(0), _Residue(1)
        self.length = self._fresh()
        self._reads: dict = {}
        self._monomials: dict = {}  # node -> its expansion, or None (no conclusion)
        self._values: dict = {}

    def _fresh(self) -> _Residue:
        return _Residue(self._random.randrange(1, _PRIME))

    def reads_elements(self, e) -> bool:
        """Whether e reads an element value (any symbol but a per-row one) outside a reduction."""
        hit = self._reads.get(e)
        if hit is None:
            if fn.is_reduction(e):
                hit = False
            elif isinstance(e, sympy.Symbol):
                hit = e not in self.per_row_symbols
            else:
                hit = any(self.reads_elements(a) for a in e.args)
            self._reads[e] = hit
        return hit

    def symbol(self, key):
        if key not in self.opaque:
            self.opaque[key] = self._fresh()
        return self.opaque[key]

    def monomials(self, e) -> dict:
        """e as {product of element factors (a sorted tuple): coefficient}."""
        if e not in self._monomials:
            limits.tick()
            try:
                self._monomials[e] = self._expand(e)
            except _Unproven:
                self._monomials[e] = None
        found = self._monomials[e]
        if found is None:
            raise _Unproven
        return found

    def value(self, e):
        """A row value (e reads no element outside a reduction) as a rational function."""
        if e not in self._values:
            limits.tick()
            self._values[e] = self._value(e)
        return self._values[e]

    def _expand(self, e) -> dict:
        if not self.reads_elements(e):
            return {(): self.value(e)}
        t = type(e)
        if t is fn.Plus:
            return self._sum(self.monomials(e.args[0]), self.monomials(e.args[1]))
        if t is fn.Minus:
            return self._sum(self.monomials(e.args[0]), self._scaled(self.monomials(e.args[1]), -1))
        if t is fn.Negative:
            return self._scaled(self.monomials(e.args[0]), -1)
        if t is fn.Times:
            return self._product(self.monomials(e.args[0]), self.monomials(e.args[1]))
        if t is fn.Divide and not self.reads_elements(e.args[1]):
            return self._scaled(self.monomials(e.args[0]), self.one / self.value(e.args[1]))
        if t is fn.Divide:
            return self._product(self.monomials(e.args[0]), {(fn.Reciprocal(e.args[1]),): self.one})
        return {(e,): self.one}

    def _number(self, e):
        if not e.is_finite:
            raise _Unproven
        r = sympy.Rational(float(e)) if e.is_Float else sympy.Rational(e)  # (exact: a double's value)
        return _Residue(int(r.p)) / _Residue(int(r.q))

    def _value(self, e):
        if fn.is_number(e):
            return self._number(e)
        t = type(e)
        if t is fn.Plus:
            return self.value(e.args[0]) + self.value(e.args[1])
        if t is fn.Minus:
            return self.value(e.args[0]) - self.value(e.args[1])
        if t is fn.Negative:
            return -self.value(e.args[0])
        if t is fn.Times:
            return self.value(e.args[0]) * self.value(e.args[1])
        if t is fn.Divide:
            return self.value(e.args[0]) / self.value(e.args[1])
        if t is fn.Reciprocal:
            return self.one / self.value(e.args[0])
        if t in (fn.RowSum, fn.RowMean):
            total = self.zero
            for key, c in self.monomials(e.args[0]).items():
                total = total + c * (self.length if not key else self.symbol(key))
            return total if t is fn.RowSum else total / self.length
        return self.symbol(e)

    @staticmethod
    def _sum(a: dict, b: dict) -> dict:
        out = dict(a)
        for key, c in b.items():
            out[key] = out[key] + c if key in out else c
        return out

    @staticmethod
    def _scaled(a: dict, c) -> dict:
        return {key: c * v for key, v in a.items()}

    @staticmethod
    def _product(a: dict, b: dict) -> dict:
        if len(a) * len(b) > MAX_MONOMIALS:
            raise _Unproven
        out: dict = {}
        for ka, ca in a.items():
            for kb, cb in b.items():
                key = tuple(sorted(ka + kb, key=sympy.default_sort_key))
                out[key] = out[key] + ca * cb if key in out else ca * cb
        return out


class ZeroTest:
    """Which row sums vanish for every input (see above), for one derivation: each sample's
    evaluation remembers what it expanded across the sums it is asked about."""

    def __init__(self, per_row_symbols=()):
        self._samples = [_RowAlgebra(per_row_symbols, seed) for seed in range(SAMPLES)]

    def vanishes(self, element) -> bool:
        """Whether RowSum(element) is zero for every input; False where not found so."""
        total = fn.RowSum(element)
        try:
            return all(sample.value(total) == 0 for sample in self._samples)
        except (_Unproven, RecursionError):
            return False

    def without_vanishing_terms(self, element):
        """A sum's element with the additive terms whose row sums vanish left out (0 when
        all do): LayerNorm's backward sums `dout * w * r + c * (x - mean(x))` for the mean's
        gradient, whose second term sums to c * (sum(x) - n * mean(x)) = 0, so the sum
        needs no pass after the mean's. A sum with no such term is returned as it is, and
        the other terms keep their order."""
        try:
            terms = _terms(element)
        except RecursionError:
            return element
        kept = [(sign, t) for sign, t in terms if not self.vanishes(t)]
        if len(kept) == len(terms):
            return element
        if not kept:
            return sympy.Integer(0)
        sign, out = kept[0]
        out = fn.neg(out) if sign < 0 else out
        for sign, t in kept[1:]:
            out = fn.add(out, t) if sign > 0 else fn.sub(out, t)
        return out


def _terms(e, sign=1) -> list:
    """e as (sign, term) pairs whose signed sum it is: through Plus, Minus and Negative."""
    t = type(e)
    if t is fn.Plus:
        return _terms(e.args[0], sign) + _terms(e.args[1], sign)
    if t is fn.Minus:
        return _terms(e.args[0], sign) + _terms(e.args[1], -sign)
    if t is fn.Negative:
        return _terms(e.args[0], -sign)
    return [(sign, e)]

"""Random expressions of the language against eager PyTorch, forward and every gradient.

A fixed batch of expressions over inputs a, b, c is drawn with hypothesis, derandomized
(the same batch in every run and on every machine), from the function table the
parser uses (fusegen.ir.primitives.FUNCTIONS) and the language's operators. The whole batch
builds into one library, once per test run. Each expression is then compared in float64
with the expression as written, evaluated by eager PyTorch (fusegen.tools.reference.evaluate_text,
the `--check` oracle, which never sees fusegen's simplified sympy form), at ordinary random
inputs and at a few special values (±0, ±1, ±inf, NaN, 1e-300, 1e300, and all three inputs
equal, for ties).

Comparison (`mismatches`, tests/helpers.py, as test_special_values.py compares): NaN must
be NaN, ±inf the same inf, 0 must be 0, finite values within a tight relative tolerance;
the sign of a zero is not compared here (test_special_values.py does that).
Skipped points: where eager is nondeterministic (its vectorized and strided paths disagree
on NaN/inf/finite), and the documented difference in the README ("Semantics in brief"): in an
expression with `where`, a gradient eager makes NaN (0 * inf from the masked-out branch)
where fusegen keeps a finite value.
"""

from __future__ import annotations

import ast
import itertools
import math
import time

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from conftest import selected_params
from fusegen.api import Request, fuse_many, generate
from fusegen.ir.primitives import FUNCTIONS
from fusegen.tools.reference import evaluate_text
from helpers import forward_backward_named, mismatches, point_names

N_EXPRESSIONS = 16
MAX_DEPTH = 3
EXAMPLES_PER_SEED = 6
INPUTS = ("a", "b", "c")
RTOL = 1e-9
INF, NAN = math.inf, math.nan
SPECIAL = [0.0, -0.0, 1.0, -1.0, INF, -INF, NAN, 1e-300, 1e300]

# -- drawing expressions ------------------------------------------------------------------------

# detach is not math: the gradient it stops is zeros here and None in eager (tests/test_rows.py)
UNARY = sorted(name for name, f in FUNCTIONS.items() if f.params == ("input",) and name != "detach")
BINARY = sorted(name for name, f in FUNCTIONS.items() if len(f.params) == 2)  # maximum, minimum, pow
OPERATORS = ["+", "-", "*", "/", "**"]
COMPARISONS = ["<", "<=", ">", ">=", "==", "!="]
CONSTANTS = ["0.5", "2", "-1.5", "3", "0.25"]
CONSTANT_EXPONENTS = ["2", "3", "0.5", "-1", "-0.5", "2.5"]
assert "clamp" in FUNCTIONS and "where" in FUNCTIONS  # drawn below with their own shapes


def expressions(depth: int):
    """Expression text of nesting depth <= depth; every subexpression parenthesized.
    Functions and arithmetic come first and twice: drawn more often than the rest."""
    leaf = st.one_of(st.sampled_from(INPUTS), st.sampled_from(INPUTS), st.sampled_from(CONSTANTS))
    if depth == 0:
        return leaf
    sub = expressions(depth - 1)
    unary = st.builds("{}{}({})".format, st.sampled_from(["", "torch."]), st.sampled_from(UNARY), sub)
    arithmetic = st.builds("({} {} {})".format, sub, st.sampled_from(OPERATORS), sub)
    constant_power = st.builds("({})**{}".format, sub, st.sampled_from(CONSTANT_EXPONENTS))
    binary = st.builds("{}({}, {})".format, st.sampled_from(BINARY), sub, sub)
    return st.one_of(
        unary, arithmetic, leaf, constant_power, binary, unary, arithmetic,
        st.builds("(-{})".format, sub),
        st.builds("({} {} {})".format, sub, st.sampled_from(COMPARISONS), sub),
        st.one_of(st.builds("clamp({}, {}, {})".format, sub, sub, sub),
                  st.builds("clamp({}, min={})".format, sub, sub),
                  st.builds("clamp({}, max={})".format, sub, st.sampled_from(CONSTANTS))),
        st.one_of(st.builds("where({} {} {}, {}, {})".format, sub, st.sampled_from(COMPARISONS), sub, sub, sub),
                  st.builds("where({}, {}, {})".format, sub, sub, sub)),
    )


def size(text: str) -> int:
    """Operators and calls in the expression: a batch of trivial leaves tests nothing."""
    return sum(isinstance(n, (ast.BinOp, ast.UnaryOp, ast.Call, ast.Compare)) for n in ast.walk(ast.parse(text)))


def draw_batch(n: int) -> list[str]:
    """The first few examples hypothesis draws for seed 0, then seed 1, ...: derandomized
    (a fixed seed per run), so the batch is the same in every run. Within one run
    hypothesis mutates earlier examples, so a handful per seed keeps the batch varied."""
    batch: list[str] = []

    def keep(text):
        names = {node.id for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Name)}
        if len(batch) < n and text not in batch and size(text) >= 3 and names & set(INPUTS):
            batch.append(text)

    for k in itertools.count():
        if len(batch) >= n:
            return batch
        seed(k)(settings(database=None, max_examples=EXAMPLES_PER_SEED, phases=[Phase.generate],
                         deadline=None, suppress_health_check=list(HealthCheck))(
            given(expressions(MAX_DEPTH))(keep)))()


BATCH = draw_batch(N_EXPRESSIONS)
BUILD_SECONDS = {}
QUICK = 4  # the first QUICK expressions run by default; the whole batch is slow
INDICES = [pytest.param(i, marks=() if i < QUICK else pytest.mark.slow) for i in range(len(BATCH))]
IDS = [f"{i:02d}:{t}" for i, t in enumerate(BATCH)]


@pytest.fixture(scope="module")
def random_ops(request):
    """index -> FusedOp, or the exception fusegen raised making it; one library for the
    expressions of the tests selected in this run."""
    start = time.perf_counter()
    made = {}
    wanted = selected_params(request, "index")
    for i in wanted:
        try:
            generate(Request(BATCH[i], f"rx_{i:02d}"))
        except Exception as err:  # noqa: BLE001 - reported by that expression's test
            made[i] = err
    todo = [i for i in wanted if i not in made]
    made |= dict(zip(todo, fuse_many([Request(BATCH[i], f"rx_{i:02d}") for i in todo])))
    BUILD_SECONDS["random"] = time.perf_counter() - start
    return made


# -- inputs and comparison -----------------------------------------------------------------------

def sample(names, seed: int, n: int = 256) -> dict[str, torch.Tensor]:
    """Ordinary values (half in [0.1, 2], half standard normal), then special values: each
    input in turn through SPECIAL with the others at ordinary values, then all inputs equal."""
    g = torch.Generator().manual_seed(seed)
    values = {}
    for k in names:
        x = torch.where(torch.rand(n, generator=g) < 0.5, 0.1 + 1.9 * torch.rand(n, generator=g),
                        torch.randn(n, generator=g)).double()
        specials = [torch.full((len(SPECIAL),), 0.75, dtype=torch.float64) for _ in names]
        specials[names.index(k)] = torch.tensor(SPECIAL, dtype=torch.float64)
        values[k] = torch.cat([x, *specials, torch.tensor(SPECIAL, dtype=torch.float64)])
    return values


def op_of(random_ops, index: int):
    op = random_ops[index]
    if isinstance(op, Exception):
        pytest.fail(f"fusegen could not make {BATCH[index]!r}: {type(op).__name__}: {op}")
    return op


def compare_points(got_out, got_grads, want_out, want_grads, alt_out, alt_grads, tensors, text) -> list[str]:
    """mismatches (tests/helpers.py) of the forward and every gradient; the sign of a zero is
    not compared here, and `where`'s unchosen branch may keep a finite gradient."""
    points = point_names(tensors)
    options = dict(signed_zeros=False, unchosen_branches="where(" in text)
    problems = mismatches("forward", got_out, want_out, alt_out, points, torch.float64, RTOL, **options)
    for k in tensors:
        problems += mismatches(f"d/d{k}", got_grads[k], want_grads[k], alt_grads[k], points, torch.float64,
                               RTOL, **options)
    return problems


@pytest.mark.parametrize("index", INDICES, ids=IDS)
def test_random_expression_matches_eager(random_ops, index):
    text, op = BATCH[index], op_of(random_ops, index)
    tensors = sample(list(op.spec.inputs), seed=index)
    got_out, got_grads = forward_backward_named(op, tensors)

    def eager(**kw):
        return evaluate_text(text, kw)

    want_out, want_grads = forward_backward_named(eager, tensors)
    alt_out, alt_grads = forward_backward_named(eager, tensors, strided=True)
    problems = compare_points(got_out, got_grads, want_out, want_grads, alt_out, alt_grads, tensors, text)
    shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    assert not problems, f"{text}:\n" + "\n".join(shown)


def test_batch_is_varied():
    """The batch exercises the language, not just a few leaves: every function and operator
    family appears somewhere."""
    joined = " ".join(BATCH)
    assert len(BATCH) == N_EXPRESSIONS
    for token in ["where(", "clamp(", "maximum(", "minimum(", "**", "/", "<"]:
        assert token in joined, token
    assert sum(name + "(" in joined for name in UNARY) >= len(UNARY) // 2


def second_order(f, tensors):
    """d/dx of sum_k (k+1) * d out/d x_k (a Hessian-vector product), by autograd."""
    leaves = {k: t.clone().requires_grad_(True) for k, t in tensors.items()}
    zeros = {k: torch.zeros_like(t) for k, t in tensors.items()}
    out = f(**leaves)
    if not out.requires_grad:
        return zeros
    grads = torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out), create_graph=True,
                                allow_unused=True)
    terms = [(g * (i + 1)).sum() for i, g in enumerate(grads) if g is not None and g.requires_grad]
    if not terms:
        return zeros
    second = torch.autograd.grad(sum(terms), list(leaves.values()), allow_unused=True)
    return {k: zeros[k] if s is None else s for k, s in zip(leaves, second)}


@pytest.mark.parametrize("index", INDICES, ids=IDS)
def test_random_expression_second_order_matches_eager(random_ops, index):
    """The fused double backward (<name>_grad2_backward) against eager's, at ordinary values."""
    text, op = BATCH[index], op_of(random_ops, index)
    tensors = {k: t[:256] for k, t in sample(list(op.spec.inputs), seed=index).items()}
    got = second_order(op, tensors)
    want = second_order(lambda **kw: evaluate_text(text, kw), tensors)
    points = point_names(tensors)
    problems = []
    for k in tensors:
        problems += mismatches(f"d2/d{k}", got[k], want[k], want[k], points, torch.float64, RTOL,
                               signed_zeros=False, unchosen_branches="where(" in text)
    assert not problems, f"{text}:\n" + "\n".join(problems[:20])

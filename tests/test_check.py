"""The eager oracle of `--check`: the expression as the user wrote it.

reference.evaluate_text walks the user's text (the parser's allowlist, no eval) and calls
the torch functions the user named; check.check compares an op with it, not with fusegen's
own simplified sympy form. Nothing here builds a library: check() is driven with stand-in
ops (a callable with a `.spec`), one computing the user's form and one computing the form
sympy's algebra would give (a*0 -> 0).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fusegen.tools import check as check_mod
from fusegen.frontend.parse import parse, parse_function
from fusegen.tools.reference import TextError, evaluate_text

INF, NAN = math.inf, math.nan


def t(*values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


# (text, hand-written eager PyTorch of the same text): evaluate_text must agree exactly.
TEXTS = [
    ("a*0 + b", lambda a, b: a * 0 + b),
    ("exp(log(a)) + b", lambda a, b: torch.exp(torch.log(a)) + b),
    ("torch.maximum(a, 0) * b", lambda a, b: torch.maximum(a, torch.tensor(0.0, dtype=a.dtype)) * b),
    ("clamp(a, 0, b)", lambda a, b: torch.clamp(a, torch.zeros_like(a), b)),
    ("torch.clip(a, min=-0.5) - F.relu(b)", lambda a, b: torch.clip(a, min=-0.5) - F.relu(b)),
    ("where(a > b, a*b, a - b)", lambda a, b: torch.where(a > b, a * b, a - b)),
    ("where(a, 1.5, b)", lambda a, b: torch.where(a != 0, torch.tensor(1.5, dtype=a.dtype), b)),
    ("a*(a < b) + (b >= 0.5)", lambda a, b: a * (a < b) + (b >= 0.5).to(b.dtype)),
    ("pow(a, b) + 2**b - a**-1", lambda a, b: torch.pow(a, b) + 2 ** b - a ** -1),
    ("-a/b + math.pi*torch.special.erfc(b)", lambda a, b: -a / b + math.pi * torch.special.erfc(b)),
    ("sign(a)*abs(b) + rsqrt(b) + sigmoid(a)", lambda a, b: torch.sign(a) * torch.abs(b) + torch.rsqrt(b) + torch.sigmoid(a)),
    ("minimum(a, b)/maximum(b, a) + math.fabs(a)", lambda a, b: torch.minimum(a, b) / torch.maximum(b, a) + torch.abs(a)),
    ("expm1(a) + log1p(b) + atan(a)*tanh(b) + tan(a) - sin(b)*cos(a) + erf(a) + sqrt(b)",
     lambda a, b: torch.expm1(a) + torch.log1p(b) + torch.atan(a) * torch.tanh(b) + torch.tan(a)
     - torch.sin(b) * torch.cos(a) + torch.erf(a) + torch.sqrt(b)),
]
A = t(-1.0, -0.0, 0.0, 0.5, 2.0, INF, -INF, NAN, 3.0)
B = t(2.0, 1.0, -0.0, 0.5, -3.0, 0.25, INF, 1.0, NAN)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-for-bit as values: NaN matches NaN, the sign of zero counts (None: no gradient)."""
    if got is None or want is None:
        return got is None and want is None
    return got.dtype == want.dtype and got.shape == want.shape and bool(
        torch.all((got == want) & (torch.signbit(got) == torch.signbit(want)) | (got.isnan() & want.isnan())))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("text, eager", TEXTS, ids=[x for x, _ in TEXTS])
def test_evaluate_text_is_eager_pytorch(text, eager, dtype):
    a, b = A.to(dtype).requires_grad_(), B.to(dtype).requires_grad_()
    got = evaluate_text(text, {"a": a, "b": b})
    want = eager(a, b)
    assert same(got.detach(), want.detach()), f"{text}: {got} != {want}"
    got_grads = torch.autograd.grad(got, (a, b), torch.ones_like(got), allow_unused=True)
    want_grads = torch.autograd.grad(want, (a, b), torch.ones_like(want), allow_unused=True)
    for name, g, w in zip("ab", got_grads, want_grads):
        assert same(g, w), f"{text} d/d{name}: {g} != {w}"


def test_user_form_not_simplified_form():
    """The point of the oracle: algebra rewrites a*0 to 0 and exp(log(x)) to x; eager does not."""
    values = {"a": t(INF, NAN, 1.0), "b": t(1.0, 1.0, 1.0)}
    assert torch.isnan(evaluate_text("a*0 + b", values)).tolist() == [True, True, False]
    assert torch.isnan(evaluate_text("exp(log(x))", {"x": t(-2.0)})[0])
    assert evaluate_text("log((a - a) / -3.75)", {"a": t(1.0)}).tolist() == [-INF]


def test_scalars_and_numbers():
    x = t(1.0, -2.0)
    torch.testing.assert_close(evaluate_text("x*alpha + exp(alpha)", {"x": x, "alpha": 0.5}),
                               x * 0.5 + math.exp(0.5))
    # Constants fold in IEEE double, as fusegen folds them: 1/0 is inf, not ZeroDivisionError.
    assert evaluate_text("x + 1/0", {"x": x}).tolist() == [INF, INF]
    assert evaluate_text("x*0 + (2 < 3) + math.e", {"x": x}).tolist() == [1 + math.e] * 2
    # Literals take the inputs' dtype: where(c, 0.1, 0.2) in float64 is not rounded to float32.
    assert evaluate_text("where(x > 0, 0.1, 0.2)", {"x": x}).tolist() == [0.1, 0.2]
    assert evaluate_text("maximum(x, 0.1)", {"x": x.float()}).dtype == torch.float32


def test_fused_function_text_with_locals():
    """@fused functions keep their text as 'name = expr; ...; expr' on one line."""
    source = (
        "def gelu_tanh(x, alpha: float):\n"
        "    inner = 0.7978845608 * (x + 0.044715 * x * x * x)\n"
        "    half = 0.5 * x\n"
        "    return half * (1 + torch.tanh(inner)) * alpha\n")
    parsed = parse_function(source, ["x", "alpha"], ["alpha"])
    assert ";" in parsed.text
    x = torch.linspace(-3, 3, 13, dtype=torch.float64)
    want = 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x))) * 0.25
    torch.testing.assert_close(evaluate_text(parsed.text, {"x": x, "alpha": 0.25}), want, rtol=0, atol=0)


@pytest.mark.parametrize("text", [
    "__import__('os').system('true')", "a.real", "a[0]", "lambda: a", "a if b else a", "open(a)",
    "a < b < a", "'a'", "True * a", "a % b", "a // b", "a @ b", "~a", "import os", "a = b",
    "torch.exp", "os.exp(a)", "exp(a, b)", "exp(input=a, other=b)", "clamp()", "a; b = a", "[a]",
    "unknown_name * a", "torch.__class__",
])
def test_evaluate_text_refuses_what_the_parser_refuses(text):
    with pytest.raises(TextError):
        evaluate_text(text, {"a": t(1.0), "b": t(2.0)})


# -- check() uses the user's form ------------------------------------------------------------

class StandIn:
    """What check() needs of a FusedOp, a `.spec` (text, inputs, scalars) and a call,
    here computed in eager torch by `compute`."""

    def __init__(self, text, compute):
        parsed = parse(text)
        self.spec = SimpleNamespace(text=parsed.text, inputs=parsed.inputs, scalars=parsed.scalars)
        self.compute = compute

    def __call__(self, *args):
        return self.compute(*args)


def user_form(text):
    return StandIn(text, lambda a, b: evaluate_text(text, {"a": a, "b": b}))


# (the user's text, the same after algebra: what a simplifying fusegen would compute)
SIMPLIFIED = [
    ("a*0 + b", lambda a, b: b + torch.zeros_like(a)),
    ("exp(log(a)) * b", lambda a, b: a * b),
    ("(a - a) / a + b", lambda a, b: b + torch.zeros_like(a)),
]


ORDINARY_SAMPLES = check_mod.sample_inputs


def with_inf(op, n, device, dtype, seed=0):
    """check's own samples, the first seven replaced by special values."""
    tensors, scalars = ORDINARY_SAMPLES(op, n, device, dtype, seed)
    for x in tensors:
        x[:7] = torch.tensor([INF, -INF, NAN, 0.0, -0.0, 1.0, -1.0], dtype=dtype)
    return tensors, scalars


@pytest.mark.parametrize("text, simplified", SIMPLIFIED, ids=[x for x, _ in SIMPLIFIED])
def test_check_compares_against_the_user_form(monkeypatch, text, simplified):
    """An op computing the simplified form fails --check where the user's form differs
    (inf/NaN inputs, or x < 0 under exp(log(x))); an op computing the user's form passes."""
    monkeypatch.setattr(check_mod, "sample_inputs", with_inf)
    dtypes = (torch.float64, torch.float32)
    results = check_mod.check(user_form(text), dtypes=dtypes)
    assert all(r.ok for r in results), "\n".join(map(str, results))
    results = check_mod.check(StandIn(text, simplified), dtypes=dtypes)
    assert not next(r for r in results if r.what == "float64 forward").ok, "\n".join(map(str, results))


def test_check_passes_for_an_output_without_gradient_path():
    """`a < b` has no autograd graph in eager; every gradient is zero."""
    results = check_mod.check(user_form("a < b"), n=64, dtypes=(torch.float64,))
    assert all(r.ok for r in results), "\n".join(map(str, results))

"""The primitive table (fusegen.ir.primitives.PRIMITIVES) is the only place a function or
operator is declared: every entry has every field, every table derived from it (spec's
backward formulas, the printer's C spellings, the eager callables of the reference and the
composite, ONNX's lowering, the parser's names) has exactly its keys, and every C helper an
entry names exists in templates/runtime/fusegen-math.h. Then softplus, added as one entry and one
helper, against eager PyTorch: value and gradient in float64 across its threshold and far
into its negative tail, gradcheck, the --check oracle and the composite."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import sympy
import torch
import torch.nn.functional as F

import fusegen
from fusegen.codegen import printer
from fusegen.ir import notation
from fusegen.frontend.parse import parse, symbol
from fusegen.ir import primitives as fn
from fusegen.ir import spec
from fusegen.pytorch import composite
from fusegen.tools import check, reference

ROOT = Path(__file__).resolve().parent.parent
MATH_H = (ROOT / "templates" / "runtime" / "fusegen-math.h").read_text()
RUNTIME_H = (ROOT / "templates" / "runtime" / "fusegen-cpu.h").read_text()
NODES = {p.node for p in fn.PRIMITIVES}


# -- the single-table rule ----------------------------------------------------------------------

def test_every_node_has_one_entry():
    """One entry per node class, and every Node subclass defined is in the table."""
    assert len(NODES) == len(fn.PRIMITIVES)
    defined = {v for v in vars(fn).values() if isinstance(v, type) and issubclass(v, fn.Node) and v is not fn.Node}
    assert defined <= NODES, sorted(c.__name__ for c in defined - NODES)


@pytest.mark.parametrize("p", fn.PRIMITIVES, ids=lambda p: p.node.__name__)
def test_every_entry_has_every_field(p):
    assert issubclass(p.node, fn.Node) and p.node.user_name == p.name and p.name
    # backward: a formula for every number-valued node; a condition has none (no gradient)
    assert (p.backward is None) == p.node.boolean
    assert callable(fn.eager(p))
    assert isinstance(p.onnx, str) or callable(p.onnx) or p.onnx is fn.ONNX_FORMULA
    # C: a spelling, or the printer's own method for the node
    if p.c is None:
        assert f"_print_{p.node.__name__}" in vars(printer.CPrinter), p.node
    if p.params is not None:
        assert len(p.params) == p.node.nargs.args[0] and 0 <= p.optional <= len(p.params)
    assert p.simd is False or p.c is not None or p.node is fn.Power


def test_derived_tables_have_exactly_the_tables_keys():
    with_c = {p.node for p in fn.PRIMITIVES if p.c is not None}
    assert set(printer._MATH) | set(printer._HELPERS) == with_c
    assert not set(printer._MATH) & set(printer._HELPERS)
    assert set(spec._FORMULAS) == {p.node for p in fn.PRIMITIVES if p.backward is not None}
    assert set(composite._BINARY) | set(composite._TENSOR_FUNCTIONS) == NODES
    assert set(reference.TORCH_FUNCTIONS) == set(fn.FUNCTIONS) == {p.name for p in fn.PRIMITIVES if p.params}
    assert set(fn.ALIASES.values()) <= set(fn.FUNCTIONS) and not set(fn.ALIASES) & set(fn.FUNCTIONS)
    assert not set(fn.FUNCTIONS) & set(fn.UNSUPPORTED), "a built-in is not also 'not supported'"
    onnx = pytest.importorskip("fusegen.pytorch.onnx")
    assert set(onnx._OPERATORS) | set(onnx._DECOMPOSITIONS) | set(onnx._FORMULAS) == NODES
    assert set(onnx._FORMULAS) == {p.node for p in fn.PRIMITIVES if p.onnx is fn.ONNX_FORMULA}
    assert not set(onnx._OPERATORS) & set(onnx._DECOMPOSITIONS)


@pytest.mark.parametrize("p", [p for p in fn.PRIMITIVES if p.c and p.c.startswith("fusegen::")],
                         ids=lambda p: p.c)
def test_c_helpers_exist_in_fusegen_math_h(p):
    helper = p.c.removeprefix("fusegen::")
    # both compute types: a template, or one overload per type
    template = re.search(rf"template <typename T>\s*FUSEGEN_HD T {helper}\(", MATH_H)
    overloads = [re.search(rf"FUSEGEN_HD {t} {helper}\({t} ", MATH_H) for t in ("float", "double")]
    assert template or all(overloads), f"templates/runtime/fusegen-math.h has no {helper} for float and double"


def test_simd_flags_are_the_runtime_declarations():
    declared = set(re.findall(r"^FUSEGEN_SIMD_MATH\((\w+)\)", RUNTIME_H, re.M))
    assert declared == {p.c for p in fn.PRIMITIVES if p.simd and p.c}
    assert "float powf(float, float) noexcept __attribute__((simd" in RUNTIME_H and fn.BY_NODE[fn.Power].simd


def test_primitive_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        fn.PRIMITIVES[0].name = "plus"


# -- softplus: one entry, one helper --------------------------------------------------------------

def test_softplus_parses_prints_and_derives():
    parsed = parse("softplus(x)")
    assert notation.text(parsed.tree) == "softplus(x)"
    for prefix in ("torch.nn.functional.", "F.", ""):
        assert parse(f"{prefix}softplus(x)").tree == parsed.tree
    assert fn.unsupported_hint("softplus") is None
    c = printer.CPrinter("float").doprint(parsed.tree)
    assert c == "fusegen::softplus(x)"
    op_spec = spec.differentiate(parsed, "sp")
    (grad,) = [printer.CPrinter("double").doprint(e) for e in op_spec.backward_exprs]
    assert grad == "(x > 20.0 ? dout : dout*exp(x)/(exp(x) + 1.0))", grad


X64 = torch.tensor([-1e300, -800.0, -745.0, -100.0, -40.0, -20.0, -5.0, -1.0, -1e-300, -0.0, 0.0,
                    1e-300, 0.5, 1.0, 5.0, 19.999, 20.0, 20.000001, 21.0, 40.0, 800.0, 1e300,
                    float("inf"), float("-inf"), float("nan")], dtype=torch.float64)


@pytest.fixture(scope="module")
def softplus_ops():
    return dict(zip(["sp", "sp_mul"], fusegen.fuse_many([
        {"expr": "softplus(x)", "name": "prim_softplus"},
        {"expr": "softplus(x*y) + F.softplus(y)", "name": "prim_softplus_mul"},
    ])))


def test_softplus_value_and_gradient_match_eager_in_float64(softplus_ops):
    x = X64.clone().requires_grad_(True)
    got = softplus_ops["sp"](x)
    (dgot,) = torch.autograd.grad(got, x, torch.ones_like(got))
    xe = X64.clone().requires_grad_(True)
    want = F.softplus(xe)
    (dwant,) = torch.autograd.grad(want, xe, torch.ones_like(want))
    # atol: a subnormal against eager's 0 (its vectorized exp(-745) flushes) is rounding
    tiny = torch.finfo(torch.float64).tiny
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-15, atol=tiny, equal_nan=True)
    torch.testing.assert_close(dgot, dwant, rtol=1e-15, atol=tiny, equal_nan=True)
    # the tail keeps its digits: softplus(-100) = exp(-100), not 0; above 20 it is x
    assert got[3].item() == pytest.approx(3.720075976020836e-44, rel=1e-15)
    assert got[X64 == 21.0].item() == 21.0 and dgot[X64 == 21.0].item() == 1.0
    assert got[X64 == 1e300].item() == 1e300 and dgot[X64 == 1e300].item() == 1.0


def test_softplus_float32_matches_eager(softplus_ops):
    x = torch.linspace(-120, 40, 4001, dtype=torch.float32)
    torch.testing.assert_close(softplus_ops["sp"](x), F.softplus(x), rtol=4e-7, atol=1e-44)


def test_softplus_gradcheck(softplus_ops):
    x = torch.randn(64, dtype=torch.float64) * 8
    x = x[(x - 20).abs() > 1e-3].requires_grad_(True)  # not at the threshold's jump
    y = torch.randn(x.shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(softplus_ops["sp"], (x,))
    assert torch.autograd.gradcheck(softplus_ops["sp_mul"], (x, y))
    assert torch.autograd.gradgradcheck(softplus_ops["sp_mul"], (x, y))


def test_softplus_check_and_composite(softplus_ops):
    """--check's oracle and the composite both call F.softplus (from the table)."""
    x = X64.clone()
    torch.testing.assert_close(reference.evaluate_text("softplus(x)", {"x": x}), F.softplus(x), equal_nan=True)
    results = check.check(softplus_ops["sp_mul"], n=512, dtypes=(torch.float64, torch.float32))
    assert results and all(r.ok for r in results), "\n".join(map(str, results))
    (out,) = composite.evaluate([parse("softplus(x)").tree], {symbol("x"): x}, x.shape, torch.float64, "cpu")
    torch.testing.assert_close(out, F.softplus(x), rtol=0, atol=0, equal_nan=True)


def test_softplus_third_order_goes_through_the_composite(softplus_ops):
    x = (torch.randn(16, dtype=torch.float64) * 3).requires_grad_(True)
    y = torch.randn(16, dtype=torch.float64, requires_grad=True)

    def third(f):
        out = f(x, y).sum()
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x, create_graph=True)
        return torch.autograd.grad(gg.sum(), x)[0]

    torch.testing.assert_close(third(softplus_ops["sp_mul"]), third(lambda a, b: F.softplus(a * b) + F.softplus(b)))


def test_every_node_is_a_module_attribute():
    for p in fn.PRIMITIVES:
        assert getattr(fn, p.node.__name__) is p.node

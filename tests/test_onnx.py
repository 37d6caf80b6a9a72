"""ONNX export (fusegen/pytorch/onnx.py): torch.onnx.export(..., dynamo=True) of models that
call fused ops gives graphs of standard ONNX operators only, and onnxruntime's results
match eager PyTorch for every op of the test corpus (the seeds included), at random values
and at the special values (0 and -0 at the kinks of relu/abs/sign, ties, inf, -inf, NaN),
in float32 and float64; in fp16/bf16 they match the fused op, which computes in float and
rounds once (eager rounds after every operation). One model calls every corpus op, so each
dtype costs one export (1.7-3.6 s on the 2-core CI machine; a one-op model takes 0.4-1.5 s).
Only the forward is exported: ONNX is for inference."""

from __future__ import annotations

import itertools
import math
import re

import onnx
import onnxruntime
import pytest
import torch

import fusegen
from corpus import CORPUS
from fusegen.errors import FusegenError
from fusegen.ir.primitives import PRIMITIVES, eager

# torch.onnx.export's own pytree handling of list arguments warns (torch 2.13); not ours.
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated:FutureWarning")

SPECIALS = (0.0, -0.0, 1.0, -1.0, 0.5, -2.5, math.inf, -math.inf, math.nan)


@pytest.fixture(scope="module")
def formula_ops():
    """Ops for the formulas the export writes itself (no ONNX operator computes them as
    torch does), and one whose forward is its input; `@fused`, so `.eager` is the oracle.
    Defined together, they build together (one library) when the test first asks."""

    @fusegen.fused
    def onnx_expm1(x):
        return torch.expm1(x)

    @fusegen.fused
    def onnx_log1p(x):
        return torch.log1p(x)

    @fusegen.fused
    def onnx_erfc(x):
        return torch.erfc(x)

    @fusegen.fused
    def onnx_sigmoid(x):
        return torch.sigmoid(x)

    @fusegen.fused
    def onnx_pow(x):
        return x**2 + x**3 - x**-2 + x**0.5 - x**-0.5 + x**-1 + 2**x

    @fusegen.fused
    def onnx_identity(x):
        return x

    return [onnx_expm1, onnx_log1p, onnx_erfc, onnx_sigmoid, onnx_pow, onnx_identity]


class Calls(torch.nn.Module):
    """Calls each op on its tensors (and scalars), as the model's user would: through the
    FusedOp, or through torch.ops.fusegen.<name>; `dtype`: the inputs are cast to it first
    (onnxruntime's Python API takes no bfloat16 arrays), and the results back to float32."""

    def __init__(self, calls, dtype=None):
        super().__init__()
        self.calls, self.dtype = calls, dtype

    def forward(self, xs: list[list[torch.Tensor]]):
        outs = []
        for (op, scalars), tensors in zip(self.calls, xs):
            if self.dtype is not None:
                tensors = [t.to(self.dtype) for t in tensors]
            out = op(*tensors, *scalars)
            outs.append(out if self.dtype is None else out.float())
        return outs


class Each(torch.nn.Module):
    """Every op on the same tensor."""

    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def forward(self, x):
        return [op(x) for op in self.ops]


def export(model, args: tuple, ops, **kwargs):
    return torch.onnx.export(model.eval(), args, dynamo=True, verbose=False,
                             custom_translation_table=fusegen.onnx_translations(*ops), **kwargs)


def check_standard(proto: onnx.ModelProto):
    """Only operators of the default ONNX domain, no functions (a fusegen op would be one)."""
    onnx.checker.check_model(proto, full_check=True)
    assert not proto.functions, [f.name for f in proto.functions]
    custom = {(n.domain, n.op_type) for n in proto.graph.node
              if n.domain not in ("", "ai.onnx") or not onnx.defs.has(n.op_type)}
    assert not custom, custom


def run(proto: onnx.ModelProto, xs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    model = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    flat = [t for tensors in xs for t in tensors]
    feeds = {i.name: t.numpy() for i, t in zip(model.get_inputs(), flat)}
    assert len(feeds) == len(flat)
    return [torch.from_numpy(o) for o in model.run(None, feeds)]


def inputs(case, dtype) -> list[torch.Tensor]:
    """Random values of the case's domains, then every combination of the special values
    across its inputs (9**k elements along the last dimension)."""
    random = case.sample(16, torch.float64, seed=3)
    grid = list(zip(*itertools.product(SPECIALS, repeat=len(random))))
    out = []
    for r, column in zip(random, grid):
        special = torch.tensor(column, dtype=torch.float64).expand(*r.shape[:-1], len(column))
        out.append(torch.cat([r, special], dim=-1).to(dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float64, marks=pytest.mark.slow)],
                         ids=["float32", "float64"])
def test_corpus_matches_eager(corpus_ops, dtype):
    cases = list(CORPUS)
    # Every other op through its FusedOp, the rest through torch.ops.fusegen.<name>.
    calls = [(corpus_ops[c.name] if i % 2 else corpus_ops[c.name].op, c.scalar_values)
             for i, c in enumerate(cases)]
    xs = [inputs(c, dtype) for c in cases]
    program = export(Calls(calls), (xs,), [corpus_ops[c.name] for c in cases])
    check_standard(program.model_proto)
    for case, got, tensors in zip(cases, run(program.model_proto, xs), xs):
        want = case.eager(*tensors, *case.scalar_values)
        assert got.dtype == want.dtype, case.name
        # onnxruntime has no double Atan/Erf: a float64 model computes them in float.
        in_float = dtype == torch.float64 and any(f in case.expr for f in ("atan", "erf"))
        tolerance = dict(rtol=4e-7, atol=4e-7) if in_float else {}
        torch.testing.assert_close(got, want, equal_nan=True, **tolerance,
                                   msg=lambda m, case=case: f"{case.name}: {m}")


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, marks=pytest.mark.slow), torch.bfloat16],
                         ids=["float16", "bfloat16"])
def test_half_types_compute_in_float(corpus_ops, dtype):
    """fp16/bf16 inputs are Cast to float, computed and Cast back once, as the kernels do:
    the results are the fused op's, give or take one rounding of a float math function
    that differs in its last bit (eager, rounding after every operation, differs more)."""
    cases = list(CORPUS)
    calls = [(corpus_ops[c.name], c.scalar_values) for c in cases]
    xs = [inputs(c, torch.float32) for c in cases]
    program = export(Calls(calls, dtype), (xs,), [corpus_ops[c.name] for c in cases])
    check_standard(program.model_proto)
    eps = torch.finfo(dtype).eps
    for case, got, tensors in zip(cases, run(program.model_proto, xs), xs):
        want = corpus_ops[case.name](*(t.to(dtype) for t in tensors), *case.scalar_values).float()
        torch.testing.assert_close(got, want, equal_nan=True, rtol=eps, atol=1e-5,
                                   msg=lambda m, case=case: f"{case.name}: {m}")


def test_promotion_and_numbers(corpus_ops):
    """Arguments of other dtypes than the result's, as the runtime promotes them: an int
    tensor, a bool mask, a 0-d float64 tensor beside float32 tensors (the result stays
    float32), a Python number through the FusedOp (a constant in the graph), and an int
    tensor beside an fp16 one (converted to fp16 first, as the runtime does, then to float)."""
    fma, gate = corpus_ops["cp_fma"], corpus_ops["cp_relu_gate"]
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 7, generator=g), torch.randn(7, generator=g)
    ints = torch.randint(-3, 4, (7,), generator=g, dtype=torch.int32)
    mask = torch.rand(2, 7, generator=g) > 0.5
    half = torch.randn(64, generator=g).half()
    odd = 2 * torch.randint(1024, 2048, (64,), generator=g, dtype=torch.int32) + 1  # no fp16 has them
    calls = [(fma.op, ()), (fma.op, ()), (fma.op, ()), (lambda a, b: fma(a, 2.5, b), ()), (gate.op, ())]
    xs = [[x, ints, y], [mask, x, y], [x, torch.tensor(0.1, dtype=torch.float64), y], [x, y], [half, odd]]
    program = export(Calls(calls), (xs,), [fma, gate])
    check_standard(program.model_proto)
    for (op, _), got, tensors in zip(calls, run(program.model_proto, xs), xs):
        want = op(*tensors)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # exact: +, * and a comparison


@pytest.mark.slow
def test_formulas_over_wide_ranges(formula_ops):
    """expm1/log1p near 0 (where exp(x)-1 and log(1+x) keep no digit), erfc far into its
    tail (where 1-erf(x) is 0), sigmoid at large |x|, torch.pow's special exponents, and a
    forward that is its input: within 2 float32 rounding errors of eager
    (atol only for erfc's denormal tail). Exported at length 8, run at 1610 (a dynamic length)."""
    tiny = torch.logspace(-30, 1, 400, dtype=torch.float64)
    x = torch.cat([tiny, -tiny, torch.linspace(-88, 88, 801, dtype=torch.float64),
                   torch.tensor(SPECIALS, dtype=torch.float64)]).float()
    program = export(Each(formula_ops), (x[:8],), formula_ops, dynamic_shapes=({0: torch.export.Dim("n")},))
    check_standard(program.model_proto)
    for f, got in zip(formula_ops, run(program.model_proto, [[x]])):
        torch.testing.assert_close(got, f.eager(x), equal_nan=True, rtol=2.5e-7,
                                   atol=1e-37 if f.__name__ == "onnx_erfc" else 0,
                                   msg=lambda m, f=f: f"{f.__name__}: {m}")


def test_onnx_translations_arguments(corpus_ops, formula_ops):
    fma = corpus_ops["cp_fma"]
    key = torch.ops.fusegen.cp_fma.default
    for given in (fma, fma.op, fma.op.default, "cp_fma"):
        assert list(fusegen.onnx_translations(given)) == [key]
    assert list(fusegen.onnx_translations(formula_ops[0])) == [torch.ops.fusegen.onnx_expm1.default]
    everything = fusegen.onnx_translations()  # every op loaded in the process
    assert key in everything and torch.ops.fusegen.onnx_identity.default in everything
    with pytest.raises(FusegenError, match="'no_such_op' was not built or loaded by fusegen"):
        fusegen.onnx_translations("no_such_op")
    with pytest.raises(FusegenError, match="expected fusegen ops"):
        fusegen.onnx_translations(torch.ops.aten.add.Tensor)


@pytest.mark.slow
def test_a_plain_export_without_the_table(formula_ops):
    """torch.onnx.export(model, args, dynamo=True) with no custom_translation_table: a FusedOp
    or @fused call exports as its expression's ATen ops (torch's own ONNX functions), and
    onnxruntime agrees with eager; with the table, the op's own translation is used. Both
    compute an fp16 op in float, as its kernels do: each graph casts fp16 to float and back
    around the math, and the two give the same values."""
    sigmoid = formula_ops[3]  # a @fused function
    fused_op = sigmoid.op     # its FusedOp

    class Plain(torch.nn.Module):
        def forward(self, x):
            return sigmoid(x) * 2 + fused_op(x)

    x = torch.linspace(-5, 5, 11)
    program = torch.onnx.export(Plain().eval(), (x,), dynamo=True, verbose=False)
    check_standard(program.model_proto)
    (got,) = run(program.model_proto, [[x]])
    torch.testing.assert_close(got, torch.sigmoid(x) * 3)

    class Half(torch.nn.Module):
        def forward(self, x):
            return fused_op(x.half()).float()

    plain = torch.onnx.export(Half().eval(), (x,), dynamo=True, verbose=False).model_proto
    table = export(Half(), (x,), [fused_op]).model_proto
    casts = [sum(n.op_type == "Cast" for n in p.graph.node) for p in (plain, table)]
    assert casts == [4, 4], casts  # the module's two, and the op's fp16 -> float -> fp16
    (a,), (b,) = run(plain, [[x]]), run(table, [[x]])
    want = torch.sigmoid(x.half().float()).half().float()  # float math, rounded to fp16 once
    torch.testing.assert_close(a, want, rtol=1e-3, atol=0)  # an fp16 ulp
    torch.testing.assert_close(b, want, rtol=1e-3, atol=0)


# Every unary function of the primitive table that no corpus op calls (the corpus test covers
# those), exported and run against its eager callable: a function added to the table is
# exported and checked here as it is.
_TABLE_UNARY = [p for p in PRIMITIVES if p.params == ("input",)
                and not any(re.search(rf"\b{p.name}\(", c.expr) for c in CORPUS)]


@pytest.mark.skipif(not _TABLE_UNARY, reason="the corpus calls every function of the table")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_table_functions_match_eager(dtype):
    ops = fusegen.fuse_many([{"expr": f"{p.name}(x)", "name": f"onnx_table_{p.name}"} for p in _TABLE_UNARY])
    x = torch.cat([torch.linspace(-60, 60, 241, dtype=torch.float64), torch.tensor(SPECIALS, dtype=torch.float64),
                   torch.tensor([19.5, 20.0, 20.5, -1e-30, 1e-30], dtype=torch.float64)]).to(dtype)
    program = export(Each(ops), (x,), ops)
    check_standard(program.model_proto)
    rtol = 1e-6 if dtype == torch.float32 else 1e-12
    for p, got in zip(_TABLE_UNARY, run(program.model_proto, [[x]])):
        torch.testing.assert_close(got, eager(p)(x), equal_nan=True, rtol=rtol, atol=1e-37,
                                   msg=lambda m, p=p: f"{p.name}: {m}")

"""Ops of several outputs: `fusegen.fuse("(e1, e2)")` and a `@fused` function returning a
tuple. One forward kernel writes every output, one backward kernel reads every output's
gradient (an undefined one counts as zero); the op is `-> (Tensor, Tensor)` to torch, and
autograd, opcheck, torch.compile, torch.export, torch.func and ONNX see it as they see one
of PyTorch's own multi-output ops. The oracle is eager PyTorch in float64."""

from __future__ import annotations

import pytest
import torch

import fusegen
from fusegen.errors import FusegenError, ParseError
from fusegen.frontend.parse import parse
from fusegen.ir import limits
from helpers import TOL

ROPE = "(x1*c - x2*s, x2*c + x1*s)"


def rope_eager(x1, c, x2, s):
    return x1 * c - x2 * s, x2 * c + x1 * s


@pytest.fixture(scope="module")
def rope():
    return fusegen.fuse(ROPE, name="test_rope", inputs="x1,c,x2,s")


def operands(dtype=torch.float64, shape=(6, 10), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(4)]


def leaves(tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


# -- the language -----------------------------------------------------------------------------

def test_a_top_level_tuple_is_the_outputs():
    parsed = parse(ROPE)
    assert len(parsed.outputs) == 2 and parsed.inputs == ("x1", "c", "x2", "s")


@pytest.mark.parametrize("text, message", [
    ("(x*2,)", "at least two"),
    ("((x, y), y)", "nested tuple"),
    ("(" + ", ".join(f"x*{k}" for k in range(limits.MAX_OUTPUTS + 1)) + ")", "at most"),
    ("x + (x, y)", "unsupported syntax: Tuple"),
])
def test_malformed_outputs_are_refused_by_name(text, message):
    with pytest.raises(ParseError, match=message):
        parse(text)


def test_schemas_name_every_output_and_dout(rope):
    assert str(rope.op.default._schema) == "fusegen::test_rope(Tensor x1, Tensor c, Tensor x2, Tensor s) -> (Tensor, Tensor)"
    backward = str(rope.backward_op.default._schema)
    assert backward.startswith("fusegen::test_rope_backward(Tensor dout0, Tensor dout1, Tensor in_x1,")
    header = rope.files["test_rope.h"]
    assert "void forward(float in_x1, float in_c, float in_x2, float in_s, float& out0" in header
    assert "float& out1) {" in header and "static constexpr int kOutputs = 2;" in header


# -- values and gradients -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forward_and_backward_match_eager(rope, dtype):
    xs = operands(dtype)
    a, b = leaves(xs), leaves(xs)
    got, want = rope(*a), rope_eager(*b)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[dtype])
    douts = operands(dtype, seed=1)[:2]
    ga = torch.autograd.grad(got, a, douts)
    gb = torch.autograd.grad(want, b, douts)
    for g, w in zip(ga, gb):
        torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_compute_in_float(rope, dtype):
    xs = operands(dtype)
    got = rope(*xs)
    want = rope_eager(*[x.double() for x in xs])
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("used", [0, 1])
def test_an_output_left_out_of_the_loss_counts_as_zero(rope, used):
    xs = operands()
    a, b = leaves(xs), leaves(xs)
    ga = torch.autograd.grad(rope(*a)[used].sum(), a)
    gb = torch.autograd.grad(rope_eager(*b)[used].sum(), b)
    for g, w in zip(ga, gb):
        torch.testing.assert_close(g, w, **TOL[torch.float64])


def test_outputs_take_the_broadcast_shape_and_promoted_dtype():
    op = fusegen.fuse("(x + y, x*2)", name="test_two_broadcast")
    x = torch.randn(3, 1, dtype=torch.float64)
    y = torch.randn(1, 4, dtype=torch.float32)
    s, d = op(x, y)
    assert s.shape == d.shape == (3, 4) and s.dtype == d.dtype == torch.float64
    torch.testing.assert_close(d, (x * 2).expand(3, 4))


def test_an_output_inside_another_gets_both_gradients():
    # h is an output and a subexpression of the other: its gradient is its own dout plus
    # what flows from the second output, as in eager.
    op = fusegen.fuse("(x + r, (x + r)*w)", name="test_nested_outputs")
    xs = operands()[:3]
    a, b = leaves(xs), leaves(xs)
    douts = operands(seed=3)[:2]
    got = torch.autograd.grad(op(*a), a, douts)
    h = b[0] + b[1]
    want = torch.autograd.grad((h, h * b[2]), b, douts)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[torch.float64])


def test_fused_function_returning_a_tuple():
    @fusegen.fused
    def rotate(x1, x2, c, s):
        cos_part = x1 * c
        return cos_part - x2 * s, x2 * c + x1 * s

    xs = operands()
    a, b = leaves(xs), leaves(xs)
    got = rotate(*a)
    want = (b[0] * b[2] - b[1] * b[3], b[1] * b[2] + b[0] * b[3])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[torch.float64])
    ga = torch.autograd.grad(sum(o.sum() for o in got), a)
    gb = torch.autograd.grad(sum(o.sum() for o in want), b)
    for g, w in zip(ga, gb):
        torch.testing.assert_close(g, w, **TOL[torch.float64])


def test_gradcheck_and_double_backward(rope):
    xs = leaves(operands(shape=(3, 4)))
    assert torch.autograd.gradcheck(rope, xs)
    assert torch.autograd.gradgradcheck(rope, xs)


def test_opcheck(rope):
    from torch.library import opcheck
    result = opcheck(rope.op.default, tuple(leaves(operands(shape=(3, 5)))))
    assert set(result.values()) == {"SUCCESS"}, result


# -- torch.func and forward mode ------------------------------------------------------------------

def test_jvp_vmap_jacobians(rope):
    from torch.func import hessian, jacfwd, jacrev, jvp, vmap
    xs = operands(shape=(5,))
    tangents = operands(shape=(5,), seed=4)
    _, got = jvp(rope, tuple(xs), tuple(tangents))
    _, want = jvp(rope_eager, tuple(xs), tuple(tangents))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[torch.float64])
    batched = vmap(rope)(*operands(shape=(3, 5)))
    for g, w in zip(batched, rope_eager(*operands(shape=(3, 5)))):
        torch.testing.assert_close(g, w, **TOL[torch.float64])
    for transform in (jacrev, jacfwd):
        got = transform(rope, argnums=(0, 3))(*xs)
        want = transform(rope_eager, argnums=(0, 3))(*xs)
        for per_out, per_out_eager in zip(got, want):
            for g, w in zip(per_out, per_out_eager):
                torch.testing.assert_close(g, w, **TOL[torch.float64])
    got = hessian(lambda *a: rope(*a)[1].sin().sum())(*xs)
    want = hessian(lambda *a: rope_eager(*a)[1].sin().sum())(*xs)
    torch.testing.assert_close(got, want, **TOL[torch.float64])


def test_forward_ad(rope):
    from torch.autograd import forward_ad
    xs, tangents = operands(), operands(seed=5)
    _, want = torch.func.jvp(rope_eager, tuple(xs), tuple(tangents))
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(x, t) for x, t in zip(xs, tangents)]
        out = torch.ops.fusegen.test_rope(*duals)
        for o, w in zip(out, want):
            torch.testing.assert_close(forward_ad.unpack_dual(o).tangent, w, **TOL[torch.float64])


# -- torch.compile, torch.export, ONNX ------------------------------------------------------------

@pytest.mark.parametrize("mode", ["opaque", "decompose"])
def test_compile_both_modes(mode):
    op = fusegen.fuse(ROPE, name=f"test_rope_{mode}", inputs="x1,c,x2,s", compile=mode)
    torch._dynamo.reset()
    xs = operands(torch.float32)
    a, b = leaves(xs), leaves(xs)
    compiled = torch.compile(lambda *t: op(*t), fullgraph=True)
    got, want = compiled(*a), rope_eager(*b)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[torch.float32])
    ga = torch.autograd.grad(sum((o * o).sum() for o in got), a)
    gb = torch.autograd.grad(sum((o * o).sum() for o in want), b)
    for g, w in zip(ga, gb):
        torch.testing.assert_close(g, w, **TOL[torch.float32])


def test_export_records_the_op_with_two_outputs(rope):
    class Rotate(torch.nn.Module):
        def forward(self, x1, c, x2, s):
            first, second = rope(x1, c, x2, s)
            return first + 1, second

    xs = operands(torch.float32)
    program = torch.export.export(Rotate(), tuple(xs))
    calls = [n for n in program.graph.nodes if n.target is torch.ops.fusegen.test_rope.default]
    assert len(calls) == 1
    first, second = program.module()(*xs)
    want = rope_eager(*xs)
    torch.testing.assert_close(first, want[0] + 1, **TOL[torch.float32])
    torch.testing.assert_close(second, want[1], **TOL[torch.float32])


class _Call(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, *xs):
        return self.op(*xs)


def onnx_results(op, xs) -> list[torch.Tensor]:
    """`op` exported to ONNX with fusegen's translation (standard operators only, checked),
    run by onnxruntime on `xs`."""
    onnx = pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    program = torch.onnx.export(_Call(op).eval(), tuple(xs), dynamo=True, verbose=False,
                                custom_translation_table=fusegen.onnx_translations(op))
    proto = program.model_proto
    onnx.checker.check_model(proto, full_check=True)
    assert not proto.functions
    model = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: x.numpy() for i, x in zip(model.get_inputs(), xs)}
    return [torch.from_numpy(o) for o in model.run(None, feeds)]


def test_onnx_export_computes_both_outputs(rope):
    xs = operands(torch.float32)
    for g, w in zip(onnx_results(rope, xs), rope_eager(*xs)):
        torch.testing.assert_close(g, w, **TOL[torch.float32])


def test_a_cached_load_returns_the_tuple_too(rope, tmp_path):
    import subprocess
    import sys
    code = ("import torch, fusegen\n"
            f"op = fusegen.fuse({ROPE!r}, name='test_rope', inputs='x1,c,x2,s')\n"
            "out = op(*[torch.ones(3) for _ in range(4)])\n"
            "print(type(out).__name__, len(out), float(out[0][0]), float(out[1][0]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["tuple", "2", "0.0", "2.0"]


def test_a_name_reused_for_another_output_count_is_refused(rope):
    with pytest.raises(FusegenError, match="already defined"):
        fusegen.fuse("x1*c - x2*s", name="test_rope", inputs="x1,c,x2,s")


# -- a final torch.cat: two outputs as the halves of one result ------------------------------------

ROPE_CAT = "torch.cat((x1*c - x2*s, x2*c + x1*s), -1)"


@pytest.fixture(scope="module")
def rope_cat():
    return fusegen.fuse(ROPE_CAT, name="test_rope_cat", inputs="x1,x2,c,s")


def rope_cat_eager(q, c, s):
    x1, x2 = q.chunk(2, -1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


def cat_operands(dtype=torch.float64, seed=0):
    """Llama's layout, small: q of (batch, heads, positions, head dim), cos/sin per position."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64).to(dtype)
    c, s = (torch.randn(5, 4, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    return [q, c, s]


def test_cat_makes_one_result(rope_cat):
    assert str(rope_cat.op.default._schema).endswith("(Tensor x1, Tensor x2, Tensor c, Tensor s) -> Tensor")
    assert "def.joined = true;" in rope_cat.files["test_rope_cat.cpp"]


@pytest.mark.parametrize("text", ["torch.cat((x*2, x*3))", "torch.cat((x*2, x*3), 0)",
                                  "torch.cat((x, x, x), -1)", "torch.cat([x], -1)",
                                  "torch.cat((x, x), dim=-1, out=x)"])
def test_other_concatenations_are_refused(text):
    with pytest.raises(ParseError, match="cat"):
        parse(text)


def test_cat_matches_eager_with_chunked_halves(rope_cat):
    xs = cat_operands()
    a, b = leaves(xs), leaves(xs)
    got = rope_cat(*a[0].chunk(2, -1), a[1], a[2])
    want = rope_cat_eager(*b)
    assert got.shape == want.shape == (2, 3, 5, 8) and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL[torch.float64])
    dout = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, a, dout), torch.autograd.grad(want, b, dout)):
        torch.testing.assert_close(g, w, **TOL[torch.float64])


def test_cat_derivatives(rope_cat):
    from torch.func import hessian, jvp, vmap

    def fused(q, c, s):
        return rope_cat(*q.chunk(2, -1), c, s)

    xs = leaves(cat_operands())
    assert torch.autograd.gradcheck(fused, xs)
    assert torch.autograd.gradgradcheck(fused, xs)
    tangents = tuple(cat_operands(seed=1))
    torch.testing.assert_close(jvp(fused, tuple(xs), tangents)[1], jvp(rope_cat_eager, tuple(xs), tangents)[1],
                               **TOL[torch.float64])
    q, c, s = cat_operands()
    torch.testing.assert_close(vmap(fused, in_dims=(0, None, None))(q, c, s), rope_cat_eager(q, c, s),
                               **TOL[torch.float64])
    got = hessian(lambda q: fused(q, c, s).sin().sum())(q[:1, :1])
    want = hessian(lambda q: rope_cat_eager(q, c, s).sin().sum())(q[:1, :1])
    torch.testing.assert_close(got, want, **TOL[torch.float64])


def test_cat_opcheck_compile_export(rope_cat):
    from torch.library import opcheck
    q, c, s = cat_operands(torch.float32)
    x1, x2 = (h.contiguous() for h in q.chunk(2, -1))
    result = opcheck(rope_cat.op.default, tuple(leaves([x1, x2, c, s])))
    assert set(result.values()) == {"SUCCESS"}, result
    for mode in ("opaque", "decompose"):
        op = fusegen.fuse(ROPE_CAT, name=f"test_rope_cat_{mode}", inputs="x1,x2,c,s", compile=mode)
        torch._dynamo.reset()
        a, b = leaves([q, c, s]), leaves([q, c, s])
        got = torch.compile(lambda q, c, s: op(*q.chunk(2, -1), c, s), fullgraph=True)(*a)
        want = rope_cat_eager(*b)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
        for g, w in zip(torch.autograd.grad(got.square().sum(), a), torch.autograd.grad(want.square().sum(), b)):
            torch.testing.assert_close(g, w, **TOL[torch.float32])

    class Rotate(torch.nn.Module):
        def forward(self, q, c, s):
            return rope_cat(*q.chunk(2, -1), c, s)

    program = torch.export.export(Rotate(), (q, c, s))
    assert any(n.target is torch.ops.fusegen.test_rope_cat.default for n in program.graph.nodes)
    torch.testing.assert_close(program.module()(q, c, s), rope_cat_eager(q, c, s), **TOL[torch.float32])


def test_cat_onnx(rope_cat):
    q, c, s = cat_operands(torch.float32)
    xs = [h.contiguous() for h in q.chunk(2, -1)] + [c, s]
    (got,) = onnx_results(rope_cat, xs)
    torch.testing.assert_close(got, rope_cat_eager(q, c, s), **TOL[torch.float32])


def test_cat_of_0d_arguments_is_refused_by_name(rope_cat):
    with pytest.raises(RuntimeError, match="test_rope_cat: torch.cat joins the outputs along the last dimension"):
        rope_cat(*(torch.tensor(float(k)) for k in range(4)))


def test_bench_rope_runs_and_checks_its_results():
    from fusegen.bench import rope
    rows = rope.run(1, 2, 16, 8, [torch.float32], reps=2, device="cpu")
    timed = {r["impl"]: r for r in rows if "ms" in r}
    assert {"fusegen", "eager", "copy"} <= set(timed)
    assert timed["fusegen"]["max_abs_error"] < 1e-5 and timed["fusegen"]["ms"] > 0
    assert any(line.startswith("fusegen") for line in rope.report(rows))

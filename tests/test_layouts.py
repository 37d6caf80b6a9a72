"""Real tensors as eager takes them: broadcast, transposed, sliced and
channels_last inputs run without copies and give eager's values, dtypes, shapes, strides
and memory format, forward and backward; Python numbers and 0-d tensors stand for tensor
arguments; bool and integer tensors promote as eager does. CUDA twins: tests/gpu/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from helpers import compare, same_layout

CL = torch.channels_last
F64, F32 = torch.float64, torch.float32


def scale_bias(x, s, b):
    return x * s + b


def nchw(dtype=F64, memory_format=torch.contiguous_format, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 5, 7, generator=g, dtype=dtype).contiguous(memory_format=memory_format)
    return x, torch.randn(1, 3, 1, 1, generator=g, dtype=dtype), torch.randn(3, 1, 1, generator=g, dtype=dtype)


# -- layouts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, CL], ids=["nchw", "channels_last"])
def test_per_channel_scale_and_bias(corpus_ops, memory_format, dtype):
    """x * scale[None, :, None, None] + bias: the output keeps x's memory format, the
    gradients of scale and bias are summed back to their shapes, as eager's are."""
    compare(corpus_ops["cp_fma"], scale_bias, list(nchw(dtype, memory_format)), dtype)


def test_channels_last_against_a_contiguous_tensor(corpus_ops):
    """Mixed formats: TensorIterator decides, as it does for eager."""
    x, _, _ = nchw(memory_format=CL)
    y = torch.randn(x.shape, dtype=F64)
    compare(corpus_ops["cp_fma"], scale_bias, [x, y, y.clone()])
    compare(corpus_ops["cp_fma"], scale_bias, [y, x, y.clone()])


@pytest.mark.parametrize("kind", ["transposed", "sliced", "expanded", "permuted_3d"])
def test_strided_inputs(corpus_ops, kind):
    g = torch.Generator().manual_seed(3)
    if kind == "transposed":
        a, b, c = torch.randn(9, 31, generator=g, dtype=F64).t(), torch.randn(31, 9, dtype=F64), torch.randn(9, dtype=F64)
    elif kind == "sliced":  # stride 2, odd offset
        a, b, c = torch.randn(203, generator=g, dtype=F64)[1::2], torch.randn(101, dtype=F64), torch.randn(101, dtype=F64)
    elif kind == "expanded":
        a, b, c = torch.randn(1, 33, dtype=F64).expand(5, 33), torch.randn(5, 33, dtype=F64), torch.randn(5, 1, dtype=F64)
    else:
        a = torch.randn(4, 5, 6, generator=g, dtype=F64).permute(2, 0, 1)
        b, c = torch.randn(6, 4, 5, dtype=F64).transpose(0, 2).transpose(0, 2), torch.randn(6, 1, 5, dtype=F64)
    compare(corpus_ops["cp_fma"], scale_bias, [a, b, c])
    compare(corpus_ops["cp_gelu_tanh"], lambda x: 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x))),
            [a])


def test_low_precision_strided_and_broadcast(corpus_ops):
    """fp16/bf16 through the gather path: computed in float, rounded once."""
    for dtype in (torch.bfloat16, torch.float16):
        x, s, b = nchw(F32, CL)
        xs = [x.to(dtype), s.to(dtype), b.to(dtype)]
        got = corpus_ops["cp_fma"](*xs)
        want = (xs[0].float() * xs[1].float() + xs[2].float()).to(dtype)
        same_layout(got, xs[0] * xs[1] + xs[2], str(dtype))
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_no_copy_of_broadcast_strided_or_channels_last_inputs(corpus_ops):
    """The only tensor allocated is the output (forward) or the gradients (backward): no
    contiguous(), copy_ or to() of an input, checked with the profiler."""
    x, s, b = nchw(F32, CL)
    t = torch.randn(7, 5, 3, 2, dtype=F32).permute(3, 2, 1, 0)[:, :, ::2]
    cases = [(corpus_ops["cp_fma"], [x, s, b]), (corpus_ops["cp_fma"], [t, t, t[0, 0]])]
    for op, args in cases:
        leaves = [a.clone().requires_grad_(True) for a in args]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = op.op(*args)
        names = [e.name for e in prof.events()]
        assert not [n for n in names if n in ("aten::copy_", "aten::contiguous", "aten::clone", "aten::to",
                                              "aten::_to_copy")], names
        assert out.shape == torch.broadcast_shapes(*(a.shape for a in args))
        out = op.op(*leaves)
        g = torch.ones_like(out)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.autograd.grad(out, leaves[:2], g)
        names = [e.name for e in prof.events()]
        assert not [n for n in names if n in ("aten::copy_", "aten::contiguous", "aten::clone")], names


def test_meta_output_has_the_real_layout(corpus_ops):
    x, s, b = nchw(F32, CL)
    real = corpus_ops["cp_fma"].op(x, s, b)
    meta = corpus_ops["cp_fma"].op(x.to("meta"), s.to("meta"), b.to("meta"))
    assert meta.device.type == "meta" and meta.shape == real.shape and meta.stride() == real.stride()


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, CL], ids=["nchw", "channels_last"])
def test_meta_layout_under_dynamic_shapes(memory_format):
    """Symbolic sizes skip TensorIterator in the Meta impl; its outputs still take the
    layout of the input of the output's shape, so an opaque op in a dynamic-shape compile
    agrees with the real kernel (inductor asserts the strides: with contiguous Meta outputs
    a channels_last input failed there)."""
    from fusegen.api import fuse

    op = fuse("x*s+b", name=f"lay_dyn_{'cl' if memory_format is CL else 'nchw'}", compile="opaque")
    s, b = torch.randn(1, 8, 1, 1), torch.randn(1, 8, 1, 1)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: op(x, s, b) * 2, dynamic=True, fullgraph=True)  # inductor checks strides
    # No cached graphs: they are keyed by op name, not by the runtime whose Meta impl made them.
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        for shape in [(2, 8, 5, 5), (3, 8, 7, 6)]:
            x = torch.randn(shape).contiguous(memory_format=memory_format)
            got, want = compiled(x), (x * s + b) * 2
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride()


def _permuted_cases(n, m):
    """name -> the inputs of a*b+c: layouts whose output order TensorIterator takes from
    the inputs' strides (no fast setup)."""
    return {
        "first input transposed": (torch.randn(m, n).t(), torch.randn(n, m), torch.randn(n, m)),
        "second input transposed": (torch.randn(n, m), torch.randn(m, n).t(), torch.randn(m)),
        "permuted, broadcast row": (torch.randn(m, 3, n).permute(1, 2, 0), torch.randn(1, m), torch.randn(3, n, m)),
        "broadcast first, transposed": (torch.randn(m), torch.randn(m, n).t(), torch.randn(n, 1)),
    }


@pytest.mark.parametrize("case", list(_permuted_cases(2, 3)))
def test_meta_layout_of_permuted_inputs_under_dynamic_shapes(case):
    """Under dynamic shapes the Meta impl orders the output's dimensions by the inputs'
    strides as TensorIterator does (before: contiguous outputs, and inductor's stride
    assertion failed for a transposed first input)."""
    from fusegen.api import fuse

    op = fuse("a*b+c", name="lay_dyn_perm", compile="opaque")
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: op(a, b, c) * 2, dynamic=True, fullgraph=True)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        for n, m in [(5, 7), (6, 9)]:
            a, b, c = _permuted_cases(n, m)[case]
            got, want = compiled(a, b, c), (a * b + c) * 2
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride() == op(a, b, c).stride()


def test_opcheck_with_real_layouts(corpus_ops):
    x, s, b = nchw(F64, CL)
    for args in [(x, s, b), (x.transpose(1, 3), s.transpose(1, 3), b.transpose(0, 2)), (x, torch.tensor(2.0, dtype=F64), b)]:
        args = tuple(a.clone().requires_grad_(True) for a in args)
        result = torch.library.opcheck(corpus_ops["cp_fma"].op, args)
        assert all(v == "SUCCESS" for v in result.values()), result


# -- numbers, 0-d tensors, integers ---------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ("bf16", 2.0, 1), ("f32", 0.5, True), (3, "f16", "f64_0d"), ("i64", 2.5, 1), ("f16_0d", 3.0, 1.0),
    ("f32", "f64_0d", "f16_0d"), ("bool", "f32", "i32_0d"),
], ids=str)
def test_numbers_and_zero_dim_tensors_promote_like_eager(corpus_ops, args):
    dtypes = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": F32, "f64": F64, "i64": torch.int64,
              "i32": torch.int32, "bool": torch.bool}

    def make(a):
        if not isinstance(a, str):
            return a
        name, _, zero_d = a.partition("_")
        shape = () if zero_d else (6,)
        return (torch.rand(shape) * 4).to(dtypes[name]) if name != "bool" else torch.rand(shape) > 0.5

    values = [make(a) for a in args]
    got = corpus_ops["cp_fma"](*values)
    want = values[0] * values[1] + values[2]
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_every_dtype_pair_with_integers_and_bool_promotes_like_eager(corpus_ops):
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64]
    for da in dtypes:
        for db in dtypes:
            a, b = (torch.arange(-3, 4) % 3).to(da), (torch.arange(7) % 2 + 1).to(db)
            want = a + b
            if not want.is_floating_point():
                with pytest.raises(RuntimeError, match="fusegen computes in"):
                    corpus_ops["cp_add"](a, b)
                continue
            got = corpus_ops["cp_add"](a, b)
            assert got.dtype == want.dtype, (da, db, got.dtype, want.dtype)
            torch.testing.assert_close(got, want)


def test_mask_times_tensor_and_integer_inputs_get_no_gradient(corpus_ops):
    """`mask * x + k` with a bool mask and an int k: float result, gradient for x only."""
    x = torch.randn(4, 5, dtype=F64, requires_grad=True)
    mask, k = torch.rand(4, 5) > 0.5, torch.arange(5)
    out = corpus_ops["cp_fma"](mask, x, k)
    torch.testing.assert_close(out, mask * x + k)
    (gx,) = torch.autograd.grad(out, x, torch.ones_like(out))
    torch.testing.assert_close(gx, mask.to(F64))


def test_fused_decorator_takes_numbers(corpus_ops):
    from fusegen import fused

    @fused(name="lay_axpb")
    def axpb(a, x, b):
        return a * x + b

    x = torch.randn(8, dtype=torch.bfloat16)
    out = axpb(2.0, x, 1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, axpb.eager(2.0, x, 1))


# -- chunk halves: a GLU's `a, b = u.chunk(2, -1)` --------------------------------------------

def _relu_glu(a, b):
    return torch.relu(a) * b


def _halves(u, how, dim):
    """The two inputs cut from u: chunk, split with sizes, chunk in swapped order, or a
    split whose first part (size 1) broadcasts."""
    n = u.shape[dim]
    if how in ("split", "broadcast"):
        first = 1 if how == "broadcast" else n // 2
        return u.split([first, n - first], dim)
    a, b = u.chunk(2, dim)
    return (b, a) if how == "swapped" else (a, b)


def _glu_step(f, u0, how, dim, leaf, create_graph=False):
    """u's gradient through f on u's halves (u a leaf, or the output of an op): the value,
    the backward's autograd events, and the node f's output hangs off."""
    u = u0.detach().clone().requires_grad_(True)
    w = u if leaf else u * 1.0
    a, b = _halves(w, how, dim)
    out = f(a, b)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (grad,) = torch.autograd.grad(out, u, g, create_graph=create_graph)
    return grad, [e.name for e in prof.events()], out.grad_fn


@pytest.mark.parametrize("how", ["chunk", "split", "swapped", "broadcast"])
@pytest.mark.parametrize("dim", [-1, 0])
@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non-leaf"])
def test_chunk_halves_gradient_skips_the_split(corpus_ops, how, dim, leaf):
    """The op's node takes the split's edge to u, and its backward writes both halves'
    gradients into one tensor of u's shape: eager's values and layout, no cat (but where
    a half's gradient is summed to its shape first: then the node concatenates)."""
    op = corpus_ops["cp_relu_mul"]
    u = torch.randn(6, 10, generator=torch.Generator().manual_seed(0), dtype=F64)
    got, events, node = _glu_step(op, u, how, dim, leaf)
    want, _, _ = _glu_step(_relu_glu, u, how, dim, leaf)
    same_layout(got, want, "u's gradient")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    unwanted = ("aten::copy_", "SplitBackward0", "SplitWithSizesBackward0") + (("aten::cat",) if how != "broadcast" else ())
    assert not [n for n in events if n in unwanted], events
    edges = [f for f, _ in node.next_functions]  # u's, in the first half's place; none for the second
    assert "Split" not in str(edges) and (edges[0] is None) == (how == "swapped") and edges.count(None) == 1, edges


def test_chunk_halves_with_hooks_or_retain_grad_keep_the_split(corpus_ops):
    """A hook or retain_grad on a half sees its gradient: the split stays in the graph."""
    op = corpus_ops["cp_relu_mul"]
    u = torch.randn(4, 8, dtype=F64, requires_grad=True)
    seen = []
    a, b = u.chunk(2, -1)
    a.register_hook(lambda g: seen.append(g))
    b.retain_grad()
    out = op(a, b)
    assert "SplitBackward0" in str(out.grad_fn.next_functions)
    out.sum().backward()
    a2, b2 = u.detach().chunk(2, -1)
    torch.testing.assert_close(seen[0], (a2 > 0) * b2, rtol=0, atol=0)
    torch.testing.assert_close(b.grad, torch.relu(a2), rtol=0, atol=0)


@pytest.mark.parametrize("name, f, extra", [
    ("cp_fma", lambda a, b, c: a * b + c, lambda u: [torch.randn(u.shape[-1] // 2, dtype=F64)]),  # a broadcast third input
    ("cp_add", lambda a, b: a + b, lambda u: []),  # gradients of dout alone: concatenated by the op's node
])
def test_chunk_halves_with_other_inputs(corpus_ops, name, f, extra):
    """Other inputs keep their own gradients; halves also used elsewhere add up as in eager."""
    u0 = torch.randn(5, 12, generator=torch.Generator().manual_seed(2), dtype=F64)
    others = extra(u0)
    results = []
    for g in (corpus_ops[name], f):
        u = u0.clone().requires_grad_(True)
        c = [t.clone().requires_grad_(True) for t in others]
        a, b = u.chunk(2, -1)
        out = g(a, b, *c) + 3 * a  # a's second use goes through the split
        results.append(torch.autograd.grad(out.sum(), [u, *c]))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_chunk_halves_double_backward(corpus_ops):
    """create_graph: the op's node concatenates the halves with a differentiable cat."""
    op = corpus_ops["cp_fma"]
    u0 = torch.randn(3, 8, generator=torch.Generator().manual_seed(4), dtype=F64)
    c = torch.randn(3, 4, dtype=F64)
    results = []
    for f in (op, lambda a, b, c: a * b + c):
        u = u0.clone().requires_grad_(True)
        a, b = u.chunk(2, -1)
        (g,) = torch.autograd.grad((f(a, b, c) ** 2).sum(), u, create_graph=True)
        results.append((g, torch.autograd.grad(g.pow(2).sum(), u)[0]))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("make", ["transposed", "view"])
def test_halves_of_a_non_contiguous_tensor_or_of_a_view_skip_the_split(corpus_ops, make):
    """Halves of any u go past the split, a transposed one or a view of another tensor
    (attention's q.view(batch, seq, heads, dim).chunk(2, -1)): u's gradient is one tensor
    of u's shape, contiguous as autograd's cat gives it, and no copy follows it."""
    op = corpus_ops["cp_relu_mul"]
    w0 = torch.randn(10, 6, generator=torch.Generator().manual_seed(3), dtype=F64)

    def u_of(w):
        return w.t() if make == "transposed" else w.view(5, 2, 6)

    results = []
    for f in (op, _relu_glu):
        w = w0.clone().requires_grad_(True)
        out = f(*u_of(w).chunk(2, -1))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            (grad,) = torch.autograd.grad(out, w, torch.ones_like(out))
        results.append((grad, out.grad_fn, [e.name for e in prof.events()]))
    (got, node, events), (want, _, _) = results
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "Split" not in str(node.next_functions), node.next_functions
    unwanted = ("SplitBackward0", "aten::cat") + (("aten::copy_",) if make == "view" else ())
    assert not [n for n in events if n in unwanted], events


def test_chunk_halves_under_compiled_autograd(corpus_ops):
    """compiled_autograd traces the node's packed state, the halves included."""
    from torch._dynamo import compiled_autograd
    op = corpus_ops["cp_relu_mul"]
    u = torch.randn(4, 8, dtype=F64, requires_grad=True)
    want = torch.autograd.grad(_relu_glu(*u.chunk(2, -1)).sum(), u)[0]
    u.grad = None
    with compiled_autograd._enable(lambda gm: gm):
        op(*u.chunk(2, -1)).sum().backward()
    torch.testing.assert_close(u.grad, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_chunk_halves_in_low_precision(corpus_ops, dtype):
    """The CPU kernel writes both halves' gradients in the call's dtype: bit for bit the
    float-computed, once-rounded gradients eager's cat would join."""
    op = corpus_ops["cp_fma"]
    u = torch.randn(7, 2 * 13, generator=torch.Generator().manual_seed(5)).to(dtype).requires_grad_(True)
    c = torch.randn(7, 13).to(dtype)
    out = op(*u.chunk(2, -1), c)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        (got,) = torch.autograd.grad(out, u, g)
    assert "aten::cat" not in [e.name for e in prof.events()]
    a, b = u.detach().float().chunk(2, -1)
    want = torch.cat([(g.float() * b).to(dtype), (g.float() * a).to(dtype)], -1)
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=0)

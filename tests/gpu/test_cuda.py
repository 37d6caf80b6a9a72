"""CUDA twins of the CPU tests: run on a GPU machine with

    PYTHONPATH=. python -m pytest -m cuda tests/gpu

The test run's corpus library (tests/conftest.py) includes the CUDA impls when torch sees
a GPU and nvcc is installed (fusegen.build.builder.cuda_enabled)."""

from __future__ import annotations

import re

import pytest
import torch

from corpus import BY_NAME, CORPUS, SEEDS
from helpers import TOL, compare, forward_backward

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SIZES = [0, 1, 3, 4097, 2 ** 20 + 3]


@pytest.fixture(scope="module")
def cuda_ops(corpus_ops):
    from fusegen.build.builder import cuda_enabled

    if not cuda_enabled():
        pytest.fail("torch sees a GPU but fusegen built without CUDA (nvcc missing? FUSEGEN_CPU_ONLY=1?)")
    return corpus_ops


def on_cuda(case, n, dtype, seed=0, shapes=None):
    return [t.to("cuda", dtype) for t in case.sample(n, torch.float64, seed=seed, shapes=shapes)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("case", SEEDS, ids=repr)
def test_seed_forward_backward(cuda_ops, case, n, dtype):
    compare(cuda_ops[case.name], case.eager, on_cuda(case, n, dtype, seed=n), dtype, case.scalar_values, what=case.name,
            layout=False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=["f64", "f32", "bf16", "f16"])
@pytest.mark.parametrize("case", CORPUS, ids=repr)
def test_corpus_on_cuda(cuda_ops, case, dtype):
    compare(cuda_ops[case.name], case.eager, on_cuda(case, 4099, dtype, seed=1), dtype, case.scalar_values, what=case.name,
            layout=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16],
                         ids=["f32", "bf16", "f64", "f16"])
@pytest.mark.parametrize("which", ["all", "first", "last"])
@pytest.mark.parametrize("case", SEEDS, ids=repr)
def test_misaligned_views(cuda_ops, case, which, dtype):
    """x[1:] moves the data pointer off 16-byte alignment: the scalar path and tail."""
    n = 2 ** 16 + 5
    full = on_cuda(case, n + 1, dtype, seed=2)
    aligned = [t[:-1] for t in full]
    shifted = [t[1:] for t in full]
    k = len(full)
    pick = {"all": range(k), "first": [0], "last": [k - 1]}[which]
    tensors = [shifted[j] if j in pick else aligned[j] for j in range(k)]
    assert any(t.data_ptr() % 16 for t in tensors)
    compare(cuda_ops[case.name], case.eager, tensors, dtype, case.scalar_values, what=case.name,
            layout=False)


@pytest.mark.parametrize("case", SEEDS, ids=repr)
def test_transposed_and_expanded(cuda_ops, case):
    m, n = 67, 129
    tensors = [t.t() for t in on_cuda(case, 0, torch.float32, shapes=[(n, m)] * len(case.domains))]
    compare(cuda_ops[case.name], case.eager, tensors, torch.float32, case.scalar_values, what=case.name,
            layout=False)
    row = on_cuda(case, 0, torch.float32, shapes=[(1, n)] + [(m, n)] * (len(case.domains) - 1))
    compare(cuda_ops[case.name], case.eager, [row[0].expand(m, n)] + row[1:], torch.float32, case.scalar_values, what=case.name,
            layout=False)
    compare(cuda_ops[case.name], case.eager, row, torch.float32, case.scalar_values, what=case.name,
            layout=False)  # broadcast, summed back


def test_broadcast_case(cuda_ops):
    case = BY_NAME["cp_bias_gelu"]
    compare(cuda_ops[case.name], case.eager, on_cuda(case, 1000, torch.float32), torch.float32, case.scalar_values, what=case.name,
            layout=False)


@pytest.mark.parametrize("name", ["cp_gelu_tanh", "cp_relu_add", "cp_add_mul", "cp_mul_sub"])
def test_non_default_stream(cuda_ops, name):
    """Forward and backward on a side stream (the backward of cp_relu_add reads the saved
    output, cp_add_mul's writes one gradient for two inputs)."""
    case, op = BY_NAME[name], cuda_ops[name]
    xs = on_cuda(case, 2 ** 22, torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # a long producer on the side stream, then the op: correct only if the op runs on
        # the current (side) stream, ordered after the producer
        ys = [x * 1.0 for x in xs]
        for _ in range(20):
            ys = [y + 0.0 for y in ys]
        leaves = [y.detach().requires_grad_(True) for y in ys]
        out = op(*leaves)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    stream.synchronize()
    torch.testing.assert_close(out, case.eager(*xs), **TOL[torch.float32])
    xe = [x.clone().requires_grad_(True) for x in xs]
    want = torch.autograd.grad(case.eager(*xe), xe, torch.ones_like(xe[0]))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, **TOL[torch.float32])


@pytest.mark.parametrize("name", ["cp_fma", "cp_relu_add", "cp_add_mul", "cp_silu"])
def test_cuda_graph_capture_and_replay(cuda_ops, name):
    """Forward and backward captured in a CUDA graph, replayed on new values: every launch
    is on the capturing stream, and nothing syncs with the host."""
    case, op = BY_NAME[name], cuda_ops[name]
    static = [t.requires_grad_(True) for t in on_cuda(case, 100003, torch.float32, seed=3)]
    dout = torch.randn(100003, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs asks
        for _ in range(3):
            torch.autograd.grad(op(*static), static, dout)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*static)
        grads = torch.autograd.grad(out, static, dout)
    for seed in (4, 5):
        fresh = on_cuda(case, 100003, torch.float32, seed=seed)
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        xe = [f.clone().requires_grad_(True) for f in fresh]
        want_out = case.eager(*xe)
        want = torch.autograd.grad(want_out, xe, dout)
        torch.testing.assert_close(out, want_out, **TOL[torch.float32])
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w, **TOL[torch.float32])


@pytest.mark.parametrize("n", [1023, 1024, 1025, 4 * 256 * 4 * 3 + 1, 2 * 256 * 8 * 5 + 13, 1056 * 256 * 16 + 77])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["f32", "bf16", "f64"])
@pytest.mark.parametrize("name", ["cp_fma", "cp_silu", "cp_relu_add", "cp_add_mul"])
def test_unrolled_kernel_tails(cuda_ops, name, dtype, n):
    """Sizes around the kernels' chunks (kThreads x kUnroll vectors) and a full wave: the
    unrolled loop, the partial chunk and the scalar tail."""
    case = BY_NAME[name]
    compare(cuda_ops[name], case.eager, on_cuda(case, n, dtype, seed=n % 97), dtype, case.scalar_values, what=case.name,
            layout=False)


def test_saved_output_in_place_check_cuda(cuda_ops):
    op = cuda_ops["cp_relu_add"]
    x, y = (torch.randn(4096, device="cuda", requires_grad=True) for _ in range(2))
    out = op(x, y)
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_deduped_gradients_cuda(cuda_ops, dtype):
    """(x+y)*w: the backward op writes one tensor for x and y; broadcast inputs get it
    summed to their own shapes."""
    op = cuda_ops["cp_add_mul"]
    x, y, w, dout = (torch.randn(3, 4099, device="cuda", dtype=dtype) for _ in range(4))
    grads = op.backward_op(dout, x, y, w, [True, True])
    assert len(grads) == 2
    xs = [x.requires_grad_(True), y[:1].clone().requires_grad_(True), w.requires_grad_(True)]
    got = torch.autograd.grad(op(*xs), xs, dout)
    want = torch.autograd.grad((xs[0] + xs[1]) * xs[2], xs, dout)
    assert got[1].shape == (1, 4099)
    for g, e in zip(got, want):
        torch.testing.assert_close(g.float(), e.float(), rtol=2e-2 if dtype == torch.bfloat16 else 2e-5, atol=2e-2)


def test_zero_size_launches_nothing(cuda_ops):
    op = cuda_ops["cp_fma"]
    a = torch.empty(0, 7, device="cuda", requires_grad=True)
    out = op(a, torch.empty(0, 7, device="cuda"), torch.empty(7, device="cuda"))
    assert out.shape == (0, 7) and out.is_cuda
    out.sum().backward()
    assert a.grad.shape == (0, 7)


def test_cpu_cuda_mixing_is_an_error(cuda_ops):
    op = cuda_ops["cp_fma"]
    a = torch.randn(8, device="cuda:0")
    with pytest.raises(RuntimeError) as info:
        op(a, torch.randn(8), a)
    message = str(info.value)
    assert "fusegen::cp_fma" in message and "argument 'b'" in message and "cpu" in message and "cuda:0" in message


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device_uses_its_own_guard(cuda_ops):
    case, op = BY_NAME["cp_silu"], cuda_ops["cp_silu"]
    (x,) = [t.to("cuda:1") for t in case.sample(10000, torch.float32)]
    with torch.cuda.device(0):
        out, (g,) = forward_backward(op, [x])
    assert out.device == torch.device("cuda:1") and g.device == torch.device("cuda:1")
    want, (gw,) = forward_backward(case.eager, [x])
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    torch.testing.assert_close(g, gw, **TOL[torch.float32])


@pytest.mark.parametrize("case", SEEDS, ids=repr)
def test_opcheck_cuda(cuda_ops, case):
    args = tuple(t.requires_grad_(True) for t in on_cuda(case, 33, torch.float32)) + tuple(case.scalar_values)
    result = torch.library.opcheck(cuda_ops[case.name].op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_torch_compile_cuda(cuda_ops):
    case, op = BY_NAME["cp_silu"], cuda_ops["cp_silu"]
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: op.op(x) * 2.0, fullgraph=True)
    (x,) = on_cuda(case, 4097, torch.float32)
    torch.testing.assert_close(compiled(x), case.eager(x) * 2.0, **TOL[torch.float32])


# -- real layouts with no copies, CPU scalars, numbers, integers (CPU twins in
# tests/test_layouts.py) ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["f32", "bf16", "f64"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
def test_cuda_per_channel_scale_bias(cuda_ops, memory_format, dtype):
    x = torch.randn(4, 19, 33, 17, device="cuda", dtype=dtype).contiguous(memory_format=memory_format)
    s, b = torch.randn(1, 19, 1, 1, device="cuda", dtype=dtype), torch.randn(19, 1, 1, device="cuda", dtype=dtype)
    compare(cuda_ops["cp_fma"], lambda x, s, b: x * s + b, [x, s, b], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("kind", ["transposed", "sliced", "permuted", "chunked"])
def test_cuda_strided_inputs(cuda_ops, kind, dtype):
    """The offset-calculator kernel: every operand at its own strides, no copies."""
    kw = dict(device="cuda", dtype=dtype)
    if kind == "transposed":
        a, b, c = torch.randn(129, 67, **kw).t(), torch.randn(67, 129, **kw), torch.randn(129, **kw)
    elif kind == "sliced":
        a, b, c = torch.randn(2 * 4099 + 1, **kw)[1::2], torch.randn(4099, **kw), torch.randn(4099, **kw)
    elif kind == "permuted":
        a, b, c = torch.randn(5, 6, 7, 8, **kw).permute(3, 1, 0, 2), torch.randn(8, 6, 5, 7, **kw), torch.randn(7, **kw)
    else:  # SwiGLU's layout: two halves of one tensor
        a, b = torch.randn(33, 2 * 257, **kw).chunk(2, -1)
        c = torch.randn(33, 257, **kw)
    compare(cuda_ops["cp_fma"], lambda a, b, c: a * b + c, [a, b, c], dtype)
    compare(cuda_ops["cp_silu"], lambda x: x * torch.sigmoid(x), [a], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("width", [256, 257])
def test_cuda_chunk_halves_write_one_gradient(cuda_ops, width, dtype):
    """A GLU's halves (`a, b = u.chunk(2, -1)`): the backward kernel writes both gradients
    into u's, with no cat kernel after it; eager's values and layout."""
    op = cuda_ops["cp_relu_mul"]
    u = torch.randn(33, 2 * width, device="cuda", dtype=dtype)
    glu = lambda u: op(*u.chunk(2, -1))  # noqa: E731
    compare(glu, lambda u: torch.relu(u.chunk(2, -1)[0]) * u.chunk(2, -1)[1], [u], dtype)
    leaf = u.clone().requires_grad_(True)
    out = glu(leaf)
    grad = torch.ones_like(out)
    kernels = _kernels_run(lambda: out.backward(grad))
    assert len(kernels) == 1 and not [k for k in kernels if "Cat" in k or "copy" in k.lower()], kernels


def _kernels_run(fn):
    """The names of the CUDA kernels fn launches, from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def _kernel_path_cases(kw):
    """name -> (inputs of a*b+c, the kernel the forward must take). `tiled_kernel/P`: the
    tiled kernel moving P elements per access for fp16/bf16 (fp32: always 1), the widest
    whose accesses are whole and aligned (P * 2 bytes): 4 for sizes and steps that are
    multiples of 4, 2 for multiples of 2, else 1. The first input orders the loop (its
    fastest dimension is dimension 0, along which the outputs are laid out), so with `t`
    first, b and c are the tiled inputs; 136 x 100 is a partial tile at both ends at P = 4
    (128 x 64 tiles)."""
    nchw = torch.randn(4, 20, 8, 6, **kw)
    t = torch.randn(100, 136, **kw).t()
    b, c = torch.randn(136, 100, **kw), torch.randn(136, 100, **kw)
    return {
        "per-channel NCHW": ([nchw, torch.randn(1, 20, 1, 1, **kw), torch.randn(20, 1, 1, **kw)], "vector_kernel"),
        "per-channel channels_last": ([nchw.contiguous(memory_format=torch.channels_last), torch.randn(1, 20, 1, 1, **kw),
                                       torch.randn(20, 1, 1, **kw)], "vector_kernel"),
        "row bias": ([torch.randn(37, 64, **kw), torch.randn(37, 64, **kw), torch.randn(64, **kw)], "vector_kernel"),
        "row scale, column bias": ([torch.randn(37, 64, **kw), torch.randn(64, **kw), torch.randn(37, 1, **kw)],
                                   "vector_kernel"),
        "misaligned broadcast": ([torch.randn(37 * 64 + 1, **kw)[1:].view(37, 64), torch.randn(64, **kw),
                                  torch.randn(37, 1, **kw)], "vector_kernel"),
        "sliced beside contiguous": ([torch.randn(2 * 4100, **kw)[::2], torch.randn(4100, **kw), torch.randn(4100, **kw)],
                                     "vector_kernel"),
        "sliced, 16-byte vectors": ([torch.randn(2 * 4104, **kw)[::2], torch.randn(4104, **kw), torch.randn(4104, **kw)],
                                    "vector_kernel"),
        # The vector kernel's flat loop: rows of H * W = 1295 (odd) and 1332 (4 mod 8), so
        # vectors cross row ends, where the scale and bias change within a vector.
        "per-channel NCHW, odd rows": ([torch.randn(8, 3, 35, 37, **kw), torch.randn(1, 3, 1, 1, **kw),
                                        torch.randn(3, 1, 1, **kw)], "vector_kernel"),
        "per-channel NCHW, rows of 4 mod 8": ([torch.randn(2, 4, 36, 37, **kw), torch.randn(1, 4, 1, 1, **kw),
                                               torch.randn(4, 1, 1, **kw)], "vector_kernel"),
        "odd fast dimension": ([torch.randn(37, 63, **kw), torch.randn(63, **kw), torch.randn(37, 1, **kw)],
                               "strided_kernel"),
        "misaligned contiguous": ([torch.randn(4101, **kw)[1:], torch.randn(4100, **kw), torch.randn(4100, **kw)],
                                  "strided_kernel"),
        "transposed, edge tiles": ([torch.randn(45, 70, **kw).t(), torch.randn(70, 45, **kw), torch.randn(70, 45, **kw)],
                                   "tiled_kernel/1"),
        "two transposed inputs": ([torch.randn(70, 45, **kw), torch.randn(45, 70, **kw).t(), torch.randn(45, 70, **kw).t()],
                                  "tiled_kernel/1"),
        "transposed, outer dims": ([torch.randn(3, 50, 40, **kw).transpose(1, 2), torch.randn(3, 40, 50, **kw),
                                    torch.randn(1, 50, **kw)], "tiled_kernel/2"),
        "transposed, fours, edge tiles": ([t, b, c], "tiled_kernel/4"),
        "transposed, fours, one partial tile": ([torch.randn(20, 24, **kw).t(), torch.randn(24, 20, **kw),
                                                 torch.randn(24, 20, **kw)], "tiled_kernel/4"),
        "two transposed inputs, fours": ([b, t, torch.randn(100, 136, **kw).t()], "tiled_kernel/4"),
        "transposed, fours, outer dims": ([torch.randn(3, 64, 40, **kw).transpose(1, 2), torch.randn(3, 40, 64, **kw),
                                           torch.randn(1, 64, **kw)], "tiled_kernel/4"),
        "transposed, fours, repeated rows": ([t, b, torch.randn(100, **kw)], "tiled_kernel/4"),
        "transposed, rows of 2 mod 4": ([torch.randn(102, 136, **kw).t(), torch.randn(136, 102, **kw),
                                         torch.randn(136, 102, **kw)], "tiled_kernel/2"),
        "transposed, row pitch of 2 mod 4": ([torch.randn(100, 138, **kw)[:, :136].t(), b, c], "tiled_kernel/2"),
        "transposed, 4-byte aligned": ([torch.randn(2 + 100 * 136, **kw)[2:].view(100, 136).t(), b, c],
                                       "tiled_kernel/2"),
        "transposed, 2-byte aligned": ([torch.randn(1 + 100 * 136, **kw)[1:].view(100, 136).t(), b, c],
                                       "tiled_kernel/1"),
        "transposed, small": ([torch.randn(9, 72, **kw).t(), torch.randn(72, 9, **kw), torch.randn(72, 9, **kw)],
                              "vector_kernel"),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16],
                         ids=["f32", "bf16", "f64", "f16"])
@pytest.mark.parametrize("case", list(_kernel_path_cases({})), ids=str)
def test_cuda_kernel_paths(cuda_ops, case, dtype):
    """Each layout takes the kernel meant for it (named by the profiler) and matches eager,
    forward and backward (the backward's kernel reads dout and the inputs in the same layout)."""
    tensors, kernel = _kernel_path_cases(dict(device="cuda", dtype=dtype))[case]
    kernel, _, pack = kernel.partition("/")
    if dtype == torch.float64:
        kernel, pack = "strided_kernel", ""  # fp64 takes only the contiguous and strided kernels
    if pack and dtype not in (torch.float16, torch.bfloat16):
        pack = "1"
    # The demangled name, with P: fusegen::tiled_kernel<fusegen::BFloat16, 4, fusegen::op_...>.
    name = re.compile(rf"fusegen::{kernel}<" + (rf"[^,]*, {pack}," if pack else ""))
    op = cuda_ops["cp_fma"].op
    names = _kernels_run(lambda: op(*tensors))
    assert any(name.search(n) for n in names), names
    compare(cuda_ops["cp_fma"], lambda a, b, c: a * b + c, tensors, dtype)


def _sum_cases(kw):
    """name -> (inputs of a*b+c, whether the backward sums in the kernel). a*b+c's gradients
    are dout*b, dout*a (kernel outputs) and dout (steps of dout alone), so b and c cover
    both kinds of accumulator."""
    nchw = torch.randn(4, 20, 8, 6, **kw)
    return {
        "per-channel NCHW": ([nchw, torch.randn(1, 20, 1, 1, **kw), torch.randn(20, 1, 1, **kw)], True),
        "per-channel channels_last": ([nchw.contiguous(memory_format=torch.channels_last), torch.randn(1, 20, 1, 1, **kw),
                                       torch.randn(20, 1, 1, **kw)], True),
        "long row bias": ([torch.randn(33, 4100, **kw), torch.randn(33, 4100, **kw), torch.randn(4100, **kw)], True),
        "short row scale, column bias": ([torch.randn(37, 12, **kw), torch.randn(12, **kw), torch.randn(37, 1, **kw)],
                                         True),
        "0-d scale and bias": ([torch.randn(70, 64, **kw), torch.randn((), **kw), torch.randn((), **kw)], True),
        "sliced, strided sums": ([torch.randn(24, 2 * 64, **kw)[:, ::2], torch.randn(24, 1, **kw), torch.randn(64, **kw)],
                                 True),
        "odd fast dimension": ([torch.randn(37, 63, **kw), torch.randn(63, **kw), torch.randn(37, 1, **kw)], False),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16],
                         ids=["f32", "bf16", "f64", "f16"])
@pytest.mark.parametrize("case", list(_sum_cases({})), ids=str)
def test_cuda_backward_sums_in_kernel(cuda_ops, case, dtype):
    """The gradients of broadcast inputs are summed in the backward kernel (the profiler sees
    the accumulating kernel and no ATen reduction) where its loop allows, else by ATen, and
    match eager either way; fp64 and deterministic mode always take ATen's sum."""
    tensors, in_kernel = _sum_cases(dict(device="cuda", dtype=dtype))[case]
    in_kernel = in_kernel and dtype != torch.float64
    op = cuda_ops["cp_fma"].op
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = op(*leaves)
    names = _kernels_run(lambda: torch.autograd.grad(out, leaves, torch.randn_like(out), retain_graph=True))
    accumulated = any("fusegen::accumulating_kernel<" in n for n in names)
    summed_by_aten = any("reduce_kernel" in n and "fusegen" not in n for n in names)
    assert accumulated == in_kernel and summed_by_aten == (not in_kernel), sorted(n[:100] for n in names)
    compare(cuda_ops["cp_fma"], lambda a, b, c: a * b + c, tensors, dtype)


def test_cuda_deterministic_backward_sums_with_aten(cuda_ops):
    x, s = torch.randn(8, 16, 5, 4, device="cuda"), torch.randn(1, 16, 1, 1, device="cuda", requires_grad=True)
    out = cuda_ops["cp_fma"].op(x, s, s)
    torch.use_deterministic_algorithms(True)
    try:
        names = _kernels_run(lambda: torch.autograd.grad(out, s, torch.ones_like(out), retain_graph=True))
        (g,) = torch.autograd.grad(out, s, torch.ones_like(out))
    finally:
        torch.use_deterministic_algorithms(False)
    assert not any("accumulating_kernel" in n for n in names), names
    torch.testing.assert_close(g, (x + 1).sum((0, 2, 3), keepdim=True))


def test_cuda_no_copy_of_strided_inputs(cuda_ops):
    x = torch.randn(8, 16, 9, 9, device="cuda").contiguous(memory_format=torch.channels_last)
    s = torch.randn(1, 16, 1, 1, device="cuda")
    t = torch.randn(64, 2 * 96, device="cuda")[:, ::2]
    for args in [(x, s, s), (t, t.t().t(), t[0])]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            cuda_ops["cp_fma"].op(*args)
        names = [e.name for e in prof.events()]
        assert not [n for n in names if n in ("aten::copy_", "aten::contiguous", "aten::clone", "aten::to")], names


def test_cuda_with_cpu_zero_dim_tensors_and_numbers(cuda_ops):
    """A 0-d CPU tensor (as eager allows) or a Python number for a tensor argument."""
    op = cuda_ops["cp_fma"]
    x = torch.randn(1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for s, b in [(torch.tensor(2.0), torch.tensor(1.0, dtype=torch.float64)), (2.0, 1), (torch.tensor(3), True)]:
        out = op(x, s, b)
        want = x * s + b
        assert out.device == x.device and out.dtype == want.dtype
        torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)
        (g,) = torch.autograd.grad(out, x, torch.ones_like(out))
        torch.testing.assert_close(g, torch.ones_like(x) * float(s))
    scale = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)  # CPU, gets a CPU gradient
    out = op(x.detach().float(), scale, 0.0)
    (gs,) = torch.autograd.grad(out.sum(), scale)
    assert gs.device.type == "cpu"
    torch.testing.assert_close(gs, x.detach().double().sum().cpu(), rtol=1e-2, atol=1e-1)


def test_cuda_integer_and_bool_inputs(cuda_ops):
    x = torch.randn(4097, device="cuda", requires_grad=True)
    mask, k = torch.rand(4097, device="cuda") > 0.5, torch.arange(4097, device="cuda")
    out = cuda_ops["cp_fma"](mask, x, k)
    torch.testing.assert_close(out, mask * x + k)
    (g,) = torch.autograd.grad(out, x, torch.ones_like(out))
    torch.testing.assert_close(g, mask.float())


def test_cuda_strided_past_2_31_elements(cuda_ops):
    """64-bit offsets: a stride-2 view of more than 2^31 elements (8 GiB of bf16)."""
    n = 2 ** 31 + 8
    base = torch.empty(2 * n, device="cuda", dtype=torch.bfloat16)
    base[::2] = 1.5
    base[1::2] = -7.0
    a = base[::2]
    out = cuda_ops["cp_fma"].op(a, torch.tensor(2.0), torch.tensor(1.0))
    assert out.shape == (n,) and out.is_contiguous()
    idx = torch.tensor([0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 1, n - 1], device="cuda")
    torch.testing.assert_close(out[idx].float(), torch.full((6,), 4.0, device="cuda"))
    del base, out
def test_cuda_contiguous_past_2_31_elements(cuda_ops):
    """The 16-byte unrolled kernel with 64-bit indices: a contiguous bf16 tensor of more than
    2^31 elements (4 GiB in, 4 GiB out)."""
    n = 2 ** 31 + 8 * 37 + 3
    x = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    x[: 2 ** 30] = 0.5
    x[2 ** 30:] = -1.25
    out = cuda_ops["cp_silu"].op(x)
    idx = torch.tensor([0, 2 ** 30 - 1, 2 ** 30, 2 ** 31 - 1, 2 ** 31, n - 2, n - 1], device="cuda")
    torch.testing.assert_close(out[idx], BY_NAME["cp_silu"].eager(x[idx]))
    del x, out


# -- higher order ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CORPUS, ids=repr)
def test_gradgradcheck_cuda(cuda_ops, case):
    """Second derivatives by the fused <name>_grad2_backward CUDA kernel, float64."""
    tensors = tuple(t.requires_grad_() for t in on_cuda(case, 6, torch.float64, seed=3))
    scalars = list(case.scalar_values)
    assert torch.autograd.gradgradcheck(lambda *t: cuda_ops[case.name](*t, *scalars), tensors,
                                        eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", [BY_NAME[n] for n in ("cp_silu", "cp_gelu_tanh", "cp_swish_beta", "cp_fma")],
                         ids=repr)
def test_forward_ad_and_torch_func_cuda(cuda_ops, case):
    tensors = on_cuda(case, 33, torch.float64, seed=4)
    scalars = list(case.scalar_values)
    tangents = [torch.randn_like(t) for t in tensors]
    got = torch.func.jvp(lambda *t: cuda_ops[case.name](*t, *scalars), tuple(tensors), tuple(tangents))
    want = torch.func.jvp(lambda *t: case.eager(*t, *scalars), tuple(tensors), tuple(tangents))
    torch.testing.assert_close(got, want)
    argnums = tuple(range(len(tensors)))
    got = torch.func.hessian(lambda *t: cuda_ops[case.name](*t, *scalars).sum(), argnums=argnums)(*tensors)
    want = torch.func.hessian(lambda *t: case.eager(*t, *scalars).sum(), argnums=argnums)(*tensors)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_gradient_penalty_step_cuda(cuda_ops, dtype):
    """The benchmark's gradient-penalty training step on the GPU matches eager step for step."""
    from fusegen.bench.core import GradientPenaltyMLP

    runs = []
    for silu, gelu in ((cuda_ops["cp_silu"], cuda_ops["cp_gelu_tanh"]),
                       (BY_NAME["cp_silu"].eager, BY_NAME["cp_gelu_tanh"].eager)):
        model = GradientPenaltyMLP(silu, gelu, width=64, features=8, device="cuda", dtype=dtype)
        g = torch.Generator().manual_seed(1)
        history = []
        for _ in range(5):
            history.append(model.step(torch.randn(256, 8, generator=g, dtype=dtype).cuda()))
        runs.append((history, [p.detach() for p in model.params]))
    tol = {} if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(runs[0][0], runs[1][0], **tol)
    for p, q in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(p, q, **tol)

"""On a GPU: ops that draw random numbers (torch.rand_like, F.dropout). The mask of every
kernel kind (contiguous 16-byte, vector with a broadcast bias, strided through a transposed
input, a misaligned slice) against eager's formula on that mask, forward and backward, in
every dtype, the bias's gradient summed in the backward kernel; the double backward; one
(seed, offset) draws the same bits whatever the layout; the statistics; torch.manual_seed
reproduces; CUDA graph capture draws fresh numbers on every replay and its backward
regenerates each replay's mask; torch.compile in both modes.

    PYTHONPATH=. python -m pytest -q -m cuda tests/gpu/test_random_cuda.py
"""

from __future__ import annotations

import math

import pytest
import torch

import fusegen
from helpers import philox_uniforms

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BDA = "torch.nn.functional.dropout(x + bias, p) + residual"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def op():
    return fusegen.fuse(BDA, name="gpu_bias_dropout_add", scalars=["p"])


def _layouts(dtype, rows=512, hidden=1024):
    dev = "cuda"
    x = torch.randn(rows, hidden, dtype=dtype, device=dev)
    b = torch.randn(hidden, dtype=dtype, device=dev)
    r = torch.randn(rows, hidden, dtype=dtype, device=dev)
    full_b = b.expand(rows, hidden).contiguous()
    return {
        "contiguous": (x, full_b, r),
        "bias": (x, b, r),
        "transposed": (x.t().contiguous().t(), b, r),
        "sliced": (torch.randn(rows, hidden + 1, dtype=dtype, device=dev)[:, 1:], b, r),
        "odd": (x[:, :1023], b[:1023], r[:, :1023]),
    }


def _mask(op, x, p, seed):
    """The mask the op draws under `seed` for x's shape: the same op on ones (its numbers
    depend on the seed, the offset and each element's place only) gives 1/(1-p) or 0."""
    torch.manual_seed(seed)
    ones = torch.ones(x.shape, dtype=x.dtype, device=x.device)
    return op(ones, torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device), torch.zeros_like(ones), p) != 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "bias", "transposed", "sliced", "odd"])
def test_forward_and_backward_on_the_kernels_mask(op, dtype, layout):
    x, b, r = (t.detach().requires_grad_() for t in _layouts(dtype)[layout])
    p = 0.3
    kept = _mask(op, x, p, 21)
    torch.manual_seed(21)
    y = op(x, b, r, p)
    frac = kept.float().mean().item()
    assert abs(frac - 0.7) < 5 * math.sqrt(0.21 / kept.numel())
    scale = 1 / (1 - p)
    want = ((x.float() + b.float()).to(dtype).float() * kept * scale + r.float()).to(dtype)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert torch.allclose(y.float(), want.float(), rtol=tol, atol=tol)
    g = torch.randn_like(y)
    gx, gb, gr = torch.autograd.grad(y, (x, b, r), g)
    expect = g.float() * kept * scale
    assert torch.allclose(gx.float(), expect.to(dtype).float(), rtol=tol, atol=tol)
    want_b = expect if b.shape == x.shape else expect.sum(0)
    assert torch.allclose(gb.float(), want_b, rtol=5e-2, atol=5e-2 * math.sqrt(x.shape[0]))
    assert torch.equal(gr, g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(512, 1024), (4, 128, 768), (8, 1000)])
def test_bias_gradient_is_summed_in_the_backward_kernel(op, dtype, shape):
    """x's gradient and bias's are one output of the backward: the accumulating kernel writes
    it and sums it over the rows at once (no ATen reduction runs), drawing the forward's
    numbers; against float64 sums of eager's formula on the forward's mask."""
    x = torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
    b = torch.randn(shape[-1], dtype=dtype, device="cuda", requires_grad=True)
    r = torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
    kept = _mask(op, x, 0.25, 3)
    torch.manual_seed(3)
    y = op(x, b, r, 0.25)
    g = torch.randn_like(y)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gx, gb, gr = torch.autograd.grad(y, (x, b, r), g)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("accumulating_kernel" in k for k in kernels), kernels
    assert not any("reduce_kernel" in k for k in kernels), kernels
    want = g.double() * kept / 0.75
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert torch.allclose(gx.double(), want.to(dtype).double(), rtol=tol, atol=tol)
    rows = x.numel() // shape[-1]
    sum_tol = 1e-5 * rows if dtype == torch.float32 else tol * math.sqrt(rows) + 1e-2
    assert torch.allclose(gb.double(), want.reshape(-1, shape[-1]).sum(0), rtol=1e-3, atol=sum_tol)
    assert gb.dtype == dtype and torch.equal(gr, g)


def test_double_backward_on_cuda(op):
    """A gradient penalty through dropout on the GPU: <name>_grad2_backward draws the
    forward's mask from the saved state, as on the CPU (tests/test_random.py)."""
    x, b, r = (t.double().requires_grad_() for t in _layouts(torch.float32)["bias"])
    y = op(x, b, r, 0.5)
    kept = ((y - r) != 0).double()
    g = torch.randn_like(y, requires_grad=True)
    gx, gb = torch.autograd.grad(y, (x, b), g, create_graph=True)
    dg, = torch.autograd.grad((gx * gx).sum() + (gb ** 3).sum(), g)
    g = g.detach()
    want = 2 * (g * kept * 2) * kept * 2 + 3 * ((g * kept * 2).sum(0) ** 2) * kept * 2
    assert torch.allclose(dg, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_seed_draws_the_same_bits_in_every_layout(op, dtype):
    outs = []
    for layout in ("contiguous", "bias", "transposed"):
        x, b, r = _layouts(dtype)[layout]
        x, b, r = x.float().to(dtype), b, r  # same values
        torch.manual_seed(11)
        outs.append(((op(x, b, r, 0.5).float() - r.float()) != 0))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "odd", "transposed"])
def test_the_numbers_are_philox_4x32_10(dtype, layout):
    # The device's Philox (32-bit multiplies) against the Python reference, for the state
    # each call drew with, on the 16-byte, scalar and strided kernels.
    fusegen.fuse("x + torch.rand_like(x)", name="gpu_uniform")
    sampled = torch.ops.fusegen.gpu_uniform_sampled.default
    x = {"contiguous": torch.zeros(8, 1024, dtype=dtype, device="cuda"),
         "odd": torch.zeros(7, 333, dtype=dtype, device="cuda"),
         "transposed": torch.zeros(1024, 8, dtype=dtype, device="cuda").t()}[layout]
    u, state = sampled(x)
    seed, offset = (int(v) & (2**64 - 1) for v in state.cpu())
    want = philox_uniforms(seed, offset, x.numel()).to(dtype).view(x.shape)
    assert torch.equal(u.cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "odd", "transposed"])
def test_a_dropout_keeps_where_its_16_bit_uniform_is_below_1_minus_p(op, dtype, layout):
    # The coarse stream (eight elements to a Philox block) on the 16-byte, scalar and
    # strided kernels, against the Python reference, at a p between two multiples of 2^-16.
    sampled = torch.ops.fusegen.gpu_bias_dropout_add_sampled.default
    shape = {"contiguous": (8, 1024), "odd": (7, 333), "transposed": (1024, 8)}[layout]
    x = torch.ones(shape, dtype=dtype, device="cuda")
    if layout == "transposed":
        x = x.t()
    b = torch.zeros(x.shape[-1], dtype=dtype, device="cuda")
    p = 0.5 + 2.0**-17
    y, state = sampled(x, b, torch.zeros_like(x), p)
    seed, offset = (int(v) & (2**64 - 1) for v in state.cpu())
    u = philox_uniforms(seed, offset, x.numel(), coarse=True).view(x.shape)
    assert torch.equal((y != 0).cpu(), u < 1 - p)


def test_statistics_reproducibility_and_fresh_draws(op):
    x = torch.zeros(1 << 22, device="cuda")
    u = fusegen.fuse("x + torch.rand_like(x)", name="gpu_uniform")(x)
    n = u.numel()
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    deciles = torch.histc(u, bins=10, min=0, max=1) / n
    assert (deciles - 0.1).abs().max().item() < 5 * math.sqrt(0.09 / n)
    x, b, r = _layouts(torch.float32)["bias"]
    torch.manual_seed(5)
    y1, y2 = op(x, b, r, 0.5), op(x, b, r, 0.5)
    torch.manual_seed(5)
    assert torch.equal(op(x, b, r, 0.5), y1) and not torch.equal(y1, y2)
    assert torch.equal(op(x, b, r, 0.0), x + b + r)
    assert torch.equal(op(x, b, r, 1.0), (x + b) * 0 + r)


def test_cuda_graph_replays_draw_fresh_masks_and_their_backward_follows(op):
    x, b, r = (t.clone().requires_grad_() for t in _layouts(torch.float32)["bias"])
    g = torch.randn(512, 1024, device="cuda")
    static = {}

    def step():
        y = op(x, b, r, 0.5)
        gx, gb = torch.autograd.grad(y, (x, b), g)  # bias's summed in the backward kernel
        static["y"], static["gx"], static["gb"] = y, gx, gb

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: the kernels compile on their first launch
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    masks = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        kept = (static["y"] - r) != 0
        assert torch.equal(static["gx"], g * kept * 2)
        assert torch.allclose(static["gb"], (g * kept * 2).sum(0), rtol=1e-4, atol=1e-4)
        masks.append(kept.clone())
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


@pytest.mark.parametrize("mode", ["decompose", "opaque"])
def test_compile_on_cuda(mode):
    op = fusegen.fuse(BDA, name=f"gpu_bda_{mode}", scalars=["p"], compile=mode)
    x, b, r = (t.clone().requires_grad_() for t in _layouts(torch.bfloat16)["bias"])
    f = torch.compile(lambda x, b, r: op(x, b, r, 0.2), fullgraph=True)
    y = f(x, b, r)
    kept = (y.float() - r.float()) != 0
    assert abs(kept.float().mean().item() - 0.8) < 0.01
    g = torch.randn_like(y)
    gx, = torch.autograd.grad(y, (x,), g)
    # the backward's mask is the forward's: where the gradient is dropped, so is the value
    # (y is exactly r there), and elsewhere the gradient is g / (1 - p)
    dropped = (gx == 0) & (g != 0)
    assert torch.equal(y[dropped], r[dropped])
    ratio = gx.float()[~dropped & (g != 0)] / g.float()[~dropped & (g != 0)]
    assert torch.allclose(ratio, torch.full_like(ratio, 1.25), rtol=1e-2)

"""Random numbers in an expression (torch.rand_like, F.dropout): the kernels' draws against
eager's formula on the same mask, their statistics, reproducibility under torch.manual_seed,
fresh numbers per call, and the errors of what is not supported."""

import math

import pytest
import torch
import torch.nn.functional as F

import fusegen
from fusegen.errors import FusegenError, ParseError, SpecError

from helpers import philox4x32_10, philox_uniforms

BDA = "torch.nn.functional.dropout(x + bias, p) + residual"


@pytest.fixture(scope="module")
def ops():
    return {
        "bda": fusegen.fuse(BDA, name="rnd_bias_dropout_add", scalars=["p"]),
        "rand": fusegen.fuse("x + torch.rand_like(x)", name="rnd_plus_uniform"),
        "two": fusegen.fuse("torch.rand_like(x) - torch.rand_like(x) + 0*x", name="rnd_two_streams"),
    }


def _args(dtype=torch.float64, rows=64, hidden=1000, grad=True):
    x = torch.randn(rows, hidden, dtype=dtype, requires_grad=grad)
    b = torch.randn(hidden, dtype=dtype, requires_grad=grad)
    r = torch.randn(rows, hidden, dtype=dtype, requires_grad=grad)
    return x, b, r


def test_the_numbers_are_philox_4x32_10(ops):
    # Random123's known answers for the reference, then the CPU kernel against it for the
    # state the call drew with (its seed is a full 64-bit one, its offset 0).
    assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    ones = 0xFFFFFFFF
    assert philox4x32_10((ones,) * 4, (ones, ones)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)
    sampled = torch.ops.fusegen.rnd_plus_uniform_sampled.default
    for dtype in (torch.float64, torch.float32):
        x = torch.zeros(3, 1001, dtype=dtype)
        u, state = sampled(x)
        seed, offset = (int(v) & (2**64 - 1) for v in state)
        want = philox_uniforms(seed, offset, x.numel()).to(dtype).view_as(x)
        assert torch.equal(u, want), dtype


def test_a_dropout_draws_16_bits_per_element(ops):
    """A dropout's stream only meets 1 - p: it keeps an element where the element's 16-bit
    uniform (eight to a Philox block) is below it, so p is resolved to 2^-16."""
    sampled = torch.ops.fusegen.rnd_bias_dropout_add_sampled.default
    for dtype in (torch.float64, torch.float32):
        x, b, r = torch.ones(3, 1001, dtype=dtype), torch.zeros(1001, dtype=dtype), torch.zeros(3, 1001, dtype=dtype)
        for p in (0.3, 0.5 + 2.0**-17):
            y, state = sampled(x, b, r, p)
            seed, offset = (int(v) & (2**64 - 1) for v in state)
            u = philox_uniforms(seed, offset, x.numel(), coarse=True).view_as(x)
            assert torch.equal(y != 0, u < 1 - p), (dtype, p)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_statistics_and_scale(ops, p):
    """The fraction kept is 1 - p within 5 standard deviations of a binomial over 2^20
    elements, and every kept element is (x + bias) / (1 - p), exactly as eager computes it."""
    x, b, r = _args(torch.float32, 1024, 1024, grad=False)
    y = ops["bda"](x, b, r, p)
    kept = (y - r) != 0
    n = kept.numel()
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    want = (x + b) * (1 / (1 - p)) + r
    assert torch.allclose(y[kept], want[kept], rtol=1e-6, atol=1e-6)
    assert torch.equal(y[~kept], r[~kept])


def test_uniforms_are_uniform(ops):
    """rand_like: values in [0, 1), mean 1/2 and variance 1/12 within 5 standard errors, the
    deciles each near a tenth, and two streams of one op independent (their correlation)."""
    x = torch.zeros(1 << 20)
    u = ops["rand"](x)
    assert u.min() >= 0 and u.max() < 1
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    deciles = torch.histc(u, bins=10, min=0, max=1) / n
    assert (deciles - 0.1).abs().max() < 5 * math.sqrt(0.09 / n)
    d = ops["two"](x)  # u0 - u1: mean 0, variance 1/6 when independent
    assert abs(d.var().item() - 1 / 6) < 5 * math.sqrt(0.03 / n)


def test_manual_seed_reproduces_and_calls_draw_fresh(ops):
    x, b, r = _args()
    torch.manual_seed(7)
    y1 = ops["bda"](x, b, r, 0.5)
    y2 = ops["bda"](x, b, r, 0.5)
    torch.manual_seed(7)
    assert torch.equal(ops["bda"](x, b, r, 0.5), y1)
    assert not torch.equal(y1, y2)
    assert torch.equal(ops["bda"](x, b, r, 0.5), y2)  # the generator moved on as before


def test_backward_is_eager_formula_on_the_same_mask(ops):
    """The backward regenerates the forward's mask: d/dx = grad * mask / (1 - p), d/dbias its
    sum over rows, d/dresidual = grad, in float64; and each call's own mask."""
    x, b, r = _args()
    p = 0.3
    for _ in range(2):
        y = ops["bda"](x, b, r, p)
        mask = ((y - r) != 0).double()
        g = torch.randn_like(y)
        gx, gb, gr = torch.autograd.grad(y, (x, b, r), g)
        assert torch.allclose(gx, g * mask / (1 - p), rtol=1e-15, atol=0)
        assert torch.allclose(gb, (g * mask / (1 - p)).sum(0), rtol=1e-12)
        assert torch.equal(gr, g)


def test_backward_through_a_layout_the_forward_did_not_have(ops):
    """The numbers are those of each element's place in the broadcast shape: a transposed
    input draws what a contiguous one does, and a backward whose dout is transposed still
    finds its forward's mask."""
    x, b, r = _args(grad=False)
    xt = x.t().contiguous().t()  # same values, column-major
    torch.manual_seed(3)
    y1 = ops["bda"](x, b, r, 0.5)
    torch.manual_seed(3)
    y2 = ops["bda"](xt, b, r, 0.5)
    assert torch.equal(y1, y2)
    x.requires_grad_()
    y = ops["bda"](x, b, r, 0.5)
    mask = (y - r) != 0
    g = torch.randn(y.shape[1], y.shape[0], dtype=y.dtype).t()
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(gx, g * mask.double() * 2)


def test_the_numbers_are_the_same_on_any_number_of_threads(ops):
    """The CPU loop splits a random op's elements over threads as any op's: each run draws
    by its place in the output, so one thread and four give the same bits, forward and
    backward, for contiguous and column-major inputs alike."""
    x, b, r = _args(torch.float32, 1024, 1000, grad=False)  # 2^20 elements: many runs
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 4):
            torch.set_num_threads(n)
            for xs in (x, x.t().contiguous().t()):
                xs = xs.detach().requires_grad_()
                torch.manual_seed(11)
                y = ops["bda"](xs, b, r, 0.5)
                (gx,) = torch.autograd.grad(y, xs, torch.ones_like(y))
                results.append((y, gx))
    finally:
        torch.set_num_threads(threads)
    for y, gx in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(gx, results[0][1])
    assert ((results[0][0] - r) == 0).float().mean().item() == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(ops, dtype):
    x, b, r = _args(dtype, 128, 512, grad=False)
    y = ops["bda"](x, b, r, 0.25)
    assert y.dtype == dtype
    kept = (y - r).float() != 0
    want = ((x.float() + b.float()) * (1 / 0.75)).to(dtype).float() + r.float()
    assert torch.allclose(y.float()[kept], want.to(dtype).float()[kept], rtol=1e-2, atol=1e-2)


def test_p_zero_is_the_identity_and_p_one_drops_everything(ops):
    x, b, r = _args()
    assert torch.equal(ops["bda"](x, b, r, 0.0), x + b + r)
    assert torch.equal(ops["bda"](x, b, r, 1.0), (x + b) * 0 + r)
    (gx,) = torch.autograd.grad(ops["bda"](x, b, r, 1.0).sum(), x)
    assert torch.equal(gx, torch.zeros_like(x))


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_p_outside_0_1_is_refused(ops, p):
    x, b, r = _args()
    with pytest.raises(RuntimeError, match="argument 'p' is a dropout probability"):
        ops["bda"](x, b, r, p)


def test_constant_p_and_training_flag():
    """p as a literal, training=False as the input itself, and a @fused function's
    `training: bool` as a scalar (True draws, False is the identity)."""
    off = fusegen.fuse("F.dropout(x, 0.5, training=False) * 2", name="rnd_eval_mode")
    x = torch.randn(100, dtype=torch.float64)
    assert torch.equal(off(x), x * 2)

    @fusegen.fused
    def rnd_flagged(x, p: float, training: bool):
        return F.dropout(x, p, training) + 1

    y = rnd_flagged(x, 0.5, True)
    assert ((y - 1) == 0).any() and torch.equal(rnd_flagged(x, 0.5, False), x + 1)


def test_parse_errors():
    with pytest.raises(ParseError, match="between 0 and 1"):
        fusegen.fuse("F.dropout(x, 1.5)", name="rnd_bad_p")
    with pytest.raises(ParseError, match="one tensor argument"):
        fusegen.fuse("torch.rand_like(x, dtype=float)", name="rnd_bad_kw")
    with pytest.raises(ParseError, match="in place"):
        fusegen.fuse("F.dropout(x, 0.1, inplace=True)", name="rnd_inplace")
    with pytest.raises(SpecError, match="must be a scalar argument"):
        fusegen.fuse("F.dropout(x, p)", name="rnd_tensor_p")
    with pytest.raises(SpecError, match="reduces over the last dimension"):
        fusegen.fuse("F.dropout(x, 0.1) / x.sum(-1, keepdim=True)", name="rnd_rows")
    with pytest.raises(ParseError, match="randn_like is not supported"):
        fusegen.fuse("torch.randn_like(x)", name="rnd_normal")


def test_double_backward_draws_the_forwards_numbers(ops):
    """A gradient penalty through dropout: the second derivative (<name>_grad2_backward)
    regenerates the forward's mask from the saved state, so it equals eager's formula on
    that mask, in float64; gradgradcheck with the seed set inside the function."""
    x, b, r = _args()
    y = ops["bda"](x, b, r, 0.5)
    kept = ((y - r) != 0).double()
    g = torch.randn_like(y, requires_grad=True)  # a gradient penalty's dout
    gx, gb = torch.autograd.grad(y, (x, b), g, create_graph=True)
    dg, = torch.autograd.grad((gx * gx).sum() + (gb ** 3).sum(), g)
    g = g.detach()
    want = 2 * (g * kept * 2) * kept * 2 + 3 * ((g * kept * 2).sum(0) ** 2) * kept * 2
    assert torch.allclose(dg, want, rtol=1e-12, atol=1e-12)

    def seeded(x, b, r):
        torch.manual_seed(5)
        return ops["bda"](x, b, r, 0.3)
    small = [t[..., :8].detach().requires_grad_() for t in (x[:4], b, r[:4])]
    assert torch.autograd.gradgradcheck(seeded, small)


def test_higher_orders_and_transforms_are_refused(ops):
    x, b, r = _args()
    y = ops["bda"](x, b, r, 0.5)
    g = torch.randn_like(y, requires_grad=True)
    gx, = torch.autograd.grad(y, x, g, create_graph=True)
    h, = torch.autograd.grad((gx * gx).sum(), g, create_graph=True)  # the second: fused
    assert torch.allclose(h, 2 * g * ((y - r) != 0) * 4)
    with pytest.raises((RuntimeError, FusegenError), match="third derivative"):
        torch.autograd.grad(h.sum(), g)
    with pytest.raises((RuntimeError, FusegenError), match="random numbers"):
        torch.func.jvp(lambda t: ops["bda"](t, b, r, 0.5), (x.detach(),), (torch.ones_like(x),))
    with pytest.raises((RuntimeError, FusegenError), match="random numbers"):
        torch.func.vmap(lambda t: ops["bda"](t, b, r, 0.5))(x.detach()[None])


def test_schema_and_tags(ops):
    op = torch.ops.fusegen.rnd_bias_dropout_add.default
    assert torch.Tag.nondeterministic_seeded in op.tags
    sampled = torch.ops.fusegen.rnd_bias_dropout_add_sampled.default
    x, b, r = _args(grad=False)
    out, state = sampled(x, b, r, 0.5)
    assert state.dtype == torch.int64 and state.shape == (2,)
    g = torch.randn_like(out)
    (gx,) = torch.ops.fusegen.rnd_bias_dropout_add_backward(g, state, 0.5, [True])
    assert torch.equal(gx, g * ((out - r) != 0) * 2)


@pytest.mark.parametrize("mode", ["decompose", "opaque"])
def test_compile(mode):
    """Under torch.compile: decompose draws with torch's random ops (the same distribution,
    other bits), opaque keeps the kernel and its backward's regenerated mask."""
    op = fusegen.fuse(BDA, name=f"rnd_bda_{mode}", scalars=["p"], compile=mode)
    x, b, r = _args(torch.float32, 256, 256)
    f = torch.compile(lambda x, b, r: op(x, b, r, 0.4), backend="aot_eager", fullgraph=True)
    y = f(x, b, r)
    kept = (y - r) != 0
    assert abs(kept.float().mean().item() - 0.6) < 0.02
    g = torch.randn_like(y)
    gx, gb = torch.autograd.grad(y, (x, b), g)
    assert torch.allclose(gx, g * kept / 0.6, rtol=1e-5, atol=1e-6)
    assert not torch.equal(f(x, b, r), y)  # fresh numbers on every compiled call

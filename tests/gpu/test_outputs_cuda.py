"""On a GPU: an op of several outputs (RoPE's pair) through every kernel kind, both
compilers (NVRTC and nvcc give the same bits), every dtype, against eager in float64; an
output left out of the loss counts as zero; torch.compile's graph holds the op."""

from __future__ import annotations

import pytest
import torch

import fusegen

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROPE = "(x1*c - x2*s, x2*c + x1*s)"
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2),
       torch.float16: (2e-3, 2e-3)}


def rope_eager(x1, c, x2, s):
    return x1 * c - x2 * s, x2 * c + x1 * s


@pytest.fixture(scope="module")
def ops(monkeypatch_module):
    built = {}
    for route in ("nvrtc", "nvcc"):
        monkeypatch_module.setenv("FUSEGEN_CUDA_COMPILER", route)
        built[route] = fusegen.fuse(ROPE, name=f"test_rope_cuda_{route}", inputs="x1,c,x2,s")
    return built


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _layouts(dtype):
    """(name, x1, c, x2, s): contiguous; Llama's layout (the halves of q, cos/sin per
    position broadcast over heads); transposed; misaligned."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    q = r(2, 8, 256, 128)
    x1, x2 = q.chunk(2, -1)
    return [
        ("contiguous", r(4096, 129), r(4096, 129), r(4096, 129), r(4096, 129)),
        ("rope_halves", x1, r(256, 64), x2, r(256, 64)),
        ("transposed", r(512, 384).t(), r(384, 512), r(384, 512), r(384, 512)),
        ("misaligned", r(1 << 16 | 1)[1:], r(1 << 16), r(1 << 16), r(1 << 16)),
    ]


def _run(op, xs, douts):
    leaves = [x.detach().requires_grad_() for x in xs]
    out = op(*leaves)
    grads = torch.autograd.grad(out, leaves, douts)
    torch.cuda.synchronize()
    return list(out) + list(grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_eager_and_both_routes_agree(ops, dtype):
    torch.use_deterministic_algorithms(True)  # broadcast gradients: summed by ATen, in order
    try:
        for name, *xs in _layouts(dtype):
            shape = torch.broadcast_shapes(*(x.shape for x in xs))
            g = torch.Generator(device="cuda").manual_seed(1)
            douts = [torch.randn(shape, device="cuda", generator=g).to(dtype) for _ in range(2)]
            got = {route: _run(op, xs, douts) for route, op in ops.items()}
            for a, b in zip(got["nvrtc"], got["nvcc"]):
                assert torch.equal(a, b), name
            want = _run(rope_eager, [x.double() for x in xs], [d.double() for d in douts])
            rtol, atol = TOL[dtype]
            for k, (a, w) in enumerate(zip(got["nvrtc"], want)):
                scale = max(1.0, float(w.detach().abs().max()))
                torch.testing.assert_close(a.double(), w, rtol=rtol, atol=atol * scale,
                                           msg=lambda m: f"{name}, result {k}: {m}")
    finally:
        torch.use_deterministic_algorithms(False)


def test_an_unused_output_counts_as_zero(ops):
    xs = [torch.randn(1000, device="cuda") for _ in range(4)]
    a = [x.clone().requires_grad_() for x in xs]
    b = [x.clone().requires_grad_() for x in xs]
    got = torch.autograd.grad(ops["nvrtc"](*a)[1].sum(), a)
    want = torch.autograd.grad(rope_eager(*b)[1].sum(), b)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_compile_keeps_the_op(ops):
    op = ops["nvrtc"]
    torch._dynamo.reset()
    xs = [torch.randn(64, 128, device="cuda", requires_grad=True) for _ in range(4)]
    compiled = torch.compile(lambda *t: op(*t), fullgraph=True)
    out = compiled(*xs)
    for o, w in zip(out, rope_eager(*xs)):
        torch.testing.assert_close(o, w)
    sum(o.sum() for o in out).backward()
    assert all(x.grad is not None for x in xs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_joined_by_cat_on_llama_halves(dtype):
    op = fusegen.fuse("torch.cat((x1*c - x2*s, x2*c + x1*s), -1)", name="test_rope_cat_cuda",
                      inputs="x1,x2,c,s")
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(2, 8, 256, 128, device="cuda", generator=g).to(dtype)
    c, s = (torch.randn(256, 64, device="cuda", generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(q.shape, device="cuda", generator=g).to(dtype)

    def eager(q, c, s):
        x1, x2 = q.chunk(2, -1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    a = [t.clone().requires_grad_() for t in (q, c, s)]
    b = [t.double().requires_grad_() for t in (q, c, s)]
    got = op(*a[0].chunk(2, -1), a[1], a[2])
    want = eager(*b)
    assert got.shape == q.shape and got.is_contiguous()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * 4)
    for x, w in zip(torch.autograd.grad(got, a, dout), torch.autograd.grad(want, b, dout.double())):
        scale = max(1.0, float(w.detach().abs().max()))
        torch.testing.assert_close(x.double(), w, rtol=rtol, atol=atol * scale)

"""What every numeric test shares: the forward-and-backward oracle, the comparisons against
eager (values within tolerance, layouts, special values point by point), the error measure
and the tolerances. CPU and CUDA tests import these; nothing else defines them."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# assert_close tolerances for the dtypes fusegen must match to rounding.
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-5)}
# fp16/bf16: the fused error against a float64 reference is at most LOW_SLACK times eager's
# in the same dtype plus LOW_FLOOR (fused rounds once at the end, eager after every step).
LOW_SLACK, LOW_FLOOR = 1.5, 2e-3


def forward_backward(f, tensors, scalars=(), grad=None, grad_seed=7, requires=None, grad_dtype=None):
    """f(*tensors, *scalars) and the gradient of every tensor that requires it, for one
    incoming gradient (a tensor, or a number for that value everywhere; random from
    `grad_seed` unless given, rounded to `grad_dtype` first
    where given: a float64 reference of a bf16 call then sees the bf16 call's very
    gradient; unrounded, a sum of 4480 products with much cancellation, a 0-d scale's
    gradient, differed by 3 % from the exact sum for the bf16 gradient). Unused inputs get
    zeros."""
    requires = [True] * len(tensors) if requires is None else requires
    leaves = [t.detach().clone().requires_grad_(r) for t, r in zip(tensors, requires)]
    out = f(*leaves, *scalars)
    if grad is None:
        g = torch.Generator().manual_seed(grad_seed)
        grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
        grad = grad.to(grad_dtype or grad.dtype).to(out.device, out.dtype)
    elif not isinstance(grad, torch.Tensor):
        grad = torch.full_like(out, grad)
    wrt = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(out, wrt, grad, allow_unused=True) if wrt else []
    return out.detach(), [gr if gr is not None else torch.zeros_like(t) for gr, t in zip(grads, wrt)]


class FusegenCalls(TorchDispatchMode):
    """Records the fusegen ops that run (below autograd, so the kernels), in order: `names`."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusegen":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float64."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def assert_no_worse_than_eager(what: str, got, eager, ref):
    """Low precision: fused error vs the float64 reference within LOW_SLACK x eager's + LOW_FLOOR."""
    if ref.numel() == 0 or ref.norm() == 0:  # e.g. a gradient that is zero everywhere
        assert got.numel() == 0 or got.abs().max() == 0, what
        return
    bound = LOW_SLACK * rel_error(eager, ref) + LOW_FLOOR
    assert rel_error(got, ref) <= bound, f"{what}: {rel_error(got, ref):.2e} > {bound:.2e}"


def same_layout(got: torch.Tensor, want: torch.Tensor, what: str):
    """The device, shape, dtype, strides and (4-d) memory format eager gives."""
    assert (got.device, got.shape, got.dtype) == (want.device, want.shape, want.dtype), \
        (what, got.device, want.device, got.shape, want.shape, got.dtype, want.dtype)
    assert got.stride() == want.stride(), (what, got.stride(), want.stride())
    if got.dim() == 4:
        for fmt in (torch.contiguous_format, torch.channels_last):
            assert got.is_contiguous(memory_format=fmt) == want.is_contiguous(memory_format=fmt), (what, fmt)


def compare(op, eager, tensors, dtype=None, scalars=(), requires=None, what="op", layout=True):
    """`op` against `eager`, forward and backward: the output's and every gradient's device,
    shape and dtype are eager's, and with `layout` their strides and memory format too; the
    values are within TOL (float64, float32) or, for bf16/fp16, no worse than eager's against
    a float64 reference. `dtype` picks the tolerance (default: the first tensor's)."""
    dtype = dtype or tensors[0].dtype
    got, got_grads = forward_backward(op, tensors, scalars, requires=requires)
    want, want_grads = forward_backward(eager, tensors, scalars, requires=requires)
    names = ["forward"] + [f"gradient {k}" for k in range(len(got_grads))]
    assert len(got_grads) == len(want_grads), what
    for name, g, w in zip(names, [got] + got_grads, [want] + want_grads):
        if layout:
            same_layout(g, w, f"{what} {name}")
        else:
            assert (g.device, g.shape, g.dtype) == (w.device, w.shape, w.dtype), (what, name, g.shape, w.shape)
    if dtype in TOL:
        for name, g, w in zip(names, [got] + got_grads, [want] + want_grads):
            torch.testing.assert_close(g, w, **TOL[dtype], msg=lambda m: f"{what} {name}: {m}")
        return
    ref, ref_grads = forward_backward(eager, [t.double() for t in tensors], scalars, requires=requires,
                                      grad_dtype=dtype)
    for name, g, w, r in zip(names, [got] + got_grads, [want] + want_grads, [ref] + ref_grads):
        assert_no_worse_than_eager(f"{what} {name}", g, w, r)


# -- special values, point by point ---------------------------------------------------------------

def forward_backward_named(f, tensors: dict[str, torch.Tensor], strided=False):
    """f(**tensors) and d/d<each> for grad = 1. A gradient f does not produce is None. With
    `strided`, the same values go in as strided views: eager's scalar (non-vectorized) CPU
    loops instead of its vectorized ones."""
    leaves = {}
    for k, t in tensors.items():
        if strided:
            leaves[k] = torch.zeros(2 * t.numel(), dtype=t.dtype)[::2].copy_(t).requires_grad_(True)
        else:
            leaves[k] = t.detach().clone().requires_grad_(True)
    out = f(**leaves)
    if not out.requires_grad:
        return out.detach(), {k: None for k in leaves}
    grads = torch.autograd.grad(out, list(leaves.values()), torch.ones_like(out), allow_unused=True)
    return out.detach(), dict(zip(leaves, grads))


def same_bits(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same value, NaN matching NaN, zeros of the same sign."""
    return ((x == y) & (torch.signbit(x) == torch.signbit(y))) | (x.isnan() & y.isnan())


def kind(x: torch.Tensor) -> torch.Tensor:
    """0 NaN, 1 ±inf, 2 zero, 3 finite nonzero: what must agree between eager's two paths."""
    return torch.where(x.isnan(), 0, torch.where(x.isinf(), 1, torch.where(x == 0, 2, 3)))


def point_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """`a=0.5, b=-0.0` for each point of 1-d inputs, for the messages of `mismatches`."""
    columns = {k: t.flatten().tolist() for k, t in tensors.items()}
    n = len(next(iter(columns.values()))) if columns else 0
    return [", ".join(f"{k}={v[i]!r}" for k, v in columns.items()) for i in range(n)]


def mismatches(what: str, got, want, want_alt, points: list[str], dtype, rtol: float,
               signed_zeros: bool = True, unchosen_branches: bool = False) -> list[str]:
    """One line per point where `got` (fusegen) differs from `want` (eager); `want_alt` is
    eager through its other (strided) path, None for no gradient.

    - NaN must be NaN, ±inf the same inf, 0 must be 0: special values are exact.
    - The sign of a zero must match eager's where eager's two paths agree on it
      (`signed_zeros`); a gradient eager does not produce is a zero of either sign.
    - Where eager's two paths disagree beyond that (`kind`), eager is nondeterministic: skipped.
    - A subnormal against an eager 0 is rounding at the bottom of the range, not a special value.
    - Finite nonzero values: within `rtol` relative, plus the smallest normal number.
    - `unchosen_branches`: an expression with `where` may keep a finite gradient where eager's
      is NaN (0 * inf from the masked-out branch), the documented difference."""
    n = len(points)
    if want is None:  # eager has no gradient: any zero
        want, want_alt, any_sign = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype), torch.ones(n, dtype=torch.bool)
    else:
        any_sign = ~same_bits(want, want_alt) & (want == 0) & (want_alt == 0)
    if not signed_zeros:
        any_sign = torch.ones(n, dtype=torch.bool)
    if got is None:
        got = torch.zeros(n, dtype=dtype)
    got, want, want_alt = got.broadcast_to(want.shape).flatten(), want.flatten(), want_alt.flatten()
    if got.dtype != want.dtype:
        return [f"{what}: dtype {got.dtype}, eager {want.dtype}"]
    skip = kind(want) != kind(want_alt)
    if unchosen_branches and what != "forward":
        skip |= want.isnan() & torch.isfinite(got)
    tiny = torch.finfo(dtype).tiny
    subnormal = (got != 0) & (got.abs() < tiny)
    close = (got - want).abs() <= rtol * want.abs() + tiny
    ok = torch.where(want.isnan() | want.isinf(), same_bits(got, want),
                     torch.where(want == 0, ((got == 0) & (any_sign | same_bits(got, want))) | subnormal,
                                 torch.isfinite(got) & close))
    bad = (~ok & ~skip).nonzero().flatten().tolist()
    return [f"{what} at {points[i]}: fusegen {got[i].item()!r}, eager {want[i].item()!r}" for i in bad]


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    """Philox4x32-10 in Python integers (Salmon et al.; Random123's known answers in
    tests/test_random.py): the reference for the kernels' random numbers."""
    m = 0xFFFFFFFF
    (c0, c1, c2, c3), (k0, k1) = counter, key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & m, (p0 >> 32) ^ c3 ^ k1, p0 & m
        k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
    return c0, c1, c2, c3


def philox_uniforms(seed: int, offset: int, n: int, stream: int = 0, coarse: bool = False) -> torch.Tensor:
    """The uniforms of elements 0..n-1 of `stream` for a call that drew with (seed, offset),
    as docs/random.md defines them, in float64 (each is exact in float32 too). coarse: a
    dropout's stream, 16 bits per element."""
    m, s = 0xFFFFFFFF, offset + stream
    per = 8 if coarse else 4
    words = []
    for group in range((n + per - 1) // per):
        words += philox4x32_10((group & m, group >> 32, s & m, s >> 32), (seed & m, (seed >> 32) & m))
    if coarse:
        halves = [h for w in words for h in (w & 0xFFFF, w >> 16)]
        return torch.tensor(halves[:n], dtype=torch.float64) * 2.0**-16
    return torch.tensor([w >> 8 for w in words[:n]], dtype=torch.float64) * 2.0**-24

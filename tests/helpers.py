"""What every numeric test shares: the forward-and-backward oracle, the error measure and
the tolerances. CPU and CUDA tests import these; nothing else defines them."""

from __future__ import annotations

import torch

# assert_close tolerances for the dtypes fusegen must match to rounding.
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-5)}
# fp16/bf16: the fused error against a float64 reference is at most LOW_SLACK times eager's
# in the same dtype plus LOW_FLOOR (fused rounds once at the end, eager after every step).
LOW_SLACK, LOW_FLOOR = 1.5, 2e-3


def forward_backward(f, tensors, scalars=(), grad=None, grad_seed=7, requires=None, grad_dtype=None):
    """f(*tensors, *scalars) and the gradient of every tensor that requires it, for one
    incoming gradient (random from `grad_seed` unless given, rounded to `grad_dtype` first
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
    wrt = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(out, wrt, grad, allow_unused=True) if wrt else []
    return out.detach(), [gr if gr is not None else torch.zeros_like(t) for gr, t in zip(grads, wrt)]


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

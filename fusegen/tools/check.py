"""`fusegen --check`: the op against eager PyTorch, forward, backward and (float64) the
second derivative (the fused double backward, `<name>_grad2_backward`).

The oracle is the expression as the user wrote it (`op.spec.text`), evaluated by eager
PyTorch in float64 (reference.evaluate_text), with torch.autograd for the gradients: not
fusegen's own simplified sympy form, so a rewrite that changes a value (`a*0 -> 0` at
a = inf, where eager gives NaN) shows up as a failure instead of agreeing with itself.

fp64 and fp32 must match to rounding; bf16/fp16 must be no less accurate than eager
PyTorch in the same dtype (both measured against the float64 reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusegen.tools.reference import evaluate_text

# Relative error norm allowed against the float64 reference.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
# Low precision: fused error <= SLACK * eager error + FLOOR (eager rounds every step, the
# fused kernel only once at the end, so it is usually more accurate, never much worse).
LOW_PRECISION_SLACK, LOW_PRECISION_FLOOR = 1.5, 1e-3


@dataclass
class CheckResult:
    what: str
    error: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.error <= self.bound

    def __str__(self):
        return f"{'ok  ' if self.ok else 'FAIL'} {self.what:28s} rel. error {self.error:.2e} (bound {self.bound:.1e})"


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| over finite reference entries; NaN/inf must match exactly."""
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite) or not torch.equal(got[~finite].nan_to_num(), want[~finite].nan_to_num()):
        return float("inf")
    diff = (got[finite] - want[finite]).norm().item()
    return diff / max(want[finite].norm().item(), 1e-30)


def sample_inputs(op, n: int, device, dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    tensors = []
    for _ in op.spec.inputs:
        # Half the elements positive in [0.1, 2] (log, sqrt, pow), half standard normal.
        x = torch.where(torch.rand(n, generator=g) < 0.5, 0.1 + 1.9 * torch.rand(n, generator=g),
                        torch.randn(n, generator=g))
        tensors.append(x.to(device=device, dtype=dtype))
    scalars = [0.5 + 0.25 * k for k in range(len(op.spec.scalars))]
    return tensors, scalars


def _forward_backward(f, tensors, scalars, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = f(*leaves, *scalars)
    if not out.requires_grad:  # e.g. `a < b`: eager has no graph, every gradient is zero
        return out.detach(), [torch.zeros_like(t) for t in leaves]
    grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return out.detach(), [gr if gr is not None else torch.zeros_like(t) for gr, t in zip(grads, leaves)]


def _second_order(f, tensors, scalars, grad, weights):
    """d/dx of sum_k weights_k * grad_k, where grad_k = d(grad . out)/dx_k (create_graph)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    zeros = [torch.zeros_like(t) for t in leaves]
    out = f(*leaves, *scalars)
    if not out.requires_grad:
        return zeros
    grads = torch.autograd.grad(out, leaves, grad, create_graph=True, allow_unused=True)
    terms = [(g * w).sum() for g, w in zip(grads, weights) if g is not None and g.requires_grad]
    if not terms:
        return zeros
    second = torch.autograd.grad(sum(terms), leaves, allow_unused=True)
    return [z if s is None else s for s, z in zip(second, zeros)]


def check(op, device="cpu", n: int = 4099, dtypes=(torch.float64, torch.float32, torch.bfloat16)) -> list[CheckResult]:
    spec = op.spec

    def eager(*args):
        return evaluate_text(spec.text, dict(zip(spec.inputs + spec.scalars, args)))

    results = []
    base, scalars = sample_inputs(op, n, device, torch.float64)
    grad64 = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    ref_out, ref_grads = _forward_backward(eager, base, scalars, grad64)
    for dtype in dtypes:
        tensors = [t.to(dtype) for t in base]
        out, grads = _forward_backward(op, tensors, scalars, grad64.to(dtype))
        label = str(dtype).replace("torch.", "")
        if dtype in TOLERANCE:
            bounds = [TOLERANCE[dtype]] * (1 + len(grads))
        else:
            e_out, e_grads = _forward_backward(eager, tensors, scalars, grad64.to(dtype))
            bounds = [LOW_PRECISION_SLACK * rel_error(e, r) + LOW_PRECISION_FLOOR
                      for e, r in zip([e_out] + e_grads, [ref_out] + ref_grads)]
        results.append(CheckResult(f"{label} forward", rel_error(out, ref_out), bounds[0]))
        for name, got, want, bound in zip(spec.inputs, grads, ref_grads, bounds[1:]):
            results.append(CheckResult(f"{label} d/d{name}", rel_error(got, want), bound))
    if torch.float64 in dtypes:
        weights = [torch.randn(n, generator=torch.Generator().manual_seed(2 + k), dtype=torch.float64).to(device)
                   for k in range(len(base))]
        got = _second_order(op, base, scalars, grad64, weights)
        want = _second_order(eager, base, scalars, grad64, weights)
        for name, g, w in zip(spec.inputs, got, want):
            results.append(CheckResult(f"float64 2nd order d/d{name}", rel_error(g, w), TOLERANCE[torch.float64]))
    return results

"""On a GPU: an op used in forward and backward compiles none of its auxiliary ops' CUDA
units; the first double backward and the first jvp on CUDA tensors build them and match
eager in float64."""

from __future__ import annotations

import pytest
import torch
from torch.func import jvp

import fusegen
from fusegen.pytorch import autograd

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _eager(x, y):
    return torch.tanh(x) * y * 0.75 + x * x


def test_cuda_auxiliary_ops_on_first_use():
    op = fusegen.fuse("tanh(x)*y*alpha + x*x", name="lzc_op", scalars=["alpha"])
    x, y = (torch.randn(1000, device="cuda", requires_grad=True) for _ in range(2))
    op(x, y, alpha=0.75).sum().backward()
    torch.cuda.synchronize()
    assert {"lzc_op_grad2", "lzc_op_jvp"} <= set(autograd.pending_auxiliary())
    assert not any(name.endswith(".cu") and "lzc_op_" in name for name in op.generated.own_files)
    a, b = (torch.randn(64, device="cuda", dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradgradcheck(lambda s, t: torch.ops.fusegen.lzc_op(s, t, 0.75), (a, b))
    assert "lzc_op_grad2" not in autograd.pending_auxiliary()
    ta, tb = torch.randn_like(a), torch.randn_like(b)
    got = jvp(lambda s, t: op(s, t, alpha=0.75), (a.detach(), b.detach()), (ta, tb))
    want = jvp(_eager, (a.detach(), b.detach()), (ta, tb))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert "lzc_op_jvp" not in autograd.pending_auxiliary()


def test_an_op_used_on_cuda_alone_never_builds_its_cpu_kernels():
    """On the NVRTC route a new op's library is its descriptor alone (OpDef::cpu_later): an
    op used on CUDA builds no CPU kernel; its first CPU call builds the op whole, once, and
    both devices match eager in float64."""
    from fusegen.build import builder
    op = fusegen.fuse("x*sigmoid(x)*alpha + y", name="lzc_cpu", scalars=["alpha"])
    entry = op.library.path.parent
    assert (entry / builder.CPU_LATER_MARK).is_file()
    x, y = (torch.randn(1000, device="cuda", dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = op(x, y, alpha=0.5)
    torch.testing.assert_close(out, x * torch.sigmoid(x) * 0.5 + y)
    out.sum().backward()
    assert "lzc_cpu" in builder._CPU_LATER  # still later: nothing has run on the CPU
    a, b = (t.detach().cpu().requires_grad_() for t in (x, y))
    got = op(a, b, alpha=0.5)
    torch.testing.assert_close(got, a * torch.sigmoid(a) * 0.5 + b)
    got.sum().backward()
    torch.testing.assert_close(a.grad, x.grad.cpu())
    assert "lzc_cpu" not in builder._CPU_LATER

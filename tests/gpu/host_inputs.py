"""What an autograd round trip costs per input that requires grad: host
µs per forward + torch.autograd.grad at n = 64 (the host path alone), of fusegen's a*b+c
and of one ATen op of three inputs (torch.addcmul), with 1, 2 or 3 inputs requiring grad,
against PyTorch's floor (x*2). Runs on the GPU or the CPU.

    PYTHONPATH=. python3 tests/gpu/host_inputs.py
"""
import torch

import fusegen
from fusegen.bench.core import host_median_us

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.set_num_threads(1)
fma = fusegen.fuse("a*b+c", name="host_fma")


def us(fn):
    return host_median_us(fn, device, calls=3000, repeats=7)


n = 64
x = torch.randn(n, device=device, requires_grad=True)
g = torch.randn(n, device=device)
floor = us(lambda: torch.autograd.grad(x * 2, x, g))
print(f"{device}, n = {n}: floor (x*2 and torch.autograd.grad) {floor:.1f} us")
for impl, f in (("fusegen a*b+c", fma.op), ("torch.addcmul", lambda a, b, c: torch.addcmul(c, a, b))):
    for k in (1, 2, 3):
        xs = [torch.randn(n, device=device, requires_grad=i < k) for i in range(3)]
        wrt = xs[:k]
        t = us(lambda: torch.autograd.grad(f(*xs), wrt, g))
        print(f"  {impl:14s} {k} input(s) requiring grad: {t:6.1f} us ({t / floor:.2f}x the floor)")

"""The accumulating kernel's sums against float64, over many random inputs: a lost or a
doubled term shows up as an error far above rounding, and is matched against the terms
(test_cuda_backward_sums_in_kernel[0-d scale and bias-bf16] failed once on the H200,
2026-12-01, with an error of 11 bf16 ulps).

    PYTHONPATH=. python3 tests/gpu/sum_stress.py [trials]
"""
import sys

import torch

import fusegen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a check of the check
trials = int(sys.argv[1]) if len(sys.argv) > 1 else 200
op = fusegen.fuse("a*b+c", name="stress_fma")
SHAPES = {  # a's shape, b's, c's
    "0-d": ((70, 64), (), ()),
    "per-channel NCHW": ((4, 20, 8, 6), (1, 20, 1, 1), (20, 1, 1)),
    "per-channel channels_last": ((4, 20, 8, 6), (1, 20, 1, 1), (20, 1, 1)),
    "long row bias": ((33, 4100), (33, 4100), (4100,)),
    "short row, column": ((37, 12), (12,), (37, 1)),
}
EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}
# The summation's own error, against the sum of |terms|: the accumulating kernel adds exact
# float products in float; the CPU (ATen's sum) adds products rounded to the dtype.
SUM_EPS = {d: 1e-5 if DEVICE == "cuda" else max(e, 1e-5) for d, e in EPS.items()}
bad = 0
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    worst = 0.0
    for name, shapes in SHAPES.items():
        for t in range(trials):
            a, b, c = (torch.randn(s, device=DEVICE, dtype=dtype) for s in shapes)
            if name.endswith("channels_last"):
                a = a.contiguous(memory_format=torch.channels_last)
            g = torch.randn(torch.broadcast_shapes(*shapes), device=DEVICE, dtype=dtype)
            leaves = [x.detach().requires_grad_() for x in (a, b, c)]
            got = torch.autograd.grad(op(*leaves), leaves, g)
            for k, (x, gx) in enumerate(zip((a, b, c), got)):
                if x.shape == g.shape:
                    continue
                other = (b, a, None)[k]
                term = g.double() * (other.double() if other is not None else 1.0)
                ref = term.sum_to_size(x.shape)
                scale = term.abs().sum_to_size(x.shape)
                err = (gx.double() - ref).abs()
                tol = EPS[dtype] * ref.abs() + SUM_EPS[dtype] * scale + 1e-30
                ratio = (err / tol).max().item()
                worst = max(worst, ratio)
                if ratio > 1:
                    bad += 1
                    i = int((err / tol).argmax())
                    d = (gx.double() - ref).flatten()[i].item()
                    near = (term.flatten() - d).abs().min().item(), (term.flatten() + d).abs().min().item()
                    print(f"BAD {str(dtype)[6:]} {name} trial {t} grad {'abc'[k]} at {i}: got "
                          f"{gx.flatten()[i].item():.6g} ref {ref.flatten()[i].item():.6g} diff {d:.4g} "
                          f"(nearest term to diff {near[0]:.3g}, to -diff {near[1]:.3g})", flush=True)
    print(f"{str(dtype)[6:]}: worst error / tolerance {worst:.3f} over {trials} trials of {len(SHAPES)} shapes", flush=True)
print("sum_stress:", "FAILED" if bad else "ok", bad)
sys.exit(1 if bad else 0)

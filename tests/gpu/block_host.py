"""Host µs of each memory-bound op of `fusegen bench block`, fusegen's against eager's, on
tensors small enough that the host alone sets the time: a forward (with grad), and a forward
with its backward (torch.autograd.backward of the outputs). Runs on the GPU or the CPU.

    PYTHONPATH=. python3 tests/gpu/block_host.py [--rows 16] [--hidden 64]

Where the step at `--quick` size is host-bound, these figures say which op's host path
costs more than eager's, and whether its forward or its backward does.
"""
from __future__ import annotations

import argparse

import torch

from fusegen.bench import block
from fusegen.bench.core import host_median_us


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = block.Config(layers=1, hidden=args.hidden, heads=2, head_dim=args.hidden // 2, mlp=args.hidden,
                       vocab=args.hidden, batch=1, seq=args.rows)
    fused, eager = block.fusegen_kernels(), block.EAGER
    with torch.device(device):
        model = block.Decoder(cfg, eager).to(device=device, dtype=dtype)

    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    x, r, w = leaf(1, args.rows, args.hidden), leaf(1, args.rows, args.hidden), leaf(args.hidden)
    q, k = leaf(1, args.rows, 2, args.hidden // 2), leaf(1, args.rows, 2, args.hidden // 2)
    targets = torch.randint(0, args.hidden, (1, args.rows), device=device)
    cases = {
        "norm": lambda ks: ks.norm(x, w),
        "add_norm": lambda ks: ks.add_norm(x, r, w),
        "rope": lambda ks: ks.rope(q, k, model),
        "swiglu": lambda ks: ks.swiglu(x, r),
        "loss": lambda ks: ks.loss(x, model.head.weight, targets),
    }

    def forward_backward(case, ks):
        def run():
            outs = case(ks)
            outs = (outs,) if isinstance(outs, torch.Tensor) else outs
            torch.autograd.backward([o.float().sum() for o in outs])
        return run

    def us(fn):
        return host_median_us(fn, device, args.calls, repeats=5)

    print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{args.rows} x {args.hidden} {dtype}: host us per call (median of 5 x {args.calls})")
    print(f"{'op':10s} {'fwd fusegen':>12s} {'fwd eager':>10s} {'f+b fusegen':>12s} {'f+b eager':>10s}")
    for name, case in cases.items():
        cells = []
        for run in (lambda c=case, ks=fused: c(ks), lambda c=case, ks=eager: c(ks),
                    forward_backward(case, fused), forward_backward(case, eager)):
            cells.append(us(run))
        for t in (x, r, w, q, k, model.head.weight):
            t.grad = None
        print(f"{name:10s} {cells[0]:12.1f} {cells[1]:10.1f} {cells[2]:12.1f} {cells[3]:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

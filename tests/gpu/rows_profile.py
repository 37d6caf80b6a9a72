"""Where a row op's forward+backward spends its GPU time: torch.profiler's kernels of
`fusegen bench rows`'s step, one table per op, dtype, shape and implementation.

    python3 tests/gpu/rows_profile.py [--ops layernorm,softmax] [--dtypes bf16,fp32]
        [--shapes 16384x4096,16384x8192] [--impls fusegen,compile,liger] [--steps 10]

Each implementation warms up (compiles included), then `--steps` steps run under the
profiler; the table gives each kernel's time per step (its mean over the steps) and its
count per step, then the step's GPU total, so that fusegen's kernels can be set beside the
ones a peer launches for the same work (which pass a peer does in fewer bytes or fewer
launches).
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from fusegen.bench import rows
from fusegen.bench.core import DTYPES


def kernels_per_step(step, sets, steps: int) -> dict[str, tuple[float, float]]:
    """kernel name -> (microseconds per step, launches per step)."""
    for i in range(3):
        step(*sets[i % len(sets)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(*sets[i % len(sets)])
        torch.cuda.synchronize()
    total = collections.defaultdict(float)
    count = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time
            count[event.name] += 1
    return {name: (total[name] / steps, count[name] / steps) for name in total}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="layernorm,softmax,resnorm")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--shapes", default="16384x4096,16384x8192")
    parser.add_argument("--impls", default="fusegen,compile,liger")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    names = args.ops.split(",")
    ops = rows.build_ops(names)
    torch.set_grad_enabled(True)
    print(torch.cuda.get_device_name())
    for name in names:
        spec = rows.OPS[name]
        impls, skipped = rows.implementations(name, ops[name], "cuda", args.impls.split(","))
        for why in skipped.values():
            print(f"{name}: {why}")
        for dtype_name in args.dtypes.split(","):
            for shape in args.shapes.split(","):
                r, h = (int(v) for v in shape.split("x"))
                sets = rows._inputs(spec, r, h, 2, DTYPES[dtype_name], "cuda", seed=0)
                for impl, forward in impls.items():
                    table = kernels_per_step(rows._step(forward), sets, args.steps)
                    print(f"\n== {name} {dtype_name} {r}x{h} {impl}: "
                          f"{sum(t for t, _ in table.values()):.1f} us a step on the GPU")
                    for kernel, (us, n) in sorted(table.items(), key=lambda kv: -kv[1][0]):
                        print(f"  {us:8.1f} us  x{n:<4g} {kernel[:150]}")
                del sets
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a decoder block's training step spends its GPU time: torch.profiler's kernels of
`fusegen bench block`'s model, one table per variant, grouped by kind of work.

    python3 tests/gpu/block_profile.py [--variants eager,compile,fusegen] [--steps 5] [--top 25] [--quick]

Each variant warms up (compiles included), then `--steps` steps run under the profiler; the
table gives each kernel's total time per step and its count per step, and a summary per group
(matrix products, attention, fusegen's kernels, Triton kernels, ATen elementwise and
reductions, the optimizer, copies), so that two variants' steps can be compared line by line.
Then the time the GPU waits between kernels (the steps' span less their busy time, per step),
and the kernels that most often start after a wait: where the host falls behind.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from fusegen.bench import block

# Kernel-name fragments, first match wins: what kind of work a kernel does.
GROUPS = (
    ("matmul", ("gemm", "sm90_xmma", "nvjet", "cutlass", "cublas", "splitK")),
    ("attention", ("flash", "fmha", "attention")),
    ("optimizer", ("multi_tensor_apply", "fused_adam", "FusedAdam", "_fused_adamw")),
    ("fusegen", ("fusegen",)),
    ("triton", ("triton_",)),
    ("copy", ("copy", "Memcpy", "Memset", "cat", "fill")),
    ("reduce", ("reduce", "Reduce", "softmax", "norm", "nll", "log_softmax")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def group_of(name: str) -> str:
    for group, parts in GROUPS:
        if any(p in name for p in parts):
            return group
    return "other"


def profile_variant(name: str, args) -> tuple[dict, float]:
    cfg = block.QUICK_CONFIG if args.quick else block.CUDA_CONFIG
    dtype = torch.bfloat16
    kernels = {"eager": block.EAGER, "compile": block.EAGER}.get(name)
    if kernels is None:
        kernels = block.fusegen_kernels() if name.startswith("fusegen") else block.liger_kernels("cuda")[0]
    weights = block.initial_weights(cfg, dtype, "cuda")
    tokens, targets = block.batch(cfg, "cuda")
    with torch.device("cuda"):
        model = block.Decoder(cfg, kernels).to(device="cuda", dtype=dtype)
    model.load_state_dict(weights)
    forward = torch.compile(model) if name in block.COMPILED else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward(tokens, targets).backward()
        optimizer.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    totals: dict = collections.defaultdict(lambda: [0.0, 0])
    spans = []  # (start, end, name) of every kernel, microseconds
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name]
            entry[0] += event.device_time / 1e3 / args.steps  # ms per step
            entry[1] += 1
            spans.append((event.time_range.start, event.time_range.end, event.name))
    step_ms = sum(v[0] for v in totals.values())
    torch._dynamo.reset()
    del model, optimizer
    torch.cuda.empty_cache()
    return {k: (v[0], v[1] / args.steps) for k, v in totals.items()}, step_ms, waits(spans, args.steps)


def waits(spans, steps: int) -> tuple[float, list]:
    """(ms per step the GPU ran no kernel between the first and the last, the kernels after
    the longest waits: (ms per step, count per step, the kernel before, the kernel after))."""
    spans.sort()
    idle = 0.0
    after: dict = collections.defaultdict(lambda: [0.0, 0])
    end, before = None, ""
    for start, stop, name in spans:
        if end is not None and start > end:
            idle += start - end
            entry = after[(before[:60], name[:60])]
            entry[0] += (start - end) / 1e3 / steps
            entry[1] += 1
        if end is None or stop > end:
            end, before = stop, name
    top = sorted(((ms, n / steps, a, b) for (a, b), (ms, n) in after.items()), reverse=True)
    return idle / 1e3 / steps, top


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="eager,compile,fusegen")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="`fusegen bench block --quick`'s smaller model")
    args = parser.parse_args(argv)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    summaries = {}
    for name in args.variants.split(","):
        kernels, step_ms, (idle_ms, gaps) = profile_variant(name, args)
        groups: dict = collections.defaultdict(lambda: [0.0, 0.0])
        for k, (ms, count) in kernels.items():
            groups[group_of(k)][0] += ms
            groups[group_of(k)][1] += count
        summaries[name] = (step_ms, groups)
        print(f"\n== {name}: {step_ms:.2f} ms of kernels per step")
        for k, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"{ms:8.3f} ms {count:6.1f}x  {group_of(k):11s} {k[:150]}")
        print(f"-- {name}: the GPU waits {idle_ms:.3f} ms per step between kernels; the longest waits, "
              "by the kernels before and after:")
        for ms, count, before, after in gaps[:10]:
            print(f"{ms:8.3f} ms {count:6.1f}x  {before}  ->  {after}")
    names = list(summaries)
    all_groups = sorted({g for _, groups in summaries.values() for g in groups})
    print("\n" + "group".ljust(12) + "".join(f"{n:>26s}" for n in names))
    for g in all_groups:
        cells = "".join(f"{summaries[n][1][g][0]:12.3f} ms {summaries[n][1][g][1]:7.1f}x  " for n in names)
        print(g.ljust(12) + cells)
    print("total".ljust(12) + "".join(f"{summaries[n][0]:12.3f} ms {'':9s}" for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU smoke check of the seed examples (generated/*): build them in one library with the
CUDA kernels, then compare with eager PyTorch (float64 reference) forward and backward
in fp64/fp32/bf16/fp16, contiguous and misaligned (x[1:]), plus a size past 2**31 bytes.

    PYTHONPATH=. python tests/gpu/seed_check.py        # on a GPU machine
"""

import json
import sys
import time
from pathlib import Path

import torch

from fusegen.api import Request, fuse_many
from fusegen.tools.check import check, rel_error
from fusegen.tools.reference import evaluate_text

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    assert torch.cuda.is_available(), "needs a GPU"
    specs = [json.loads(p.read_text()) for p in sorted(ROOT.glob("generated/*/spec.json"))]
    t = time.perf_counter()
    ops = fuse_many([Request(s["expression"], s["name"], tuple(s["inputs"]), tuple(s["scalars"]))
                     for s in specs])
    lib = ops[0].library
    print(f"built {len(ops)} seed ops with CUDA in {time.perf_counter() - t:.1f} s "
          f"(cached={lib.cached}, build {lib.seconds:.1f} s)")
    t = time.perf_counter()
    again = fuse_many([Request(s["expression"], s["name"], tuple(s["inputs"]), tuple(s["scalars"])) for s in specs])
    print(f"second fuse of the same ops: {1e3 * (time.perf_counter() - t):.1f} ms (same objects: {again == ops})")
    failures = 0
    for op in ops:
        for result in check(op, device="cuda", n=(1 << 20) + 3,
                            dtypes=(torch.float64, torch.float32, torch.bfloat16, torch.float16)):
            failures += not result.ok
            print(f"{op.name:12s} cuda {result}")
        # Misaligned views: x[1:] of a float tensor is 4 bytes off 16: the scalar path.
        xs = [torch.randn((1 << 16) + 5, device="cuda")[1:] for _ in op.spec.inputs]
        ref = evaluate_text(op.spec.text, {n: x.double() for n, x in zip(op.spec.inputs, xs)})
        err = rel_error(op.op(*xs), ref)
        failures += not err < 1e-5
        print(f"{op.name:12s} cuda misaligned x[1:] fp32 forward rel. error {err:.2e}")
    # 64-bit indexing: 2**31 + 7 bf16 elements (over 4 GB in, 2**31 elements > int32 max).
    big = ops[[o.name for o in ops].index("silu")]
    x = torch.randn((1 << 31) + 7, device="cuda", dtype=torch.bfloat16)
    y = big.op(x)
    tail = slice(-1000, None)
    err = rel_error(y[tail], (x[tail].float() * torch.sigmoid(x[tail].float())).double())
    failures += not err < 1e-2
    print(f"silu         cuda n=2**31+7 bf16 tail rel. error {err:.2e}")
    del x, y
    print("SEED CHECK", "PASSED" if failures == 0 else f"FAILED ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

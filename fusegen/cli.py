"""The command line: `fusegen EXPR [--name N] [--inputs a,b,c] [--scalar NAME ...] [--out DIR]
[--no-build] [--check] [--bench] [--show]`. Errors print one message and exit non-zero."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .errors import BuildError, FusegenError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fusegen",
        description="Turn one elementwise expression into a fused, differentiable PyTorch op "
                    "(torch.ops.fusegen.<name>).",
        epilog='example: fusegen "a*b+c" --name fma --check')
    p.add_argument("expr", help='the expression, Python syntax: "a*b+c", "x*sigmoid(x)"')
    p.add_argument("--name", help="op name (default: fused_<hash of the expression>)")
    p.add_argument("--inputs", help="tensor inputs in schema order, comma-separated "
                                    "(default: order of first appearance)")
    p.add_argument("--scalar", action="append", default=[], metavar="NAME",
                   help="a name that is a runtime float argument (repeatable)")
    p.add_argument("--out", default="generated", metavar="DIR",
                   help="write sources to DIR/<name>/ (default: generated)")
    p.add_argument("--no-build", action="store_true", help="write the sources only")
    p.add_argument("--check", action="store_true", help="compare with eager PyTorch, forward and backward")
    p.add_argument("--bench", action="store_true", help="time the op against eager PyTorch")
    p.add_argument("--show", action="store_true", help="print the generated sources")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except BuildError as err:
        print(f"fusegen: error: {err}", file=sys.stderr)
        return 1
    except FusegenError as err:
        print(f"fusegen: error: {err}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as err:  # a file we cannot write, torch refusing a call
        print(f"fusegen: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _run(args) -> int:
    from .api import Request, generate, load_generated
    from .files import write

    request = Request.of({"expr": args.expr, "name": args.name, "inputs": args.inputs,
                          "scalars": args.scalar})
    generated = generate(request)
    spec = generated.spec
    print(f"op       torch.ops.fusegen.{spec.name}({', '.join(spec.inputs + spec.scalars)})")
    print(f"forward  out = {spec.text}")
    for line in spec.summary():
        print(f"backward {line}")
    out_dir = Path(args.out) / spec.name
    paths = write(generated.files, out_dir)
    print(f"wrote    {out_dir}/: {' '.join(p.name for p in paths)}")
    if args.show:
        for name, text in generated.files.items():
            print(f"\n===== {out_dir / name} =====\n{text}", end="")
    if args.no_build:
        return 0

    start = time.perf_counter()
    op = load_generated([generated])[0]
    lib = op.library
    how = f"built in {lib.seconds:.1f} s" if not lib.cached else \
        f"loaded from cache in {time.perf_counter() - start:.2f} s"
    print(f"library  {how}: {lib.path}")

    status = 0
    if args.check:
        from .build import cuda_enabled
        from .check import check
        devices = ["cpu"] + (["cuda"] if cuda_enabled() else [])
        for device in devices:
            for result in check(op, device=device):
                print(f"check    {device:4s} {result}")
                status |= 0 if result.ok else 3
    if args.bench:
        from .bench import bench_op
        for line in bench_op(op):
            print(f"bench    {line}")
    return status


if __name__ == "__main__":
    sys.exit(main())

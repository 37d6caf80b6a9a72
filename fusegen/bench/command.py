"""`fusegen bench` (and `python -m fusegen.bench`): the subcommands, one table.

    fusegen bench [EXPR ...] [--quick] ...     # the race of implementations (core.py)
    fusegen bench build | cpu | layouts | gp | ffn | compile | optim | rope | rows | block | dropout

Each subcommand's module is imported only when it runs."""

from __future__ import annotations

import argparse
import sys


def _build(argv) -> int:  # build latency
    from fusegen.bench import build
    return build.main(argv) or 0


def _layouts(mode: str):  # CPU kernels, real layouts
    def run(argv) -> int:
        from fusegen.bench import layouts
        layouts.main([mode, *argv])
        return 0
    return run


def _ffn(argv) -> int:  # the FFN block, SwiGLU/GeGLU
    from fusegen.bench import ffn
    return ffn.main(argv)


def _compile(argv) -> int:  # fusion across a fused op under torch.compile
    from fusegen.bench import compile
    compile.main(argv)
    return 0


def _gp(argv) -> int:  # a gradient-penalty training step
    import torch

    from fusegen.bench import core
    p = argparse.ArgumentParser(prog="fusegen bench gp", description="a gradient-penalty training step, fusegen vs eager")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--dtypes", default="float32")
    p.add_argument("--json", help="write all rows to this file")
    args = p.parse_args(argv)
    core.run_gp(args.batch, args.width, [getattr(torch, d) for d in args.dtypes.split(",")], args.json)
    return 0


def _optim(argv) -> int:  # an optimizer step over a 1.1B-parameter Llama's params
    from fusegen.bench import optim
    return optim.main(argv)


def _rope(argv) -> int:  # RoPE on q and k, an op of two outputs joined by torch.cat
    from fusegen.bench import rope
    return rope.main(argv)


def _rows(argv) -> int:  # RMSNorm, LayerNorm, softmax, residual + RMSNorm: ops that reduce over rows
    from fusegen.bench import rows
    return rows.main(argv)


def _dropout(argv) -> int:  # bias-dropout-add: random numbers drawn in the kernels
    from fusegen.bench import dropout
    return dropout.main(argv)


def _block(argv) -> int:  # a Llama-style decoder's training step: eager, compile, fusegen, Liger
    from fusegen.bench import block
    return block.main(argv)


SUBCOMMANDS = {"build": _build, "cpu": _layouts("cpu"), "layouts": _layouts("layouts"), "gp": _gp,
               "ffn": _ffn, "compile": _compile, "optim": _optim, "rope": _rope,
               "rows": _rows, "block": _block, "dropout": _dropout}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = SUBCOMMANDS.get(argv[0]) if argv else None
    if command is not None:
        return command(argv[1:])
    from fusegen.bench import core
    return core.bench_main(argv, tuple(SUBCOMMANDS))

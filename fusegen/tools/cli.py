"""The command line.

    fusegen EXPR [--name N] [--inputs a,b,c] [--scalar NAME ...] [--out DIR]
                 [--no-build] [--check] [--bench] [--show] [--quiet]
    fusegen "m = beta*m + g; p = p - lr*m" --name sgd_momentum --inputs p,g,m --scalar lr --scalar beta
    fusegen cache [list | clear | trim --older-than AGE]
    fusegen package FOLDER... --name PKG [--out DIR] [--cuda] [--no-build] [--force]
    fusegen bench [EXPR ...] [--dtypes ..] [--sizes ..] [--quick] [--json F] [--plot F.png]
    fusegen setup [-v]

A first word in COMMANDS is that command (`cache`, `package`, `setup`, `bench`: fusegen/bench/
command.py); an op whose expression is the bare name `cache` is written `fusegen "(cache)"`.
`fusegen EXPR` loads the op as `fuse()` does (api.load_requests); a program of statements
that assigns to an input is a step op (ir/step.py), written and loaded as `fuse()` makes it. Errors print one line,
`fusegen: error: ...`, and exit non-zero, by the exception's class: 2 for bad arguments, a
bad expression or name, 1 for a failed build (BuildError, package.WheelBuildError) or a
cache that cannot be changed, 3 for a failed --check.

Build progress comes from the "fusegen" logger (build/builder.py), drawn by tools/console.py:
while compiling, one line redrawn with the elapsed seconds when stderr is a terminal; plain lines on stdout
otherwise (stderr stays for errors, so a script can treat any stderr output as failure).
--quiet installs no handler: only errors and the --check/--bench results are printed.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from fusegen.errors import BuildError, FusegenError
from fusegen.tools.console import Parser, Progress


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="fusegen",
        description="Turn one elementwise expression into a fused, differentiable PyTorch op "
                    "(torch.ops.fusegen.<name>). `fusegen cache` lists and trims the build cache; "
                    "`fusegen bench` races fused ops against eager, torch.compile, jiterator and CuPy.",
        epilog='example: fusegen "a*b+c" --name fma --check')
    p.add_argument("expr", help='the expression, Python syntax: "a*b+c", "x*sigmoid(x)"; or statements that '
                                'update inputs in place: "m = beta*m + g; p = p - lr*m" (a step op)')
    p.add_argument("--name", help="op name (default: fused_<hash of the expression>)")
    p.add_argument("--inputs", help="tensor inputs in schema order, comma-separated "
                                    "(default: order of first appearance)")
    p.add_argument("--scalar", action="append", default=[], metavar="NAME",
                   help="a name that is a runtime float argument (repeatable)")
    p.add_argument("--out", metavar="DIR",
                   help="write sources to DIR/<name>/ (default: generated; a temporary folder for a "
                        "--check or --bench run without --name)")
    p.add_argument("--force", action="store_true",
                   help="overwrite DIR/<name>/ even when it holds another expression")
    p.add_argument("--no-build", action="store_true", help="write the sources only")
    p.add_argument("--check", action="store_true", help="compare with eager PyTorch, forward and backward")
    p.add_argument("--bench", action="store_true", help="time the op against eager PyTorch")
    p.add_argument("--show", action="store_true", help="print the generated sources")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only errors (and the --check/--bench results): no summary, no progress")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = COMMANDS.get(argv[0]) if argv else None
    if command is not None:
        return command(argv[1:])
    args = _parser().parse_args(argv)
    from fusegen.build.builder import DEFAULT_HANDLER  # the library's build lines: the progress line replaces them

    logger = logging.getLogger("fusegen")
    logger.removeHandler(DEFAULT_HANDLER)
    progress = None if args.quiet else Progress.install()
    try:
        return _run(args)
    except BuildError as err:
        _error(err)
        return 1
    except FusegenError as err:
        _error(err)
        return 2
    except (OSError, RuntimeError) as err:  # a file we cannot write, torch refusing a call
        print(f"fusegen: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if progress is not None:
            progress.uninstall()
        logger.addHandler(DEFAULT_HANDLER)


def _error(err: Exception):
    # fusegen's messages start with "fusegen: " (they are read outside the CLI too); once is enough
    text = str(err)
    print(f"fusegen: error: {text.removeprefix('fusegen: ')}", file=sys.stderr)


def _run(args) -> int:
    import tempfile

    if args.out is None and args.name is None and (args.check or args.bench):
        # a try-out: its fused_<hash>/ folder would only litter the current folder
        with tempfile.TemporaryDirectory(prefix="fusegen-") as tmp:
            args.out, args.temporary = tmp, True
            return _run(args)
    from fusegen import api

    say = (lambda *a: None) if args.quiet else print
    if api.looks_like_program(args.expr):
        from fusegen.frontend.statements import parse_program
        from fusegen.ir.expr import ParsedProgram
        parsed = parse_program(args.expr, inputs=api._names_arg("inputs", args.inputs), scalars=args.scalar)
        if isinstance(parsed, ParsedProgram):
            return _run_step(args, parsed, say)
    request = api.Request.of({"expr": args.expr, "name": args.name, "inputs": args.inputs,
                              "scalars": args.scalar})
    generated = api.generate(request)
    spec = generated.spec
    say(f"op       torch.ops.fusegen.{spec.name}({', '.join(spec.inputs + spec.scalars)})")
    say(f"forward  out = {spec.text}")
    for line in spec.summary():
        say(f"backward {line}")
    _write_folder(args, spec, generated.files, say)
    if args.no_build:
        return 0

    start = time.perf_counter()
    api.load_requests([(request, generated)])  # as fuse() loads it: the index, else a build, recorded
    op = api.cached(request)
    _say_library(op.library, start, say)

    status = 0
    if args.check:
        from fusegen.build.builder import cuda_enabled
        from fusegen.tools.check import check
        devices = ["cpu"] + (["cuda"] if cuda_enabled() else [])
        for device in devices:
            for result in check(op, device=device):
                print(f"check    {device:4s} {result}")
                status |= 0 if result.ok else 3
    if args.bench:
        from fusegen.bench.core import bench_op
        for line in bench_op(op):
            print(f"bench    {line}")
    return status


def _run_step(args, parsed, say) -> int:
    """A program that updates inputs in place: its step op's folder, built and loaded as
    fusegen.fuse loads it. --check and --bench race an op's result against eager's; a step
    op has none, so they are refused before anything is written."""
    from fusegen import api
    from fusegen.errors import SpecError

    if args.check or args.bench:
        raise SpecError(f"--{'check' if args.check else 'bench'} compares an op's result with eager PyTorch's; "
                        f"{args.expr!r} updates {', '.join(u for u, _ in parsed.updates)} in place and has no "
                        "result: load it (fusegen.load(\"generated/NAME\")) and compare with the statements run "
                        "eagerly, or `fusegen bench optim` for optimizers")
    spec, files = api.generate_step(parsed, args.name)
    say(f"op       torch.ops.fusegen.{spec.name}({', '.join(spec.inputs + spec.scalars)}) -> ()")
    say(f"foreach  torch.ops.fusegen.{spec.foreach_name}: lists of tensors, one launch per device and dtypes")
    for line in spec.summary():
        say(f"update   {line}")
    _write_folder(args, spec, files, say)
    if args.no_build:
        return 0
    start = time.perf_counter()
    step = api.load_step(api.step_key(parsed, args.name), spec, files)
    _say_library(step.library, start, say)
    return 0


def _write_folder(args, spec, files: dict, say):
    """An op's (or step op's) files into DIR/<name>/ (refusing another expression's folder
    unless --force), the runtime beside it, once for every op folder; --show prints them."""
    from fusegen.files import RUNTIME_FOLDER, runtime_files, write

    out_dir = Path(args.out or "generated") / spec.name
    if not args.force:
        _check_overwrite(out_dir, spec)
    paths = write(files, out_dir)
    write(runtime_files(), out_dir.parent / RUNTIME_FOLDER)
    temporary = " (temporary: pass --out DIR or --name to keep them)" if getattr(args, "temporary", False) else ""
    say(f"wrote    {out_dir}/: {' '.join(p.name for p in paths)}{temporary}")
    if args.show:
        for name, text in files.items():
            print(f"\n===== {out_dir / name} =====\n{text}", end="")


def _say_library(lib, start: float, say):
    how = f"built in {lib.seconds:.1f} s" if not lib.cached else \
        f"loaded from cache in {time.perf_counter() - start:.2f} s"
    say(f"library  {how}: {lib.path}")


def _identity(doc: dict) -> tuple:
    """What makes two spec.json the same op: kind, what it computes, inputs and scalars."""
    what = doc.get("updates") if doc.get("kind") == "step" else doc.get("forward")
    return doc.get("kind", "op"), what, doc.get("inputs"), doc.get("scalars")


def _check_overwrite(out_dir: Path, spec):
    """Refuse to replace a generated folder that holds another op, as a second expression
    under one name is refused in one process. The same expression (same forward, inputs and
    scalars) is rewritten in place: a rerun, or a newer fusegen."""
    import json

    from fusegen.ir import notation
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    try:
        old = json.loads((out_dir / "spec.json").read_text())
        if hasattr(spec, "updates"):  # a step op (ir/step.py)
            mine = ("step", {i: notation.text(e) for i, e in spec.updates}, list(spec.inputs), list(spec.scalars))
        else:
            forward = [notation.text(o) for o in spec.outputs]  # as spec.json has it
            mine = ("op", forward[0] if len(forward) == 1 else forward, list(spec.inputs), list(spec.scalars))
        same = _identity(old) == mine
        held = f"op {old.get('name')!r} for {old.get('expression')!r} (its spec.json)"
    except (OSError, ValueError, AttributeError):
        same, held = False, "files that are not a fusegen op (no readable spec.json)"
    if not same:
        raise FolderClash(f"{out_dir}/ holds {held}; this run makes {spec.name!r} for {spec.text!r}. "
                          "Pick another --name or --out, or pass --force to overwrite it")


class FolderClash(FusegenError):
    """The output folder holds another op."""


# -- fusegen package ------------------------------------------------------------------------------

def _package_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fusegen package",
                description="Write a buildable project (pyproject.toml, setup.py with CppExtension or "
                            "CUDAExtension, the ops' sources and one copy of the runtime) for generated op "
                            "folders and build its wheel. Importing the package registers "
                            "torch.ops.fusegen.<op> for every op; it needs torch alone.",
                epilog='`package` as the first word is this command; to fuse the expression `package`, '
                       'write fusegen "(package)".')
    p.hint = '; to fuse the expression "package", write fusegen "(package)"'
    p.add_argument("folders", nargs="+", metavar="FOLDER", help="generated/<name>/ folders")
    p.add_argument("--name", required=True, metavar="PKG", help="the Python package (and wheel) name")
    p.add_argument("--out", default="dist", metavar="DIR",
                   help="the project goes to DIR/PKG/, the wheel to DIR/ (default: dist)")
    p.add_argument("--cuda", action="store_true",
                   help="a CUDA build (the default when nvcc and a CUDA build of torch are present)")
    p.add_argument("--no-build", action="store_true", help="write the project only")
    p.add_argument("--force", action="store_true",
                   help="write into DIR/PKG/ even when it holds files fusegen package did not write "
                        "(files of the names it writes are replaced, others left alone)")
    return p


def _package_main(argv: list[str]) -> int:
    args = _package_parser().parse_args(argv)
    from fusegen.tools import package
    start = time.perf_counter()
    try:
        cuda = args.cuda or package.cuda_available()
        project = Path(args.out) / args.name
        ops = package.write_project([Path(f) for f in args.folders], args.name, project, cuda,
                                    force=args.force)
        print(f"project  {project}/: {', '.join(ops)} ({'CPU and CUDA' if cuda else 'CPU'})")
        if args.no_build:
            return 0
        wheel = package.build_wheel(project, Path(args.out))
    except package.WheelBuildError as err:  # a failed build, as for an op
        print(f"fusegen: error: {err}", file=sys.stderr)
        return 1
    except package.PackageError as err:
        print(f"fusegen: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"fusegen: error: {err}", file=sys.stderr)
        return 1
    print(f"wheel    {wheel} (built in {time.perf_counter() - start:.1f} s)")
    return 0


# -- fusegen cache ---------------------------------------------------------------------------------

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_AGE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")


def parse_age(text: str) -> float:
    """'30s', '15m', '12h', '7d' (a number and a unit) -> seconds."""
    m = _AGE.fullmatch(text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(
            f"expected an age: a number and a unit s, m, h or d (30s, 15m, 12h, 7d), got {text!r}")
    return float(m[1]) * _UNITS[m[2]]


def _cache_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fusegen cache",
                description="List, trim or clear fusegen's build cache ($FUSEGEN_CACHE_DIR, default "
                            "~/.cache/fusegen). Every command also removes the temp folders of killed "
                            "builds; nothing a build in progress uses is ever removed, and nothing "
                            "fusegen did not make: a folder without fusegen's CACHEDIR.TAG is refused.",
                epilog='`cache` as the first word is this command; to fuse the expression `cache` '
                       '(an input named cache), write fusegen "(cache)".')
    # `fusegen cache --name c` meant an op: say how to write that
    p.hint = '; to fuse the expression "cache", write fusegen "(cache)"'
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    sub.add_parser("list", help="list the entries: op names, size, last use (the default)")
    sub.add_parser("clear", help="remove every entry")
    trim = sub.add_parser("trim", help="remove the entries not used within an age")
    trim.add_argument("--older-than", required=True, type=parse_age, metavar="AGE",
                      help="remove entries last used longer ago than AGE: 30s, 15m, 12h, 7d")
    return p


def _cache_main(argv: list[str]) -> int:
    args = _cache_parser().parse_args(argv)
    try:
        return _cache_run(args)
    except OSError as err:
        where = f" {err.filename}" if err.filename else ""
        print(f"fusegen: error: cannot change the cache:{where}: {err.strerror or err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _cache_run(args) -> int:
    from fusegen.build import cache
    root = cache.cache_dir()
    if not root.exists():
        print(f"cache    {root}: empty (it does not exist yet; the first build creates it)")
        return 0
    if not root.is_dir():
        print(f"fusegen: error: the cache directory {root} is not a directory; set FUSEGEN_CACHE_DIR "
              "to a directory", file=sys.stderr)
        return 2
    # Before anything is removed, even a temp folder: only a folder fusegen made is its cache.
    foreign = cache.foreign(root)
    if foreign == [] and not any(root.iterdir()):
        print(f"cache    {root}: empty")
        return 0
    if foreign is not None:
        _error(FusegenError(cache.not_a_cache_message(root, foreign)))
        return 2
    for temp in cache.clean_stale(root):
        print(f"removed  {temp.path.name} ({_size(temp.size)}): the temp folder of a killed build")
    return CACHE_COMMANDS[args.command or "list"](root, args, time.time())


def _cache_list(root: Path, args, now: float) -> int:
    from fusegen.build import cache
    found = cache.entries(root)
    for e in found:
        print(_describe(e, now))
    temps = cache.temp_folders(root)
    for t in temps:
        print(f"building {t.what or t.path.name} ({_size(t.size)} so far, {t.path.name})")
    for other in cache.others(root):
        print(f"other    {other.name}: not made by fusegen (or not recognised), never removed")
    index = cache.index_files(root)
    index_size = cache.size(root / cache.INDEX)
    if index:
        print(f"index    {len(index)} request{'s' if len(index) != 1 else ''} -> library "
              f"({_size(index_size)}): what makes a cached load fast")
    total = sum(e.size for e in found) + sum(t.size for t in temps) + index_size
    print(f"cache    {root}: {len(found)} entr{'y' if len(found) == 1 else 'ies'}, {_size(total)}")
    return 0


def _cache_remove(root: Path, args, now: float) -> int:
    """`clear` (every entry) and `trim` (the entries last used longer ago than --older-than)."""
    from fusegen.build import cache
    clear = args.command == "clear"
    doomed = [e for e in cache.entries(root) if clear or now - e.last_use > args.older_than]
    removed = kept = freed = 0
    for e in doomed:
        if cache.remove(e, root):
            removed += 1
            freed += e.size
            print(f"removed  {e.name} ({_what(e)}, {_size(e.size)}, last used {_ago(now - e.last_use)})")
        else:
            kept += 1
            print(f"kept     {e.name}: a build in progress holds its lock (building it, or linking against it)")
    cache.prune_index(root, everything=clear and not kept)
    if clear:
        cache.clear_templates(root)
    left = cache.entries(root)
    print(f"cache    {root}: removed {removed} entr{'y' if removed == 1 else 'ies'} ({_size(freed)}); "
          f"{len(left)} left, {_size(sum(e.size for e in left))}")
    return 0


def _what(e) -> str:
    if e.kind == "runtime":
        torch = f", torch {e.torch}" if e.torch else ""
        return f"shared runtime{torch}" + (", CUDA" if e.cuda else "")
    if not e.ops:
        return "op library"  # an entry whose metadata could not be read
    shown = e.ops if len(e.ops) <= 8 else e.ops[:6] + [f"... ({len(e.ops) - 6} more)"]  # one line
    return ("op " if len(e.ops) == 1 else f"{len(e.ops)} ops: ") + ", ".join(shown)


def _describe(e, now: float) -> str:
    stamp = datetime.fromtimestamp(e.last_use, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return (f"{'runtime' if e.kind == 'runtime' else 'ops':8s} {e.name}  {_what(e)}\n"
            f"         {_size(e.size)}, last used {_ago(now - e.last_use)} ({stamp})")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return "just now"
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if unit == 'day' and n != 1 else ''} ago"
    raise AssertionError("unreachable")


def _bench_main(argv: list[str]) -> int:
    from fusegen.bench.command import main as bench
    return bench(argv)


def _setup_main(argv: list[str]) -> int:
    p = Parser(prog="fusegen setup",
               description="Build fusegen's shared runtime for this torch, CUDA and compiler once, at "
                           "install time, beside the package (fusegen/_installed/, or "
                           "$FUSEGEN_RUNTIME_DIR), so that the first op in any cache builds the op "
                           "alone. Without it the first op builds the runtime into the cache.")
    p.add_argument("-v", "--verbose", action="store_true", help="show the compiler's commands")
    args = p.parse_args(argv)
    from fusegen.build import builder
    try:
        lib = builder.install_runtime(verbose=args.verbose)
    except FusegenError as err:
        _error(err)
        return 1
    except KeyboardInterrupt:
        return 130
    import torch
    done = f"built in {lib.seconds:.1f} s" if not lib.cached else "already built"
    print(f"fusegen: the runtime for torch {torch.__version__} is in {lib.path.parent} ({done})")
    return 0


# The subcommands: a first word that is one of these is the command, not an expression (an
# op whose expression is the bare name is written in parentheses: fusegen "(cache)").
COMMANDS = {"cache": _cache_main, "package": _package_main, "bench": _bench_main, "setup": _setup_main}
CACHE_COMMANDS = {"list": _cache_list, "clear": _cache_remove, "trim": _cache_remove}


if __name__ == "__main__":
    sys.exit(main())

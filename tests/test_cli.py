"""The CLI's build progress and --quiet, the library's silence by default, and build errors
that show the compiler's first error with its source line.

Real builds here are small ops in a fresh cache seeded with the test run's runtime (a
second or two each); the failing build is a real compile of a hand-written source with a
syntax error."""

from __future__ import annotations

import io
import logging
import os
import pty
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from conftest import seed_runtime
from fusegen.build import builder as build
from fusegen.tools.cli import main
from fusegen.tools.console import Progress
from fusegen.errors import BuildError, CompilerError


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def seeded(tmp_path):
    """A fresh cache holding only the shared runtime, as a user's after the first build."""
    root = tmp_path / "cache"
    seed_runtime(root)
    return dict(os.environ, FUSEGEN_CACHE_DIR=str(root))


def fusegen(args, env, cwd, stderr=subprocess.PIPE):
    return subprocess.run([sys.executable, "-m", "fusegen", *args], stdout=subprocess.PIPE, stderr=stderr,
                          text=True, env=env, cwd=cwd, timeout=600)


# -- the progress handler, with records like builder.py's --------------------------------------------

def record(message: str, event: str | None = None) -> logging.LogRecord:
    fields = {"name": "fusegen", "msg": message, "levelno": logging.INFO, "levelname": "INFO"}
    if event:
        fields["fusegen_build"] = event
    return logging.makeLogRecord(fields)


def test_progress_on_a_terminal_is_one_line_per_build():
    stream = io.StringIO()
    progress = Progress(live=True, stream=stream)
    progress.emit(record("building the fusegen runtime (once per torch version) for CPU", "start"))
    progress.emit(record("building op(s) fma for CPU", "start"))  # nested: the retry after a deleted cache
    progress.emit(record("built op(s) fma in 1.0 s", "done"))
    progress.emit(record("building the fusegen runtime (once per torch version) for CPU failed after 2.0 s",
                         "failed"))
    progress.emit(record("the cache was deleted; building again"))
    progress.stop.set()  # the ticker thread, which uninstall() stops in the CLI
    progress.ticker.join()
    lines = stream.getvalue().split("\n")
    assert lines[0].startswith("\r\x1b[Kbuilding the fusegen runtime (once per torch version) for CPU... 0.0 s")
    assert lines[1].startswith("\r\x1b[Kbuilding op(s) fma for CPU... 0.0 s") and lines[1].endswith(" s")
    # the outer build is redrawn after the inner one ends, and ends with its outcome
    assert lines[2].endswith(" s failed") and "fusegen runtime" in lines[2]
    assert lines[3] == "the cache was deleted; building again" and lines[4] == ""


def test_progress_elsewhere_is_plain_lines():
    stream = io.StringIO()
    progress = Progress(live=False, stream=stream)
    progress.emit(record("building op(s) fma for CPU", "start"))
    progress.emit(record("built op(s) fma in 1.0 s", "done"))
    assert stream.getvalue() == "building op(s) fma for CPU...\nbuilt op(s) fma in 1.0 s\n"


def test_install_and_uninstall_restore_the_logger():
    logger = logging.getLogger("fusegen")
    before = (logger.level, logger.propagate, list(logger.handlers))
    progress = Progress.install()
    assert logger.level == logging.INFO and progress in logger.handlers and not logger.propagate
    progress.uninstall()
    assert (logger.level, logger.propagate, list(logger.handlers)) == before
    assert build.DEFAULT_HANDLER in logger.handlers  # the library's default


def test_the_cli_shows_its_own_lines_not_the_library_ones(tmp_path, capsys, monkeypatch):
    """The CLI takes the library's handler off while it runs (its progress line, or nothing
    with --quiet, stands for it) and puts it back after."""
    seen = []
    monkeypatch.setattr(build.DEFAULT_HANDLER, "emit", seen.append)
    logger = logging.getLogger("fusegen")
    monkeypatch.setattr("fusegen.tools.cli._run", lambda args: (seen.append(list(logger.handlers)), 0)[1])
    for quiet in ([], ["--quiet"]):
        assert main(["x*2", "--no-build", "--out", str(tmp_path)] + quiet) == 0
        assert build.DEFAULT_HANDLER not in seen.pop()
        assert build.DEFAULT_HANDLER in logger.handlers


def _record(event, message="building op(s) fma for CPU", level=logging.INFO):
    r = record(message, event)
    r.levelno = level
    return r


def test_the_library_build_lines(capsys, monkeypatch):
    """One line on stderr when a build starts and one when it ends; nothing for other INFO
    records; nothing when the application has configured logging (its handlers show them)
    or when FUSEGEN_QUIET is set."""
    handler = build.DEFAULT_HANDLER
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # pytest's own capture handlers sit there
    monkeypatch.delenv(build.QUIET_ENV, raising=False)
    handler.emit(_record("start"))
    handler.emit(_record("done", "built op(s) fma in 21.3 s"))
    handler.emit(_record(None, "fusegen::fma: third order is not fused"))  # INFO, no build event
    handler.emit(_record(None, "fusegen: something is wrong", logging.WARNING))
    assert capsys.readouterr().err == ("fusegen: building op(s) fma for CPU...\n"
                                       "fusegen: built op(s) fma in 21.3 s\n"
                                       "fusegen: something is wrong\n")
    monkeypatch.setenv(build.QUIET_ENV, "1")
    handler.emit(_record("start"))
    monkeypatch.setenv(build.QUIET_ENV, "0")
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])
    handler.emit(_record("start"))
    assert capsys.readouterr().err == ""


# -- the CLI, real builds --------------------------------------------------------------------------

def test_cli_progress_lines_on_stdout_when_not_a_terminal(tmp_path, seeded):
    name = unique("prog_plain")
    r = fusegen(["x*3 + y", "--name", name, "--out", str(tmp_path)], seeded, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == ""  # stderr is for errors only (tests/test_readme.py relies on it)
    lines = r.stdout.splitlines()
    start = lines.index(f"building op(s) {name} for CPU...")
    assert lines[start + 1].startswith(f"built op(s) {name} in ") and lines[start + 1].endswith(" s")
    assert lines[start + 2].startswith("library  built in")
    assert lines[start - 1].startswith("wrote")  # after the summary, not before it


def test_cli_progress_line_on_a_terminal(tmp_path, seeded):
    name = unique("prog_tty")
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "fusegen", "x*4 - y", "--name", name, "--out", str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=slave, text=True, env=seeded, cwd=tmp_path)
    finally:
        os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out = proc.stdout.read()
    assert proc.wait(timeout=600) == 0, out
    err = b"".join(chunks).decode()
    assert f"\r\x1b[Kbuilding op(s) {name} for CPU... " in err
    final = err.replace("\r\n", "\n").split("\n")[0].split("\r\x1b[K")[-1]
    assert final.startswith(f"building op(s) {name} for CPU... ") and final.endswith(" s"), repr(err)
    assert "building" not in out and "library  built in" in out


def test_cli_quiet_prints_only_check_results(tmp_path, seeded):
    name = unique("quiet")
    r = fusegen(["a*b - 1", "--name", name, "--out", str(tmp_path), "--quiet", "--check"], seeded, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == ""
    assert r.stdout and all(line.startswith("check") for line in r.stdout.splitlines()), r.stdout
    r = fusegen(["a*b - 1", "--name", name, "--out", str(tmp_path), "-q"], seeded, tmp_path)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""
    assert (tmp_path / name / f"{name}.cpp").is_file()  # it still writes and builds


def test_cli_quiet_still_prints_errors(tmp_path, capsys):
    assert main(["sigmod(x)", "--quiet", "--no-build", "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("fusegen: error: unknown function 'sigmod'")


LIBRARY = """
import logging, sys, fusegen
fusegen.fuse("x*5 + y", name=sys.argv[1])
print("--- logging configured ---", file=sys.stderr, flush=True)
logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
fusegen.fuse("x*7 + y", name=sys.argv[2])
"""


@pytest.mark.slow
def test_a_library_build_says_when_it_starts_and_ends(tmp_path, seeded):
    """A first build from Python prints two lines on stderr; under the application's logging
    configuration (WARNING: fusegen's own level, INFO, decides), its handlers print them,
    once. A cached load (a new process) prints nothing. setLevel(WARNING) silences it."""
    shown, configured = unique("lib_shown"), unique("lib_configured")
    r = subprocess.run([sys.executable, "-c", LIBRARY, shown, configured], capture_output=True,
                       text=True, env=seeded, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    first, third = r.stderr.split("--- logging configured ---\n")
    lines = first.splitlines()
    assert lines[0] == f"fusegen: building op(s) {shown} for CPU..." and len(lines) == 2, first
    assert lines[1].startswith(f"fusegen: built op(s) {shown} in ") and lines[1].endswith(" s")
    assert r.stdout == ""
    lines = third.splitlines()
    assert lines[0] == f"fusegen INFO building op(s) {configured} for CPU" and len(lines) == 2, third
    assert lines[1].startswith(f"fusegen INFO built op(s) {configured} in ")
    again = subprocess.run([sys.executable, "-c", LIBRARY, shown, configured], capture_output=True,
                           text=True, env=seeded, cwd=tmp_path, timeout=600)
    assert again.returncode == 0 and again.stdout == ""
    assert again.stderr == "--- logging configured ---\n"  # cached: not a word
    logger = logging.getLogger("fusegen")
    assert logger.isEnabledFor(logging.INFO)
    level = logger.level
    try:
        logger.setLevel(logging.WARNING)  # the documented way to silence it
        assert not logger.isEnabledFor(logging.INFO)
    finally:
        logger.setLevel(level)


# -- build errors ----------------------------------------------------------------------------------

BROKEN = "// a hand-written op with a syntax error on line 4\n#include <cstdint>\nint f(int x) {\n    return x +;\n}\n"


def test_a_failing_build_shows_the_first_error_and_its_line(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    runtime = seed_runtime(root)
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(root))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the failed build is kept
    name = unique("broken")
    with pytest.raises(BuildError) as info:
        build.build([(name, {f"{name}.cpp": BROKEN + "int g( {\n"})])  # two errors: the first is shown
    err = info.value
    lines = str(err).splitlines()
    first = err.first_error
    assert first.file.endswith(f"/{name}/{name}.cpp") and first.line == 4 and first.col
    assert lines[0] == f"fusegen: building op(s) {name} failed: {first.file}:4: error: {first.message}"
    assert "expected primary-expression" in first.message
    assert lines[1] == "    4 |     return x +;"
    assert lines[2].endswith("^") and lines[2].index("^") == len("    4 | ") + first.col - 1
    assert lines[3] == f"full compiler log: {err.log_path} (the sources are beside it)" and len(lines) == 4
    # the named file and the full log are kept (the build folder itself is gone)
    assert Path(first.file).read_text() == BROKEN + "int g( {\n"
    log_text = Path(err.log_path).read_text()
    assert "expected primary-expression" in log_text and "int g(" in log_text and "build.ninja" in log_text
    assert Path(err.log_path).parent.parent == tmp_path / "tmp" and Path(err.log_path).parent.name.startswith(
        "fusegen-failed-")
    assert oct(os.stat(Path(err.log_path).parent).st_mode & 0o777) == "0o700"
    # nothing left in the cache
    assert sorted(p.name for p in root.iterdir()) == sorted(["CACHEDIR.TAG", "locks", runtime.name])


def test_the_cli_prints_a_build_error_once_prefixed(tmp_path, capsys, monkeypatch):
    import fusegen.api

    error = BuildError("fusegen: building op(s) bad failed", "log",
                       first_error=CompilerError("/k/bad/bad.cpp", 3, 5, "oops", "  int x = ;"),
                       log_path="/k/build.log")

    def fail(generated):
        raise error

    monkeypatch.setattr(fusegen.api, "load_generated", fail)
    assert main(["a+b", "--name", "bad", "--out", str(tmp_path), "-q"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == ["fusegen: error: building op(s) bad failed: /k/bad/bad.cpp:3: error: oops",
                                "    3 |   int x = ;",
                                "      |     ^",
                                "full compiler log: /k/build.log (the sources are beside it)"]


def test_the_cli_loads_an_op_as_fuse_does(corpus_ops, tmp_path, capsys, monkeypatch):
    """`fusegen EXPR` goes through fuse()'s load path: an op fuse() made (the memo, the
    request index) is found without the build-and-load stage."""
    import fusegen.api
    from corpus import CORPUS

    case = next(c for c in CORPUS if c.name == "cp_fma")
    monkeypatch.setattr(fusegen.api, "load_generated",
                        lambda todo: pytest.fail("the CLI built an op fuse() made") if todo else [])
    argv = [case.expr, "--name", case.name, "--out", str(tmp_path)]
    argv += ["--inputs", ",".join(case.inputs)] if case.inputs else []
    argv += [a for s in case.scalars for a in ("--scalar", s)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # "loaded from cache" when the corpus came from the cache, "built" when this run built it
    assert ("library  loaded from cache in" in out or "library  built in" in out), out
    assert (tmp_path / case.name / "spec.json").is_file()


def test_subcommands_are_a_table(tmp_path):
    """The first word picks a command from one table; anything else is an expression."""
    from fusegen.tools import cli
    from fusegen.bench import command

    assert set(cli.COMMANDS) == {"cache", "package", "bench", "setup"}
    assert set(cli.CACHE_COMMANDS) == {"list", "clear", "trim"}
    assert set(command.SUBCOMMANDS) == {"build", "cpu", "layouts", "gp", "ffn", "compile", "optim", "rope", "rows", "block", "dropout"}
    assert main(["(cache)", "--no-build", "--out", str(tmp_path), "-q"]) == 0
    assert any(tmp_path.iterdir())  # the op of one input named cache


@pytest.mark.parametrize("log, expected", [
    ("[1/2] c++ -c /b/unit0.cpp\nIn file included from /b/unit0.cpp:1:\n/b/op/op.cpp:12:7: error: 'foo' was "
     "not declared in this scope\n/b/op/op.cpp:20:1: error: second\n", ("/b/op/op.cpp", 12, 7, "'foo' was not "
                                                                       "declared in this scope")),
    ("/b/op/op.cpp:3:10: fatal error: missing.h: No such file or directory\n",
     ("/b/op/op.cpp", 3, 10, "missing.h: No such file or directory")),
    ("/b/op/op.cu(41): error: identifier \"bar\" is undefined\n", ("/b/op/op.cu", 41, None,
                                                                  'identifier "bar" is undefined')),
    ("/b/op/op.cu(7): error #20-D: identifier \"baz\" is undefined\n",
     ("/b/op/op.cu", 7, None, 'identifier "baz" is undefined')),
    ("/b/x.cu(2): catastrophic error: cannot open source file \"y.h\"\n",
     ("/b/x.cu", 2, None, 'cannot open source file "y.h"')),
    ("Error building extension 'x': [2/2] c++ unit0.o -o x.so\nunit0.cpp:(.text+0x1a): undefined reference to "
     "`foo()'\ncollect2: error: ld returned 1 exit status\n",
     (None, None, None, "unit0.cpp:(.text+0x1a): undefined reference to `foo()'")),
    ("/b/op/op.cpp:5:3: warning: unused variable 'y'\nninja: build stopped\n", None),
])
def test_first_compiler_error(log, expected):
    assert build.first_compiler_error(log) == expected


def test_a_log_without_a_recognised_error_shows_its_end():
    log = "\n".join(f"line {i}" for i in range(100))
    text = str(BuildError("fusegen: building op(s) x failed", log, log_path="/k/build.log"))
    assert "compiler log (last 20 lines)" in text and "line 99" in text and "line 79" not in text
    assert text.endswith("full compiler log: /k/build.log (the sources are beside it)")
    one_line = str(BuildError("fusegen: the cache directory was deleted three times"))
    assert "\n" not in one_line


@pytest.mark.skipif(not shutil.which("nvcc"), reason="needs nvcc")
def test_first_error_of_a_real_nvcc_log(tmp_path):
    source = tmp_path / "bad.cu"
    source.write_text("// fusegen test\n__global__ void k(float* p) {\n    p[0] = undefined_thing;\n}\n")
    r = subprocess.run(["nvcc", "-c", str(source), "-o", str(tmp_path / "bad.o")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0
    assert build.first_compiler_error(r.stdout + r.stderr) == (
        str(source), 3, None, 'identifier "undefined_thing" is undefined')

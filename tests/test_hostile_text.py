"""User text that tries to become code: a regenerate command or a function's qualified name
with a line break, a backslash before the line's end, `*/`, quotes, trigraphs, non-ASCII.
Each reaches the generated C++ only inside a comment or a string literal (fusegen/codegen/escape.py),
shown by compiling it: the text compiled as code would run `system("touch PWNED")` at start.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from fusegen.codegen import escape
from fusegen.api import Request, generate
from fusegen.errors import SpecError

CXX = os.environ.get("CXX", "c++")

PAYLOAD = '\n#include <cstdlib>\nstatic int x = system("touch PWNED");'

HOSTILE = [
    PAYLOAD,
    "fusegen x \\",                               # a backslash at the line's end splices the next line
    "fusegen x \\   ",                            # GCC splices across trailing blanks too
    "a */ int y = system(\"touch PWNED\"); /* b",  # the end of a block comment
    "a \r static int z = system(\"touch PWNED\");",
    'quote " and \\" and \\\\',
    "trigraph ??/",
    "??= ??( ??' ???/",
    "tab\there, form feed\f, vertical tab\v, nul\0, escape\x1b",
    "caf\u00e9 \u2028 line separator \u2029 \U0001f600",
    "\\x41 \\101 \\u0041 \\n",                     # escapes already spelled out
    "/* nested? */ */ /* //",
    "",
    "   ",
]


def _compile(source: str, tmp: Path, run: bool = False, *flags: str) -> subprocess.CompletedProcess:
    path = tmp / "check.cpp"
    path.write_text(source)
    command = [CXX, "-std=c++17", "-Wall", "-Wextra", "-Werror", *flags, str(path)]
    command += ["-o", str(tmp / "check")] if run else ["-fsyntax-only"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp)
    assert result.returncode == 0, result.stderr
    if run:
        return subprocess.run([str(tmp / "check")], capture_output=True, cwd=tmp, timeout=60)
    return result


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_c_comment_is_one_line_that_cannot_end_a_comment(text):
    body = escape.c_comment(text)
    assert all(" " <= ch <= "~" for ch in body), body
    assert "*/" not in body and "/*" not in body and "??" not in body
    assert not body.endswith(("\\", " ")), body


def test_c_comment_keeps_ordinary_text():
    command = 'fusegen "a*b+c" --name fma --inputs a,b,c'
    assert escape.c_comment(command) == command
    assert escape.c_comment("d/dx = 1/x  (= d/da: computed and written once)") == \
        "d/dx = 1/x  (= d/da: computed and written once)"
    assert escape.c_comment("a\nb\\c\\") == "a\\nb\\\\c\\x5c"


def test_hostile_text_in_comments_and_literals_compiles_as_comments_and_data(tmp_path):
    """Every hostile string in a `//` comment, in a block comment and in a string literal:
    the program compiles warning-free, runs no command, and each literal's bytes are the
    string's UTF-8."""
    lines = ["#include <cstdio>"]
    for i, text in enumerate(HOSTILE):
        lines += [f"// {escape.c_comment(text)}",
                  f"/* {escape.c_comment(text)} */",
                  f"static const char kText{i}[] = {escape.c_string(text)};"]
    lines += ["int main() {"]
    lines += [f"  std::fwrite(kText{i}, 1, sizeof kText{i} - 1, stdout); std::fputc('|', stdout);"
              for i in range(len(HOSTILE))]
    lines += ["  return 0;", "}"]
    # -trigraphs: trigraphs would be read even where the standard (C++17) no longer has them
    result = _compile("\n".join(lines) + "\n", tmp_path, True, "-trigraphs", "-Wno-trigraphs")
    assert result.returncode == 0
    assert result.stdout == b"".join(t.encode("utf-8") + b"|" for t in HOSTILE)
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("text", HOSTILE + ["'''", '"""', "\\", "\udc80"], ids=range(len(HOSTILE) + 4))
def test_py_string_is_one_literal_of_the_text(text):
    tree = ast.parse(f"value = {escape.py_string(text)}\n")
    (assign,) = tree.body
    assert isinstance(assign.value, ast.Constant) and assign.value.value == text
    tup = ast.parse(escape.py_strings([text, "b"]), mode="eval").body
    assert isinstance(tup, ast.Tuple) and [e.value for e in tup.elts] == [text, "b"]


def test_py_string_ignores_a_subclass_repr():
    class Sneaky(str):
        def __repr__(self):
            return "__import__('os').system('touch PWNED')"

    assert escape.py_string(Sneaky("x")) == "'x'"
    with pytest.raises(TypeError):
        escape.py_string(b"x")


def _run_generated(files: dict[str, str], header: str, tmp: Path):
    """The op's header, included twice into a program that is run (a header comment that
    let code out would run `touch PWNED`; one that swallowed `#pragma once` would redefine
    the math), and its .cpp compiled (syntax only: the runtime's torch half is not here)."""
    for name, text in files.items():
        (tmp / name).write_text(text)
    runtime = f"-I{Path(__file__).resolve().parent.parent / 'templates' / 'runtime'}"  # _runtime/'s sources
    result = _compile(f'#include "{header}"\n#include "{header}"\nint main() {{ return 0; }}\n', tmp, True,
                      f"-I{tmp}", runtime)
    assert result.returncode == 0 and not (tmp / "PWNED").exists()
    _compile(f'#include "{header[:-2]}.cpp"\n', tmp, False, f"-I{tmp}", runtime)
    assert not (tmp / "PWNED").exists()


def test_the_harness_sees_code_let_out_of_a_comment(tmp_path):
    """The check of the next tests catches the attack when nothing escapes it."""
    (tmp_path / "raw.h").write_text(f"#pragma once\n// Regenerate with:\n//   {PAYLOAD}\n")
    _compile('#include "raw.h"\nint main() { return 0; }\n', tmp_path, True, f"-I{tmp_path}",
             "-Wno-unused-variable", "-Wno-unused-result")
    assert (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("command", [PAYLOAD, "fusegen x \\", "a */ b ??/"], ids=["newline", "backslash", "block"])
def test_request_command_stays_in_the_header_comment(tmp_path, command):
    files = generate(Request("a*b+c", name="hostile_cmd", command=command)).files
    for name in ("hostile_cmd.h", "hostile_cmd.cpp", "hostile_cmd.cu"):
        code = [line for line in files[name].splitlines() if "PWNED" in line or "cstdlib" in line]
        assert all(line.startswith("//") for line in code), code
        assert f"//   {escape.c_comment(command)}\n" in files[name]
    _run_generated(files, "hostile_cmd.h", tmp_path)


def test_fused_qualname_stays_in_the_header_comment(tmp_path):
    """@fused writes the function's module and qualified name into the regenerate command;
    both are any string a program sets."""
    from fusegen.frontend import decorator
    def hostile_qualname(x):
        return x * 3.0

    hostile_qualname.__qualname__ = "f" + PAYLOAD
    hostile_qualname.__module__ = "m */\n#define system"
    fused = decorator.fused(hostile_qualname, name="hostile_qualname")
    try:
        files = fused._generated.files
    finally:
        with decorator._PENDING_LOCK:  # never built: only its files are looked at
            decorator._PENDING[:] = [f for f in decorator._PENDING if f is not fused]
    assert "on m */\\n#define system.f\\n#include <cstdlib>" not in files["hostile_qualname.h"]
    assert "on m *\\x2f\\n#define system.f\\n#include <cstdlib>\\nstatic int x" in files["hostile_qualname.h"]
    _run_generated(files, "hostile_qualname.h", tmp_path)


def test_render_refuses_a_name_that_is_no_identifier():
    """A spec made by hand, not by the parser, cannot paste a name into the code either."""
    from fusegen.api import _with_c_names
    from fusegen.codegen.printer import print_op
    from fusegen.codegen.render import render

    spec = generate(Request("a*b", name="hostile_name")).spec
    printed = print_op(_with_c_names(spec))
    for bad in ['x", system("touch PWNED"), "', "x\ny", "__x", "int"]:
        with pytest.raises(SpecError, match="op name"):
            render(dataclasses.replace(spec, name=bad), printed)
        with pytest.raises(SpecError, match="input"):
            render(dataclasses.replace(spec, inputs=(bad, "b")), printed)

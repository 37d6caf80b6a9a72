"""The generated C++ reads like careful hand-written code: lines of at most 100 columns
(generated/, the runtime included), no GNU extension (an op with no scalars, no backward
or no forward mode compiles under -Wpedantic -Werror: no zero-length array), and the
descriptor set field by field."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from fusegen.api import Request, generate
from fusegen.codegen.wrap import WIDTH, wrap
from fusegen.files import RUNTIME_FOLDER, runtime_files, write

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated"
SOURCES = (".h", ".cuh", ".cu", ".cpp")


def test_generated_lines_fit_in_100_columns():
    files = [p for p in sorted(GENERATED.glob("*/*")) if p.suffix in SOURCES]
    assert any(p.parent.name == RUNTIME_FOLDER for p in files) and len(files) > 60
    long = [f"{p.relative_to(ROOT)}:{i}: {len(line)} columns"
            for p in files for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > WIDTH]
    assert not long, "\n".join(long[:20])


def test_long_lines_wrap_at_spaces_only():
    """A wrapped line differs from the original by whitespace only, and a string literal
    split over two lines concatenates back to the same text."""
    code = ('  def.backward_schema = "x_backward(Tensor dout, Tensor in_a, Tensor in_b, Tensor in_c, '
            'Tensor in_d, bool[4] output_mask) -> Tensor[]";')
    lines = wrap(code).split("\n")
    assert len(lines) == 2 and all(len(line) <= WIDTH for line in lines)
    assert lines[0].endswith('"') and lines[1].lstrip().startswith('"')
    assert "".join(line.strip() for line in lines).replace('""', "") == code.strip()
    comment = "//   out = " + " + ".join(f"a{i}*b{i}" for i in range(40))
    wrapped = wrap(comment).split("\n")
    assert all(line.startswith("//") and len(line) <= WIDTH for line in wrapped)
    assert " ".join(line[2:].strip() for line in wrapped) == comment[2:].strip()
    assert wrap("#define X " + "y " * 60) == "#define X " + "y " * 60  # never a directive


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("expr, name", [("a+b", "pd_add"), ("x*y + 1", "pd_noscalar"),
                                         ("a*alpha + b", "pd_scalar")])
def test_op_sources_compile_under_pedantic(tmp_path, expr, name):
    """Every .cpp of an op (and its auxiliary ops) with the runtime's headers, as g++
    -std=c++17 -Wall -Wextra -Wpedantic -Werror: the op's sources include no torch header,
    so this needs the compiler alone. `a+b` has no scalars and no backward kernel; a
    zero-length array (`kScalarNames[] = { }`) is a GNU extension that -Wpedantic refuses."""
    scalars = ("alpha",) if "alpha" in expr else ()
    files = generate(Request(expr, name=name, scalars=scalars)).files
    assert not any("[] = {  }" in text or "[] = { }" in text for text in files.values())
    write(files, tmp_path / name)
    write(runtime_files(), tmp_path / RUNTIME_FOLDER)
    units = sorted((tmp_path / name).glob("*.cpp"))
    assert units
    for cpp in units:
        r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Wpedantic", "-Werror",
                            f"-I{tmp_path / RUNTIME_FOLDER}", str(cpp)], capture_output=True, text=True)
        assert r.returncode == 0 and not r.stderr, r.stderr


def test_descriptor_fields_are_named():
    """The OpDef is set field by field in describe(), not as a positional aggregate."""
    text = generate(Request("a*b+c", name="pd_fma")).files["pd_fma.cpp"]
    body = text[text.index("OpDef describe() {"):text.index("const OpDef kDef = describe();")]
    assert "def.name = \"pd_fma\";" in body and "def.backward_cpu = backward_cpu;" in body
    assert "const OpDef kDef = {" not in text
    assert text.index("// Registers, when its library is loaded") < text.index("#include")

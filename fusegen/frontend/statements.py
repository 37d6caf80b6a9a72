"""Statement programs: several assignments, read with the eager meaning.

    m = beta1*m + (1-beta1)*g; v = beta2*v + (1-beta2)*g*g; p = p - lr*m/(sqrt(v)+eps)

Statements are separated by `;` or newlines. Assigning to an input updates that input in
place (a *step op*, ir/step.py); any other assigned name is a temporary; a trailing
expression is the result (a program of temporaries and a result is an ordinary op). Each
read sees the value its name has at that point, as the same lines run eagerly: a name read
after its assignment reads the assigned expression, so the program becomes one expression
per updated input, in the inputs' original values.

An input is a name read before it is assigned (or named in `inputs=`); a name assigned
before any read is a temporary. As everywhere, the text is parsed with `ast` against the
allowlist of parse.py and never evaluated.
"""

from __future__ import annotations

import ast
import sympy

from fusegen.errors import ParseError, SpecError
from fusegen.frontend import parse as _parse
from fusegen.ir import names
from fusegen.ir.expr import Parsed, ParsedProgram

MAX_STATEMENTS = 64


def is_program(text: object) -> bool:
    """Whether `text` is several statements (an assignment among them), not one expression."""
    if not isinstance(text, str) or ("=" not in text and ";" not in text and "\n" not in text.strip()):
        return False
    try:
        module = ast.parse(text.strip(), mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return any(isinstance(s, (ast.Assign, ast.AugAssign, ast.AnnAssign)) for s in module.body) or len(module.body) > 1


def parse_program(text: str, inputs=None, scalars=()) -> ParsedProgram | Parsed:
    """Parse statements. A program that updates an input is a ParsedProgram; one of
    temporaries and a trailing result is a Parsed, the ordinary op it spells."""
    if not isinstance(text, str):
        raise ParseError(f"expression must be a string, got {type(text).__name__}", repr(text)[:80])
    if len(text) > _parse.MAX_LENGTH:
        raise ParseError(f"program too long ({len(text)} characters, limit {_parse.MAX_LENGTH})", text[:80] + "...")
    _parse._check_ascii(text)
    source = "\n".join(line.strip() for line in text.strip().splitlines())
    try:
        module = ast.parse(source, mode="exec")
    except SyntaxError as err:
        line = (source.splitlines() or [source])[max(0, (err.lineno or 1) - 1)]
        raise ParseError(f"invalid syntax ({err.msg})", line, (err.offset or 1) - 1,
                         "expected statements `name = expression` separated by ';' or newlines") from None
    except (RecursionError, MemoryError, ValueError) as err:
        raise ParseError(f"program could not be parsed ({type(err).__name__})", text[:80]) from None
    _parse._check_limits(source, module)
    body = module.body
    if not body:
        raise ParseError("program is empty", text)
    if len(body) > MAX_STATEMENTS:
        raise ParseError(f"program too long ({len(body)} statements, limit {MAX_STATEMENTS})", text[:80] + "...")
    scalars = _scalar_names(scalars)
    given = None if inputs is None else tuple(p.strip() for p in inputs.split(",") if p.strip()) \
        if isinstance(inputs, str) else tuple(inputs)
    conv = _parse._Converter(source)
    seen: list[str] = []           # tensor names in order of first appearance
    temporaries: set[str] = set()
    values: dict[str, sympy.Expr] = {}  # updated input -> its value so far
    first_write: dict[str, int] = {}
    last_read: dict[str, int] = {}
    used_scalars: set[str] = set()
    result = None
    for index, stmt in enumerate(body):
        last = index == len(body) - 1
        if isinstance(stmt, ast.Expr) and last:
            value_node = stmt.value
            target = None
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            value_node, target = stmt.value, stmt.targets[0].id
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            conv.fail(stmt, "augmented assignment is not supported", f"write {stmt.target.id} = {stmt.target.id} ... "
                      "(each statement is `name = expression`)")
        else:
            what = "an expression before the last statement" if isinstance(stmt, ast.Expr) else type(stmt).__name__
            conv.fail(stmt, f"unsupported statement: {what}",
                      "expected `name = expression` statements, optionally ending in one expression")
        conv.seen.clear()
        expr = conv.convert(value_node)
        for n in conv.seen:  # names read here in their original value
            if n in scalars:
                used_scalars.add(n)
                continue
            if n not in seen:
                seen.append(n)
            last_read[n] = index
        if target is None:
            result = expr
            continue
        problem = names.name_problem(target)
        if problem:
            conv.fail(stmt, f"assigned name '{target}' {problem}")
        if target in scalars:
            conv.fail(stmt, f"assignment to scalar '{target}'", "scalars are read-only numbers; assign to a tensor")
        is_input = target in seen or (given is not None and target in given)
        if is_input and target in temporaries:
            conv.fail(stmt, f"'{target}' is a temporary here but also an input",
                      "use another name for the temporary")
        if is_input:
            if target not in seen:
                seen.append(target)
            values[target] = expr
            first_write.setdefault(target, index)
        else:
            temporaries.add(target)
        conv.bindings[target] = expr  # later reads see the assigned value
    flat = "; ".join(_parse._unparse(source, s) if not isinstance(s, ast.Expr) else
                     _parse._unparse(source, s.value) for s in body)
    for _, e in values.items():
        _parse._check_literals(flat, e)
    ordered, scalars = _parse._order_names(flat, seen + [s for s in scalars if s in used_scalars], given, scalars)
    if not values:
        if result is None:
            raise ParseError("program has no result and updates no input", flat,
                             hint="end it with an expression, or assign to an input to update it in place")
        _parse._check_literals(flat, result)
        return Parsed(flat, result, ordered, scalars)
    if result is not None:
        raise SpecError(f"program {flat!r} updates {', '.join(values)} in place and also ends in an expression; "
                        "a step op has no result: assign the value to an input, or drop the last expression")
    reads = tuple(i for i in ordered if i in last_read)
    updates = tuple((i, values[i]) for i in ordered if i in values)
    return ParsedProgram(flat, ordered, scalars, updates, reads, first_write, last_read)


def _scalar_names(scalars) -> tuple[str, ...]:
    if isinstance(scalars, str):
        scalars = [p.strip() for p in scalars.split(",") if p.strip()]
    return tuple(scalars or ())


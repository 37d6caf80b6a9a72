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


def parse_program(text: str, inputs=None, scalars=(), shadowing=None) -> ParsedProgram | Parsed:
    """Parse statements. A program that updates an input is a ParsedProgram; one of
    temporaries and a trailing result is a Parsed, the ordinary op it spells. `shadowing`:
    the names of a @fused function (parameter or local name) that no call may use as a
    function or module name (parse._Converter.shadowing)."""
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
    conv.shadowing = dict(shadowing or {})
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
        if target is None:  # the result: one expression, or an op's outputs (a tuple)
            outputs, joined = _parse._outputs(conv, value_node)
            expr = outputs[0]
        else:
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
            continue  # (outputs, joined: from the branch above)
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
        for e in outputs:
            _parse._check_literals(flat, e)
        return Parsed(flat, outputs, ordered, scalars, joined, *_parse._random_of(conv, scalars))
    if conv.streams:
        raise SpecError(f"program {flat!r} updates {', '.join(values)} in place and draws random numbers; "
                        "a step op draws none: apply the dropout in an op of its own")
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



# -- @fused functions that update their parameters ------------------------------------------

COPY = "copy_"


def updates_in_place(source: str) -> bool:
    """Whether a @fused function's body calls `<name>.copy_(...)` anywhere: then it is a step
    function (parse_function), not one expression."""
    try:
        func = ast.parse(source).body[0]
    except (SyntaxError, IndexError, ValueError, RecursionError, MemoryError):
        return False
    if not isinstance(func, ast.FunctionDef):
        return False
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == COPY
               for stmt in func.body for n in ast.walk(stmt))


def parse_function(source: str, params, scalars) -> ParsedProgram:
    """A @fused function body of `p.copy_(expr)` updates and `t = expr` temporaries, as eager
    PyTorch runs it (a read after `p.copy_` sees the new value), read as the statement
    program `t = expr; p = expr` of its tensor parameters: the same ParsedProgram, and the
    same text in spec.json, as `fusegen.fuse` of that program makes. It ends without a
    value (no `return`, or `return None`), as a function that updates in place does."""
    _parse._check_ascii_code(source)
    try:
        module = ast.parse(source)
    except SyntaxError as err:
        raise ParseError(f"invalid syntax: {err.msg}", source.splitlines()[0]) from None
    func = module.body[0] if module.body else None
    if not isinstance(func, ast.FunctionDef):
        raise ParseError("@fused expects a plain function definition", source.splitlines()[0])
    _parse._check_limits(source, func)
    conv = _parse._Converter(source)  # for its errors: line and caret in the function's source
    params, scalars = list(params), list(scalars)
    tensors = [p for p in params if p not in scalars]
    body = list(func.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # docstring
    if body and isinstance(body[-1], ast.Return):
        value = body[-1].value
        if value is not None and not (isinstance(value, ast.Constant) and value.value is None):
            conv.fail(body[-1], f"@fused function '{func.name}' updates parameters in place (copy_) and also "
                      "returns a value", "a function that updates its parameters returns nothing: drop the "
                      "return, or compute the value in another @fused function")
        body = body[:-1]
    shadowing = {p: "parameter" for p in params}
    lines = []
    for stmt in body:
        target = _copy_target(conv, stmt, func.name, params, scalars)
        if target is not None:
            value = stmt.value.args[0]
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            target, value = stmt.targets[0].id, stmt.value
            if target in params:
                conv.fail(stmt, f"assignment to parameter '{target}' rebinds the name and leaves the tensor "
                          "unchanged", f"write {target}.copy_(...) to update it in place, or use a new name")
            shadowing.setdefault(target, "local name")
        else:
            conv.fail(stmt, f"unsupported statement in @fused function '{func.name}': {type(stmt).__name__}",
                      "expected `p.copy_(expression)` updates and `name = expression` lines")
        nested = next((n for n in ast.walk(value) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                       and n.func.attr == COPY), None)
        if nested is not None:
            conv.fail(nested, "copy_ inside an expression", "write each update as a statement of its own: "
                      "p.copy_(expression)")
        lines.append(f"{target} = {_parse._unparse(source, value)}")
    if not lines:
        conv.fail(func, f"@fused function '{func.name}' has no statements")
    parsed = parse_program("\n".join(lines), inputs=tensors, scalars=scalars, shadowing=shadowing)
    if not isinstance(parsed, ParsedProgram):  # unreachable: a copy_ is an update of a parameter
        raise SpecError(f"@fused function '{func.name}' updates no parameter")
    return parsed


def _copy_target(conv, stmt, function: str, params, scalars) -> str | None:
    """The parameter a `p.copy_(expr)` statement updates, after its checks; None for any
    other statement."""
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == COPY):
        return None
    owner = call.func.value
    spelled = owner.id if isinstance(owner, ast.Name) else _parse._unparse("", owner)
    if not isinstance(owner, ast.Name) or owner.id not in params:
        what = "a local name" if isinstance(owner, ast.Name) else "an expression"
        conv.fail(call, f"copy_ on {what} ('{spelled}'), not a parameter of '{function}'",
                  "copy_ updates a tensor parameter in place: p.copy_(expression)")
    if owner.id in scalars:
        conv.fail(call, f"copy_ on scalar parameter '{owner.id}'",
                  "scalars are read-only numbers; update a tensor parameter")
    if len(call.args) != 1 or call.keywords or isinstance(call.args[0], ast.Starred):
        conv.fail(call, f"{owner.id}.copy_ takes one argument here, got "
                  f"{len(call.args)} positional and {len(call.keywords)} keyword",
                  f"write {owner.id}.copy_(expression): the update's value alone (no non_blocking=)")
    return owner.id

"""The only reader of user text.

An expression is parsed with `ast.parse(mode="eval")` and walked against an allowlist
of node types and function names (see ir/primitives.py). Nothing the user wrote is ever
evaluated: no eval, exec, sympify or parse_expr. Names become real sympy symbols.
"""

from __future__ import annotations

import ast
import io
import tokenize

import sympy

from fusegen.ir import dag
from fusegen.ir import limits
from fusegen.ir import primitives as fn
from fusegen.ir import names
from fusegen.ir.expr import Parsed, symbol
from fusegen.ir.names import check_identifier
from fusegen.errors import ParseError, SpecError

MAX_LENGTH = 4000      # characters of expression text
MAX_DEPTH = 48         # nesting depth of the syntax tree
MAX_NODES = 2000       # syntax nodes in one expression
MAX_INT = 2 ** 53      # integer literals beyond this are not exact in double anyway
MAX_RANDOM = 8         # random streams (rand_like, dropout) of one op

# Python's operators on tensors, one eager op each (ir/primitives.py keeps them as written).
_BINOPS = {
    ast.Add: fn.add,
    ast.Sub: fn.sub,
    ast.Mult: fn.mul,
    ast.Div: fn.div,
    ast.Pow: None,  # handled by _pow: constant folding needs a guard
}
_BINOP_SPELLING = {ast.Mod: "%", ast.FloorDiv: "//", ast.MatMult: "@", ast.LShift: "<<",
                   ast.RShift: ">>", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^"}
_COMPARE = {ast.Lt: fn.Less, ast.LtE: fn.LessEqual, ast.Gt: fn.Greater, ast.GtE: fn.GreaterEqual,
            ast.Eq: fn.Equal, ast.NotEq: fn.NotEqual}


class _Converter:
    """Walks an allowlisted ast and builds sympy. `source` is the text columns refer to."""

    def __init__(self, source: str, bindings: dict[str, sympy.Expr] | None = None,
                 line_offset: int = 0):
        self.lines = source.splitlines() or [source]
        self.bindings = dict(bindings or {})
        self.line_offset = line_offset
        self.seen: list[str] = []  # input names in order of first appearance
        self.streams = 0  # random streams drawn so far (rand_like, dropout), in text order
        self.probabilities: list[str] = []  # scalar names used as a dropout's p
        self.coarse: list[int] = []  # the streams of dropouts, only compared with 1 - p
        # A @fused function's parameters and locals: Python would call or look into these,
        # not the function or module of that name (`def f(exp): return exp(exp)`).
        self.shadowing: dict[str, str] = {}

    # -- errors ---------------------------------------------------------------
    def fail(self, node: ast.AST | None, message: str, hint: str | None = None, col: int | None = None):
        if node is None or not hasattr(node, "lineno"):
            raise ParseError(message, self.lines[0], None, hint)
        line = self.lines[min(node.lineno - 1 - self.line_offset, len(self.lines) - 1)]
        raise ParseError(message, line, _char_col(line, node.col_offset) if col is None else col, hint)

    # -- dispatch ---------------------------------------------------------------
    def convert(self, node: ast.AST) -> sympy.Expr:
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            self.fail(node, f"unsupported syntax: {type(node).__name__}",
                      "expected numbers, names, + - * / **, comparisons and function calls")
        return method(node)

    def _Expression(self, node):
        return self.convert(node.body)

    def _Constant(self, node):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(node, f"unsupported constant {value!r}", "expected an int or float literal")
        if isinstance(value, int) and abs(value) > MAX_INT:
            self.fail(node, f"integer literal too large (limit 2**53), got {value}")
        if not fn.literal_ok(float(value)):
            self.fail(node, f"literal {value!r} is outside the float32 range ({fn.LITERAL_RANGE})")
        return _number(float(value))

    def _Name(self, node):
        # A bare name is an input (or a local of a @fused function), as in Python: `e`,
        # `pi` or `exp` without a call are names the user chose, not constants or functions.
        name = node.id
        if name in self.bindings:
            return self.bindings[name]
        problem = names.name_problem(name)
        if problem:
            self.fail(node, f"input name '{name}' {problem}")
        if name not in self.seen:
            self.seen.append(name)
        return symbol(name)

    def _Attribute(self, node):
        dotted = dotted_name(node)
        if dotted in fn.CONSTANTS:
            self._check_shadowed(node, dotted)
            return fn.CONSTANTS[dotted]
        self.fail(node, f"unknown name '{dotted}'",
                  "expected an input name, math.pi or math.e")

    def _UnaryOp(self, node):
        operand = self.convert(node.operand)
        if isinstance(node.op, ast.USub):
            return fn.neg(operand)
        if isinstance(node.op, ast.UAdd):
            return operand
        self.fail(node, f"unsupported unary operator {type(node.op).__name__}", "expected - or +")

    def _BinOp(self, node):
        # A chain a + b + c + ... nests to the left, one level per operator: it is walked
        # with a list, not by recursion, so a long flat sum meets no recursion limit. The
        # order is recursion's: every operator checked outside in, then the operands.
        spine = []
        while isinstance(node, ast.BinOp):
            op = type(node.op)
            if op not in _BINOPS:
                spelled = _BINOP_SPELLING.get(op, op.__name__)
                self.fail(node, f"unsupported operator '{spelled}'", "expected + - * / or **",
                          col=self._operator_col(node, spelled))
            spine.append(node)
            node = node.left
        value = self.convert(node)
        for node in reversed(spine):
            value = self._binop(node, value, self.convert(node.right))
        return value

    def _binop(self, node, left, right):
        op = type(node.op)
        if op is ast.Pow:
            return self._pow(node, left, right)
        try:
            return _BINOPS[op](left, right)
        except ValueError as err:  # 1/0 between constants
            self.fail(node, str(err))

    def _operator_col(self, node, spelled):
        """The caret goes under the operator, not under the start of its left operand
        (ast gives a BinOp only the position of its first character)."""
        left = node.left
        if getattr(left, "end_lineno", None) == node.lineno == getattr(node.right, "lineno", None):
            line = self.lines[min(node.lineno - 1 - self.line_offset, len(self.lines) - 1)]
            col = line.find(spelled, left.end_col_offset, node.right.col_offset)
            if col >= 0:
                return col
        return None

    def _pow(self, node, base, exponent):
        if base.is_Number and exponent.is_Number:
            # Fold in float with an overflow guard: sympy would compute 9**9**9 exactly.
            try:
                value = float(base) ** float(exponent)
            except (OverflowError, ZeroDivisionError):
                value = float("inf")
            if isinstance(value, complex) or not fn.literal_ok(value):
                self.fail(node, f"constant power is not a finite real float32 value ({fn.LITERAL_RANGE})")
            return _number(value)
        return fn.power(base, exponent)

    def _Compare(self, node):
        return fn.indicator(self.relation(node))

    def relation(self, node):
        if len(node.ops) != 1:
            self.fail(node, "chained comparisons are not supported",
                      "write (a < b) * (b < c), as torch tensors need too")
        op = type(node.ops[0])
        if op not in _COMPARE:
            self.fail(node, f"unsupported comparison {op.__name__}", "expected < <= > >= == !=")
        return _COMPARE[op](self.convert(node.left), self.convert(node.comparators[0]))

    def _Call(self, node):
        func = node.func
        method = tensor_method(node)
        if method in fn.REDUCTION_NAMES:
            return self._reduce(node, method, func.value, node.args, method=True)  # e.sum(-1, ...)
        if method == fn.GATHER:
            return self._gather(node, func.value, node.args, method=True)  # e.gather(-1, index)
        if method == "detach":
            if node.args or node.keywords:
                self.fail(node, "detach() takes no arguments", "expected e.detach()")
            return fn.detach(self.convert(func.value))  # e.detach()
        dotted = dotted_name(func)
        if dotted is None:
            self.fail(node, "only named functions can be called", "e.g. exp(x) or torch.exp(x)")
        name = fn.resolve(dotted)
        if name is None:
            self._unknown_function(node, dotted)
        self._check_shadowed(node, dotted)
        if name in fn.RANDOM_NAMES:
            return self._random(node, name)
        if name in fn.REDUCTION_NAMES:
            first = input_argument(node)
            if first is None:
                self.fail(node, f"{name}() is missing argument 'input'",
                          f"expected torch.{name}(input, -1, keepdim=True)")
            return self._reduce(node, name, first, node.args[1:], method=False)
        if name == fn.GATHER:
            first = input_argument(node)
            if first is None:
                self.fail(node, "gather() is missing argument 'input'", "expected torch.gather(x, -1, index)")
            return self._gather(node, first, node.args[1:], method=False)
        spec = fn.FUNCTIONS[name]
        args = self._bind(node, name, spec)
        return spec.build(*args)

    def _last_dim_slots(self, node, name, params, rest, method: bool, form: str, what: str) -> dict:
        """The arguments after the tensor of a call along the last dimension (`params`:
        dim and the rest, positional or keyword), with `dim` checked to be -1 (or (-1,))."""
        slots = dict(zip(params, rest))
        if len(rest) > len(params):
            self.fail(node, f"{name}() takes at most {len(params) + 1} arguments, got "
                      f"{len(rest) + (0 if method else 1)}", f"expected {form}")
        for kw in node.keywords:
            if kw.arg == "input" and not method:
                continue
            if kw.arg not in params:
                self.fail(node, f"{name}() got an unexpected keyword argument {kw.arg!r}", f"expected {form}")
            if kw.arg in slots:
                self.fail(node, f"{name}() got multiple values for argument '{kw.arg}'")
            slots[kw.arg] = kw.value
        dim = slots.get("dim")
        if dim is None or not _is_last_dim(dim):
            got = "no dim" if dim is None else f"dim={ast.unparse(dim)}"
            self.fail(node, f"{name}() {what} the last dimension only: expected dim=-1, got {got}",
                      f"expected {form}")
        return slots

    def _reduce(self, node, name, operand, rest, method: bool):
        """A reduction over the last dimension, torch's call as written: `dim` must be -1
        (or (-1,)) and `keepdim` True, so that the value broadcasts back over its row as
        eager's does; the row kernels reduce nothing else."""
        form = f"x.{name}(-1, keepdim=True)" if method else f"torch.{name}(x, -1, keepdim=True)"
        slots = self._last_dim_slots(node, name, ("dim", "keepdim"), rest, method, form, "reduces over")
        keep = slots.get("keepdim")
        if not (isinstance(keep, ast.Constant) and keep.value is True):
            got = "no keepdim" if keep is None else f"keepdim={ast.unparse(keep)}"
            self.fail(node, f"{name}() needs keepdim=True, got {got}: the reduced value broadcasts back over "
                      "its row", f"expected {form}")
        return fn.REDUCTION_NAMES[name](self.convert(operand))

    def _gather(self, node, operand, rest, method: bool):
        """x.gather(-1, index) with an index of one value per row (shape (..., 1)): the row's
        element at it. The index reads inputs and numbers only; an input it reads holds
        integers (ir/primitives.gather)."""
        form = "x.gather(-1, index)" if method else "torch.gather(x, -1, index)"
        slots = self._last_dim_slots(node, fn.GATHER, ("dim", "index"), rest, method, form, "picks along")
        if "index" not in slots:
            self.fail(node, "gather() is missing argument 'index'", f"expected {form}")
        index = self.convert(slots["index"])
        if any(n == fn.COLUMN or fn.is_reduction(n) for n in dag.postorder([index])):
            self.fail(slots["index"], "gather()'s index must be one value per row of inputs and numbers "
                      "(a reduction or another gather in it is not supported)", f"expected {form}")
        return fn.gather(self.convert(operand), index)

    def _random(self, node, name):
        """torch.rand_like(x): one uniform in [0, 1) per element of the op's broadcast shape;
        F.dropout(x, p=0.5, training=True) (and torch.dropout(x, p, train)): x scaled by
        1/(1-p) where a fresh uniform is below 1 - p, else 0. Each call is its own stream."""
        if name == "rand_like":
            form = "torch.rand_like(x)"
            if len(node.args) != 1 or node.keywords:
                self.fail(node, "rand_like() takes one tensor argument and no keywords (it draws in "
                          "the op's dtype and device)", f"expected {form}")
            operand = self.convert(node.args[0])
            return self._stream(node, operand, form)
        form = "F.dropout(x, p=0.5, training=True)"
        params = ("input", "p", "training", "inplace")
        slots = dict(zip(params, node.args))
        if len(node.args) > len(params):
            self.fail(node, f"dropout() takes at most {len(params)} arguments, got {len(node.args)}", f"expected {form}")
        for kw in node.keywords:
            arg = "training" if kw.arg == "train" else kw.arg
            if arg not in params:
                self.fail(node, f"dropout() got an unexpected keyword argument {kw.arg!r}", f"expected {form}")
            if arg in slots:
                self.fail(node, f"dropout() got multiple values for argument '{arg}'")
            slots[arg] = kw.value
        if "input" not in slots:
            self.fail(node, "dropout() is missing argument 'input'", f"expected {form}")
        inplace = slots.get("inplace")
        if inplace is not None and not (isinstance(inplace, ast.Constant) and inplace.value is False):
            self.fail(node, "dropout() of an op cannot be in place: expected inplace=False", f"expected {form}")
        p = slots.get("p")
        if p is None:
            prob = sympy.Float(0.5)
        elif isinstance(p, ast.Name) and p.id not in self.bindings:
            prob = self.convert(p)
            if p.id not in self.probabilities:
                self.probabilities.append(p.id)
        else:
            prob = self.convert(p)
            if not fn.is_number(prob):
                self.fail(p, "dropout()'s p must be a number or a scalar argument", f"expected {form}")
            if not 0 <= float(prob) <= 1:
                self.fail(p, f"dropout probability has to be between 0 and 1, but got {float(prob)!r}")
        training = slots.get("training")
        x = self.convert(slots["input"])
        if training is not None:
            if isinstance(training, ast.Constant) and isinstance(training.value, bool):
                if not training.value:
                    return x  # F.dropout in eval mode: the input itself
            elif isinstance(training, ast.Name) and training.id not in self.bindings:
                # a scalar argument: nonzero trains (a @fused function's `training: bool`)
                prob = fn.where(fn.NotEqual(self.convert(training), sympy.Integer(0)), prob, sympy.Integer(0))
            else:
                self.fail(training, "dropout()'s training must be True, False or a scalar argument",
                          f"expected {form}")
        if fn.is_number(prob) and prob == 0:
            return x  # nothing dropped, nothing drawn
        self.coarse.append(self.streams)
        u = self._stream(node, x, form)
        return fn.dropout(x, prob, u)

    def _stream(self, node, operand, form):
        if not any(not fn.is_random(s) for s in dag.free_symbols([operand])):
            self.fail(node, "a random draw needs a tensor argument: it draws one number per element "
                      "of the op's broadcast shape", f"expected {form}")
        if self.streams >= MAX_RANDOM:
            self.fail(node, f"too many random draws (limit {MAX_RANDOM} per op)")
        u = fn.random_stream(self.streams)
        self.streams += 1
        return u

    def _unknown_function(self, node, dotted: str):
        prefix, _, base = dotted.rpartition(".")
        known = fn.resolve(base)
        unsupported = fn.unsupported_hint(base)
        if prefix and known is not None:
            self.fail(node, f"unknown function '{dotted}'",
                      f"'{prefix}' is not a module fusegen reads; write {base}(...) or torch.{base}(...)")
        if unsupported is not None:
            self.fail(node, f"unsupported function '{dotted}'", unsupported)
        near = fn.suggestions(base)
        hint = ("did you mean " + " or ".join(f"'{n}'" for n in near) + "?") if near \
            else "known: " + ", ".join(fn.known_names())
        self.fail(node, f"unknown function '{dotted}'", hint)

    def _check_shadowed(self, node, dotted):
        """In a @fused function, a function or constant whose name (or module) is one of the
        function's own names: eager Python would not run it as fusegen reads it."""
        root = dotted.partition(".")[0]
        if root in self.shadowing:
            what = self.shadowing[root]
            if "." in dotted:
                message = (f"{what} '{root}' shadows the module '{root}' of '{dotted}': eager Python "
                           f"would look up '{dotted.partition('.')[2]}' on the {what}")
            else:
                message = (f"{what} '{root}' shadows the function {root}(): eager Python would call "
                           f"the {what}")
            self.fail(node, message, f"rename the {what}")

    def _bind(self, node, name, spec):
        """Positional and keyword arguments in torch's parameter names, converted to sympy."""
        params = spec.params
        required = len(params) - spec.optional
        if len(node.args) > len(params):
            self.fail(node, f"{name}() takes at most {len(params)} arguments, got {len(node.args)}")
        slots: dict[str, ast.AST] = dict(zip(params, node.args))
        for kw in node.keywords:
            if kw.arg is None or kw.arg not in params:
                self.fail(node, f"{name}() got an unexpected keyword argument {kw.arg!r}",
                          f"parameters: {', '.join(params)}")
            if kw.arg in slots:
                self.fail(node, f"{name}() got multiple values for argument '{kw.arg}'")
            slots[kw.arg] = kw.value
        missing = [p for p in params[:required] if p not in slots]
        if missing:
            self.fail(node, f"{name}() is missing argument '{missing[0]}'",
                      f"expected {name}({', '.join(params)})")
        out = []
        for p in params:
            arg = slots.get(p)
            if arg is None:
                out.append(None)
            elif name == "where" and p == "condition" and isinstance(arg, ast.Compare):
                out.append(self.relation(arg))  # a comparison is the condition itself, not 0/1
            else:
                out.append(self.convert(arg))
        return out


# The tensor methods the language reads (`e.sum(-1, keepdim=True)`, `e.detach()`).
METHODS = frozenset(fn.REDUCTION_NAMES) | {"detach", fn.GATHER}


def tensor_method(node: ast.Call) -> str | None:
    """The method name of a call `e.<method>(...)` on an expression (not a module's function:
    `torch.sum(...)` is a function), for a method of METHODS; None otherwise."""
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in METHODS and dotted_name(func.value) not in fn.PREFIXES:
        return func.attr
    return None


def input_argument(node: ast.Call) -> ast.AST | None:
    """A torch function's `input`: its first positional argument or its `input=` keyword."""
    return node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "input"), None)


def _is_last_dim(node: ast.AST) -> bool:
    """-1, or a one-element tuple or list of -1."""
    if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) == 1:
        node = node.elts[0]
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and \
        isinstance(node.operand, ast.Constant) and node.operand.value == 1 and type(node.operand.value) is int


def _number(value: float) -> sympy.Expr:
    """Integral literals become exact integers so x**2.0 prints like x**2."""
    return fn.number(value)


def dotted_name(node: ast.AST) -> str | None:
    """`torch.nn.functional.relu` for that attribute chain, None for anything but names."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


# Binary operators that chain without nesting: a+b+c+d is one level, as a reader sees it.
_CHAINS = ({ast.Add, ast.Sub}, {ast.Mult, ast.Div})


def _chain(node: ast.AST):
    return next((c for c in _CHAINS if isinstance(node, ast.BinOp) and type(node.op) in c), None)


def _check_limits(text: str, tree: ast.AST):
    """Size and nesting limits. Nesting counts parentheses and calls, not the length of a
    flat chain (a 200-term sum is depth 1). Iterative: no recursion on long input."""
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise ParseError(f"expression too large ({len(nodes)} syntax nodes, limit {MAX_NODES})",
                         text[:80] + "...")
    stack = [(tree, 0)]
    while stack:
        node, d = stack.pop()
        if d > MAX_DEPTH:
            raise ParseError(f"expression nested too deeply (limit {MAX_DEPTH})", text[:80] + "...")
        for child in ast.iter_child_nodes(node):
            same_chain = _chain(node) is not None and child is getattr(node, "left", None) \
                and _chain(child) is _chain(node)
            stack.append((child, d if same_chain else d + 1))


def _check_ascii(text: str):
    """Refuse non-ASCII before Python's parser sees it: it would read the identifier
    `𝐞𝐱𝐩` as `exp` (NFKC), and its columns are UTF-8 bytes, not characters."""
    for lineno, line in enumerate(text.splitlines() or [text]):
        for col, ch in enumerate(line):
            if ord(ch) > 127:
                raise ParseError(f"non-ASCII character {ch!r} (U+{ord(ch):04X}) at line {lineno + 1}, "
                                 f"column {col + 1}", line, col,
                                 "expected ASCII names, numbers and operators")


def _check_ascii_code(source: str):
    """A function's source may have non-ASCII in its docstring and comments, not in code."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return  # ast.parse reports it
    for tok in tokens:
        if tok.type not in (tokenize.STRING, tokenize.COMMENT) and not tok.string.isascii():
            _check_ascii(tok.line.rstrip("\n"))


def _char_col(line: str, byte_col: int) -> int:
    """ast's col_offset counts UTF-8 bytes; a caret needs characters."""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def _check_literals(text: str, tree: sympy.Expr):
    """sympy folds constants (1e30 * 1e30); what it folds must still fit in float."""
    for atom in dag.postorder([tree]):
        if isinstance(atom, sympy.Number) and atom.is_finite is not False and atom is not sympy.nan \
                and not fn.literal_ok(float(atom)):
            raise ParseError(f"constant {atom} is outside the float32 range ({fn.LITERAL_RANGE})", text)


def _order_names(text: str, seen: list[str], inputs, scalars) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if isinstance(scalars, str):  # scalars="beta" is one name, as inputs="a,b" is a list
        scalars = [p.strip() for p in scalars.split(",")]
    scalars = tuple(scalars or ())
    for s in scalars:
        check_identifier(s, "scalar")
    if len(set(scalars)) != len(scalars):
        raise SpecError(f"scalars must be distinct, got {list(scalars)}")
    for s in scalars:
        if s not in seen:
            raise SpecError(f"scalar '{s}' is not used by the expression {text!r}")
    if inputs is None:
        ordered = tuple(n for n in seen if n not in scalars)
    else:
        if isinstance(inputs, str):
            inputs = [p.strip() for p in inputs.split(",") if p.strip()]
        ordered = tuple(inputs)
        for name in ordered:
            check_identifier(name, "input")
        if len(set(ordered)) != len(ordered):
            raise SpecError(f"inputs must be distinct, got {list(ordered)}")
        clash = set(ordered) & set(scalars)
        if clash:
            raise SpecError(f"'{sorted(clash)[0]}' is listed both as an input and as a scalar")
        unknown = [n for n in seen if n not in ordered and n not in scalars]
        if unknown:
            raise SpecError(f"expression uses '{unknown[0]}', which is not among inputs={list(ordered)}")
        unused = [n for n in ordered if n not in seen]
        if unused:
            raise SpecError(f"input '{unused[0]}' is not used by the expression {text!r}")
    if not ordered:
        raise SpecError(f"expression {text!r} has no tensor input; expected at least one name")
    return ordered, scalars


def parse(text: str, inputs=None, scalars=()) -> Parsed:
    """Parse one expression. `inputs` fixes the tensor order; `scalars` are runtime floats."""
    if not isinstance(text, str):
        raise ParseError(f"expression must be a string, got {type(text).__name__}", repr(text))
    if not text.strip():
        raise ParseError("expression is empty", text)
    if len(text) > MAX_LENGTH:
        raise ParseError(f"expression too long ({len(text)} characters, limit {MAX_LENGTH})",
                         text[:80] + "...")
    _check_ascii(text)
    if "\n" in text or "\r" in text:
        raise ParseError("expression must be one line", text.splitlines()[0] if text.splitlines() else text)
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as err:
        stripped = text.strip()
        # offset 0 means "at the end of the input" (e.g. a dangling operator).
        col = min(err.offset - 1, len(stripped)) if err.offset else len(stripped)
        detail = "" if err.msg == "invalid syntax" else f" ({err.msg})"
        raise ParseError(f"invalid syntax{detail}", stripped, col,
                         "expected one Python expression, e.g. a*b+c") from None
    except (RecursionError, MemoryError, ValueError) as err:
        raise ParseError(f"expression could not be parsed ({type(err).__name__})", text[:80]) from None
    _check_limits(text, tree)
    conv = _Converter(text.strip())
    outputs, joined = _outputs(conv, tree.body)
    for expr in outputs:
        _check_literals(text, expr)
    ordered, scalars = _order_names(text, conv.seen, inputs, scalars)
    return Parsed(text.strip(), outputs, ordered, scalars, joined, *_random_of(conv, scalars))


def _random_of(conv, scalars) -> tuple[int, tuple[str, ...], tuple[int, ...]]:
    """The random streams the text draws, the scalars that are dropout probabilities, each
    of which must be a scalar (a tensor p is not F.dropout's), and the dropouts' streams."""
    for name in conv.probabilities:
        if name not in scalars:
            raise SpecError(f"dropout()'s p {name!r} must be a scalar argument, not a tensor input; "
                            f"declare it with scalars=[{name!r}] (a @fused function: `{name}: float`)")
    return conv.streams, tuple(conv.probabilities), tuple(conv.coarse)


# The concatenation an op may end in: its two outputs are then the halves of one tensor.
_CAT = ("cat", "torch.cat", "concat", "torch.concat")


def _joined(conv, node: ast.expr) -> ast.expr | None:
    """The tuple of parts of a final `torch.cat((a, b), -1)` (RoPE's rotate_half), or None
    when `node` is no concatenation."""
    dotted = dotted_name(node.func) if isinstance(node, ast.Call) else None
    if dotted not in _CAT:
        return None
    conv._check_shadowed(node, dotted)
    hint = "write torch.cat((a, b), -1): two parts along the last dimension, as the op's last operation"
    dims = list(node.args[1:]) + [k.value for k in node.keywords if k.arg == "dim"]
    extra = [k.arg for k in node.keywords if k.arg != "dim"]
    parts = node.args[0] if node.args else None
    if extra or len(dims) != 1 or not isinstance(parts, (ast.Tuple, ast.List)) or len(parts.elts) != 2:
        conv.fail(node, f"unsupported form of {dotted}", hint)
    dim = dims[0]
    minus_one = (isinstance(dim, ast.UnaryOp) and isinstance(dim.op, ast.USub) and isinstance(dim.operand, ast.Constant)
                 and dim.operand.value == 1 and type(dim.operand.value) is int)
    if not minus_one:
        conv.fail(dim, f"{dotted} joins along the last dimension only (dim=-1)", hint)
    return ast.Tuple(elts=parts.elts, ctx=ast.Load(), lineno=parts.lineno, col_offset=parts.col_offset)


def _outputs(conv, node: ast.expr) -> tuple[tuple, bool]:
    """The op's outputs and whether they are joined: one expression, a tuple of them at the
    top (`(x1*c - x2*s, x2*c + x1*s)`), or two joined by a final torch.cat along the last
    dimension; each converted in turn."""
    parts = _joined(conv, node)
    if parts is not None:
        return _outputs(conv, parts)[0], True
    if not isinstance(node, ast.Tuple):
        return (conv.convert(node),), False
    if len(node.elts) < 2:
        conv.fail(node, "an op's outputs are one expression or a tuple of at least two",
                  "drop the parentheses and the comma")
    if len(node.elts) > limits.MAX_OUTPUTS:
        conv.fail(node, f"an op has at most {limits.MAX_OUTPUTS} outputs (limits.MAX_OUTPUTS), "
                  f"got {len(node.elts)}", "split it into several ops")
    for elt in node.elts:
        if isinstance(elt, (ast.Tuple, ast.Starred)):
            conv.fail(elt, "an output must be an expression, not a nested tuple or *unpacking")
    return tuple(conv.convert(elt) for elt in node.elts), False


def parse_function(source: str, params: list[str], scalars: list[str]) -> Parsed:
    """Parse a function body: optional docstring, `name = expr` lines, then `return expr`.

    Locals are substituted as sympy trees, so the result is one expression in the params."""
    _check_ascii_code(source)
    try:
        module = ast.parse(source)
    except SyntaxError as err:
        raise ParseError(f"invalid syntax: {err.msg}", source.splitlines()[0]) from None
    func = module.body[0] if module.body else None
    if not isinstance(func, (ast.FunctionDef,)):
        raise ParseError("@fused expects a plain function definition", source.splitlines()[0])
    _check_limits(source, func)
    conv = _Converter(source)
    conv.shadowing = {p: "parameter" for p in params}
    body = list(func.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # docstring
    if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
        conv.fail(func, f"@fused function '{func.name}' must end with 'return <expression>'")
    for stmt in body[:-1]:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)):
            conv.fail(stmt, "only 'name = expression' lines may precede the return",
                      "the body of a @fused function is one expression, with local names allowed")
    # A name assigned anywhere in the body is local to all of it, in Python.
    for stmt in body[:-1]:
        conv.shadowing.setdefault(stmt.targets[0].id, "local name")
    for stmt in body[:-1]:
        target = stmt.targets[0].id
        if target in params:
            conv.fail(stmt, f"assignment to parameter '{target}' is not supported", "use a new name")
        check_identifier(target, "local name")
        conv.bindings[target] = conv.convert(stmt.value)
    outputs, joined = _outputs(conv, body[-1].value)
    text = _unparse(source, body[-1].value)
    for expr in outputs:
        _check_literals(text, expr)
    tensors = [p for p in params if p not in scalars]
    seen = [p for p in params if p in conv.seen]
    unknown = [n for n in conv.seen if n not in params]
    if unknown:
        raise SpecError(f"@fused function '{func.name}' uses '{unknown[0]}', which is not a parameter")
    ordered, scalars = _order_names(text, seen, tensors, scalars)
    return Parsed(_flatten_text(source, body, text), outputs, ordered, scalars, joined,
                  *_random_of(conv, scalars))


def _unparse(source, node) -> str:
    """`node` as Python text; ast.unparse recurses, so a long flat chain (a 400-term sum,
    within the limits) falls back to the source as written, on one line."""
    try:
        return ast.unparse(node)
    except RecursionError:
        return " ".join((ast.get_source_segment(source, node) or "").split())


def _flatten_text(source, body, text):
    """The function body as one line of text, for headers and spec.json."""
    if len(body) == 1:
        return text
    parts = [f"{s.targets[0].id} = {_unparse(source, s.value)}" for s in body[:-1]]
    return "; ".join(parts + [text])


def reparse(text: object, inputs, scalars) -> Parsed:
    """An expression as spec.json records it, read back through this parser (`fusegen
    package` checks a generated folder with it): one expression, or a @fused function's
    body flattened to `name = expr; ...; expr` (_flatten_text), which is read as the body
    of a function of `inputs` and `scalars`. The names must come back as recorded."""
    if not isinstance(text, str):
        raise ParseError(f"expression must be a string, got {type(text).__name__}", repr(text)[:80])
    if len(text) > MAX_LENGTH:
        raise ParseError(f"expression too long ({len(text)} characters, limit {MAX_LENGTH})", text[:80] + "...")
    inputs, scalars = list(inputs), list(scalars)
    for n in inputs + scalars:
        check_identifier(n, "input" if n in inputs else "scalar")
    if ";" not in text:
        parsed = parse(text, inputs=inputs, scalars=scalars)
    else:
        _check_ascii(text)
        if "\n" in text or "\r" in text:
            raise ParseError("expression must be one line", text.splitlines()[0])
        *lines, result = (part.strip() for part in text.split(";"))
        source = f"def f({', '.join(inputs + scalars)}):\n" + "".join(f"    {line}\n" for line in lines) \
            + f"    return {result}\n"
        parsed = parse_function(source, inputs + scalars, scalars)
    if parsed.inputs != tuple(inputs) or parsed.scalars != tuple(scalars):
        raise SpecError(f"expression {text!r} reads inputs {list(parsed.inputs)} and scalars "
                        f"{list(parsed.scalars)}, not the recorded {inputs} and {scalars}")
    return parsed

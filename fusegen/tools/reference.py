"""The eager PyTorch oracle: the expression as the user wrote it.

`evaluate_text` is the oracle for `--check`: it walks the user's text with Python's `ast`
against the parser's own allowlist (the tables in functions.py) and calls the torch
function the user named (torch.maximum, torch.clamp, torch.where, F.relu, torch.pow, ...)
with Python numbers as literals, so `a*0` at a = inf is NaN and `exp(log(x))` at x < 0 is
NaN, as in eager PyTorch; torch.autograd over it gives PyTorch's own gradients.

It evaluates nothing: no eval, exec, sympify or lambdify, only tables and a tree walk.
"""

from __future__ import annotations

import ast
import operator
from functools import reduce

import torch

from fusegen.frontend.parse import dotted_name, input_argument, tensor_method
from fusegen.ir import primitives as fn
# The eager torch function of each name (primitives.PRIMITIVES).
TORCH_FUNCTIONS = {p.name: fn.eager(p) for p in fn.PRIMITIVES if p.params is not None}

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.Pow: operator.pow}
_COMPARISONS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
                ast.GtE: operator.ge, ast.Eq: operator.eq, ast.NotEq: operator.ne}


class TextError(ValueError):
    """The text is not an expression of fusegen's language (the parser would refuse it)."""


def evaluate_text(text: str, values: dict[str, object]):
    """Evaluate the user's expression with eager PyTorch, as written.

    `text` is an expression (`"a*b + c"`) or, as `OpSpec.text` has it for `@fused`
    functions, local assignments then the expression, separated by `;` on one line
    (`"inner = x + 1; x * tanh(inner)"`). `values` maps input names to tensors and scalar
    names to tensors or Python floats (scalars stay Python numbers, as in the user's
    function). Literals are Python numbers; where a torch function needs a tensor
    (`maximum(x, 0)`, `where(c, 1.0, x)`, `exp(2)*x`) a number becomes a 0-dim tensor of
    the inputs' promoted dtype, which promotes like the number would. Arithmetic between
    numbers alone follows IEEE double (1/0 is inf, not ZeroDivisionError), as fusegen's
    constant folding does. Comparisons are worth 1 or 0 in the operands' dtype, except as
    the condition of `where`."""
    try:
        module = ast.parse(text.strip(), mode="exec")
    except SyntaxError as err:
        raise TextError(f"not an expression: {text!r} ({err.msg})") from None
    body = module.body
    if not body or not isinstance(body[-1], ast.Expr):
        raise TextError(f"expected an expression last in {text!r}")
    walker = _Eager(values)
    try:
        for stmt in body[:-1]:
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0], ast.Name)):
                raise TextError(f"only 'name = expression' may precede the expression in {text!r}")
            walker.locals[stmt.targets[0].id] = walker.value(stmt.value)
        return walker.tensor(walker.value(body[-1].value))
    except RecursionError:
        raise TextError(f"expression nested too deeply: {text[:80]!r}") from None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Eager:
    """One evaluation: values are tensors or Python numbers (literals, scalars, constants)."""

    def __init__(self, values: dict[str, object]):
        tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
        if not tensors:
            raise TextError("evaluate_text needs at least one tensor value")
        self.dtype = reduce(torch.promote_types, (t.dtype for t in tensors))
        self.device = tensors[0].device
        self.values = dict(values)
        self.locals: dict[str, object] = {}

    # -- numbers and tensors ----------------------------------------------------------------
    def tensor(self, v, dtype=None):
        """A number as a 0-dim tensor of the computation dtype; a tensor unchanged."""
        if isinstance(v, torch.Tensor):
            return v
        return torch.tensor(float(v), dtype=dtype or self.dtype, device=self.device)

    @staticmethod
    def fold(f, *args):
        """f over Python numbers, in IEEE double (as fusegen folds constants), as a float."""
        return float(f(*[torch.tensor(float(a), dtype=torch.float64) for a in args]))

    # -- the allowlist, node by node (the same nodes parse.py accepts) ----------------------
    def value(self, node: ast.AST):
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            raise TextError(f"unsupported syntax: {type(node).__name__}")
        return method(node)

    def _Constant(self, node):
        if not _is_number(node.value):
            raise TextError(f"unsupported constant {node.value!r}")
        return node.value

    def _Name(self, node):
        for table in (self.locals, self.values):
            if node.id in table:
                return table[node.id]
        raise TextError(f"no value for '{node.id}'")

    def _Attribute(self, node):
        dotted = dotted_name(node)
        if dotted not in fn.CONSTANTS:
            raise TextError(f"unknown name '{dotted}'")
        return float(fn.CONSTANTS[dotted])

    def _UnaryOp(self, node):
        operand = self.value(node.operand)
        if isinstance(node.op, ast.USub):
            return -operand
        if isinstance(node.op, ast.UAdd):
            return operand
        raise TextError(f"unsupported unary operator {type(node.op).__name__}")

    def _BinOp(self, node):
        f = _OPERATORS.get(type(node.op))
        if f is None:
            raise TextError(f"unsupported operator {type(node.op).__name__}")
        left, right = self.value(node.left), self.value(node.right)
        if _is_number(left) and _is_number(right):
            return self.fold(f, left, right)
        return f(left, right)  # the tensor's own operator: what eager runs for `a * 0`

    def relation(self, node):
        """A comparison as torch computes it: a bool tensor (or a Python bool for numbers)."""
        if len(node.ops) != 1:
            raise TextError("chained comparisons are not supported")
        f = _COMPARISONS.get(type(node.ops[0]))
        if f is None:
            raise TextError(f"unsupported comparison {type(node.ops[0]).__name__}")
        left, right = self.value(node.left), self.value(node.comparators[0])
        return f(left, right), left, right

    def _Compare(self, node):
        result, left, right = self.relation(node)
        if not isinstance(result, torch.Tensor):
            return float(result)
        dtype = torch.result_type(left, right)
        return result.to(dtype if dtype.is_floating_point else self.dtype)

    def _Call(self, node):
        func = node.func
        method = tensor_method(node)
        if method in fn.REDUCTION_NAMES:
            return self.reduce(method, func.value)  # e.sum(-1, keepdim=True)
        if method == "detach":
            return self.tensor(self.value(func.value)).detach()  # e.detach()
        if method == fn.GATHER:
            return self.gather(func.value, node.args, node.keywords)  # e.gather(-1, index)
        dotted = dotted_name(func)
        name = fn.resolve(dotted) if dotted else None
        if name is None:
            raise TextError(f"unknown function '{dotted}'")
        if name in fn.REDUCTION_NAMES:
            first = input_argument(node)
            if first is None:
                raise TextError(f"{name}() is missing argument 'input'")
            return self.reduce(name, first)
        if name == fn.GATHER:
            return self.gather(input_argument(node), node.args[1:],
                               [k for k in node.keywords if k.arg != "input"])
        args = self.bind(node, name)
        if name == "where":
            return self.where(*args)
        present = [a for a in args if a is not None]
        if all(_is_number(a) for a in present):
            return float(self.call(name, [None if a is None else self.tensor(a, torch.float64) for a in args]))
        return self.call(name, args)

    def reduce(self, name: str, operand: ast.AST):
        """torch.<name>(operand, -1, keepdim=True): the only reduction the parser accepts
        (it refuses any other dim or keepdim), as torch computes it."""
        return getattr(torch, name)(self.tensor(self.value(operand)), -1, keepdim=True)

    def gather(self, operand: ast.AST, rest, keywords):
        """torch.gather(operand, -1, index), as the parser accepts it (dim -1)."""
        slots = dict(zip(("dim", "index"), rest)) | {k.arg: k.value for k in keywords}
        index = self.value(slots["index"])
        return torch.gather(self.tensor(self.value(operand)), -1, index.long())

    def bind(self, node, name):
        """Arguments in the order of torch's parameter names (functions.FUNCTIONS), evaluated."""
        spec = fn.FUNCTIONS[name]
        if len(node.args) > len(spec.params):
            raise TextError(f"{name}() takes at most {len(spec.params)} arguments")
        slots = dict(zip(spec.params, node.args))
        for kw in node.keywords:
            if kw.arg not in spec.params or kw.arg in slots:
                raise TextError(f"{name}(): bad keyword argument {kw.arg!r}")
            slots[kw.arg] = kw.value
        missing = [p for p in spec.params[: len(spec.params) - spec.optional] if p not in slots]
        if missing:
            raise TextError(f"{name}() is missing argument '{missing[0]}'")
        if name == "where" and isinstance(slots["condition"], ast.Compare):
            condition = self.relation(slots["condition"])[0]  # the comparison itself, a bool
            return [condition] + [self.value(slots[p]) for p in spec.params[1:]]
        return [None if slots.get(p) is None else self.value(slots[p]) for p in spec.params]

    def call(self, name, args):
        f = TORCH_FUNCTIONS[name]
        if name in ("maximum", "minimum"):
            return f(*[self.tensor(a) for a in args])
        if name == "clamp":
            x, lo, hi = args
            if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
                # Tensor bounds: all three tensors (torch.clamp takes no mix of number and
                # tensor bounds), broadcast first (eager clamp's backward fails when x is
                # smaller than its bounds; values and gradients are the same).
                present = torch.broadcast_tensors(*[self.tensor(a) for a in args if a is not None])
                it = iter(present)
                x, lo, hi = [None if a is None else next(it) for a in args]
            return f(self.tensor(x), lo, hi)
        if name == "pow":
            return f(*args)
        (x,) = args
        return f(self.tensor(x))

    def where(self, condition, a, b):
        """torch.where(condition, a, b); a condition that is not a comparison tests != 0."""
        if isinstance(condition, torch.Tensor) and condition.dtype != torch.bool:
            condition = condition != 0
        elif not isinstance(condition, torch.Tensor):
            condition = torch.tensor(bool(condition != 0), device=self.device)
        return torch.where(condition, self.tensor(a), self.tensor(b))

"""The StepSpec: a program of in-place updates (frontend/statements.py), as the renderer needs it.

A step op has no result and no derivative: it writes each updated input's new value over
the input, reading every input's original value once, in one kernel. Its operands are the
updated inputs (outputs of the kernel), then the inputs whose values are read (which may
be the same tensors: an update reads its own input before it writes it, element by
element). One common-subexpression pass runs over all the new values, so `m`'s new value,
read by `p`'s, is computed once.

Aliasing. Eager runs the statements in order, so when two arguments are the same tensor a
later statement reads what an earlier one wrote. The kernel reads every original value
first; it agrees with eager exactly when the other argument is never updated and is not
read after the updated one's first assignment. `alias_ok` records, per updated input,
which other inputs may be the very same tensor; any other overlap is refused at run time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import sympy

from fusegen.errors import SpecError
from fusegen.ir import dag
from fusegen.ir import primitives as fn
from fusegen.ir import limits
from fusegen.ir import names
from fusegen.ir.names import check_op_name
from fusegen.ir.expr import ParsedProgram
from fusegen.ir.notation import text
from fusegen.ir.spec import Program, _check_printable, _program
from fusegen.version import FUSEGEN_VERSION

FOREACH_SUFFIX = "_foreach"
MAX_OPERANDS = 24    # updated plus read tensors: the kernel's parameter block (fusegen-runtime.h)
MAX_SCALARS = 16     # kStepMaxScalars


@dataclass(frozen=True)
class StepSpec:
    name: str
    text: str
    inputs: tuple[str, ...]          # tensor arguments, schema order
    scalars: tuple[str, ...]
    updated: tuple[str, ...]         # the inputs written, in input order: the kernel's outputs
    reads: tuple[str, ...]           # the inputs read, in input order: the kernel's inputs
    updates: tuple[tuple[str, sympy.Expr], ...]
    program: Program                 # results named by the updated inputs
    derived: tuple[tuple[sympy.Symbol, sympy.Expr], ...]  # scalar-only subexpressions, in the scalars
    alias_ok: tuple[tuple[str, ...], ...]  # per updated input: the inputs that may be the same tensor
    command: str

    @property
    def foreach_name(self) -> str:
        return self.name + FOREACH_SUFFIX

    def schema(self) -> str:
        """`<name>(Tensor(a!) p, Tensor g, ..., float lr, ...) -> ()`: each updated input has an
        alias set of its own, so torch.compile and torch.export see which arguments change."""
        return f"{self.name}({', '.join(self._tensor_args('Tensor') + [f'float {s}' for s in self.scalars])}) -> ()"

    def foreach_schema(self) -> str:
        """`<name>_foreach(Tensor(a!)[] p, ..., float[] scalars, Tensor?[] scalar_tensors) -> ()`:
        a scalar comes as a number, or (where its entry of scalar_tensors is not None) as a
        0-d tensor read by the kernel itself."""
        values, tensors = self.scalar_arg_names()
        args = self._tensor_args("Tensor", "[]") + [f"float[] {values}", f"Tensor?[] {tensors}"]
        return f"{self.foreach_name}({', '.join(args)}) -> ()"

    def scalar_arg_names(self) -> tuple[str, str]:
        taken = set(self.inputs)
        values = names.fresh("scalars", taken)
        return values, names.fresh("scalar_tensors", taken | {values})

    def _tensor_args(self, kind: str, suffix: str = "") -> list[str]:
        args = []
        for i in self.inputs:
            if i in self.updated:
                alias = _alias_set(self.updated.index(i))
                args.append(f"{kind}({alias}!){suffix} {i}")
            else:
                args.append(f"{kind}{suffix} {i}")
        return args

    def summary(self) -> list[str]:
        return [f"{i} <- {text(e)}" for i, e in self.updates]

    def to_json(self, content_hash: str) -> str:
        doc = {
            "name": self.name,
            "kind": "step",
            "expression": self.text,
            "inputs": list(self.inputs),
            "scalars": list(self.scalars),
            "updated": list(self.updated),
            "reads": list(self.reads),
            "updates": {i: text(e) for i, e in self.updates},
            "schema": self.schema(),
            "foreach_schema": self.foreach_schema(),
            "may_alias": {u: list(a) for u, a in zip(self.updated, self.alias_ok)},
            "fusegen_version": FUSEGEN_VERSION,
            "content_hash": content_hash,
        }
        return json.dumps(doc, indent=2) + "\n"


def _alias_set(k: int) -> str:
    """a, b, ..., z, a1, b1, ...: one schema alias set per updated input."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return letters[k % 26] + (str(k // 26) if k >= 26 else "")


def step_spec(parsed: ParsedProgram, name: str | None = None, command: str | None = None) -> StepSpec:
    name = check_op_name(name) if name is not None else default_name(parsed)
    if name.endswith(FOREACH_SUFFIX):
        raise SpecError(f"name must not end in '{FOREACH_SUFFIX}' (fusegen registers <name>{FOREACH_SUFFIX} "
                        f"itself), got {name!r}")
    updated = tuple(i for i, _ in parsed.updates)
    if len(updated) + len(parsed.reads) > MAX_OPERANDS:
        raise SpecError(f"step op '{name}' has {len(updated)} updated and {len(parsed.reads)} read tensors; "
                        f"expected at most {MAX_OPERANDS} in all")
    if len(parsed.scalars) > MAX_SCALARS:
        raise SpecError(f"step op '{name}' has {len(parsed.scalars)} scalars; expected at most {MAX_SCALARS}")
    with limits.scope(name) as budget:
        exprs = [e for _, e in parsed.updates]
        _check_printable(name, [(f"the new value of '{i}'", e) for i, e in parsed.updates], set())
        budget.add_nodes(dag.count(exprs), f"the updates of '{name}'")
        derived, exprs = _derive_scalars(exprs, parsed.scalars)
        temps, reduced = dag.cse(exprs, sympy.numbered_symbols("__cse"))
        reads = {s: dag.free_symbols([e]) for s, e in temps}
        program = _program(temps, list(zip(updated, reduced)), reads)
    alias_ok = []
    for u in updated:
        ok = tuple(j for j in parsed.inputs if j != u and j not in updated
                   and parsed.last_read.get(j, -1) <= parsed.first_write[u])
        alias_ok.append(ok)
    return StepSpec(name, parsed.text, parsed.inputs, parsed.scalars, updated, parsed.reads, parsed.updates,
                    program, derived, tuple(alias_ok), command or default_command(parsed, name))


DERIVED_PREFIX = "d"  # d0, d1, ...: never a user's C name (in_<name>) nor a temporary (t<k>)


def _derive_scalars(exprs, scalars):
    """Each largest subexpression of scalars and numbers alone (`1 - beta2`, `1 - lr*wd`)
    becomes a derived scalar, computed once per call in double, as eager computes Python
    numbers, and then rounded to the compute type: (1 - 0.999) in float32 arithmetic is
    0.00099998713, where eager's `(1 - beta2) * g` multiplies by float32(0.001)."""
    scalar_symbols = {sympy.Symbol(s, real=True) for s in scalars}
    order = dag.postorder(exprs)
    only = {}
    for node in order:
        if isinstance(node, sympy.Symbol):
            only[node] = node in scalar_symbols
        elif not node.args:
            only[node] = True   # a number
        else:
            only[node] = all(only[a] for a in node.args)
    parents = {}
    for node in order:
        for a in node.args:
            parents.setdefault(a, []).append(node)
    roots = set(exprs)
    found = []
    for node in order:
        if not only[node] or not node.args or fn.is_condition(node):
            continue
        if node in roots or any(not only[p] for p in parents.get(node, ())):
            found.append(node)
    mapping = {e: sympy.Symbol(f"{DERIVED_PREFIX}{k}", real=True) for k, e in enumerate(dict.fromkeys(found))}
    if not mapping:
        return (), list(exprs)
    return tuple((s, e) for e, s in mapping.items()), dag.substitute(exprs, mapping)


def default_name(parsed: ParsedProgram) -> str:
    key = json.dumps([parsed.text, parsed.inputs, parsed.scalars])
    return "step_" + hashlib.sha256(key.encode()).hexdigest()[:8]


def default_command(parsed: ParsedProgram, name: str) -> str:
    parts = ["fusegen", json.dumps(parsed.text), "--name", name, "--inputs", ",".join(parsed.inputs)]
    for s in parsed.scalars:
        parts += ["--scalar", s]
    return " ".join(parts)

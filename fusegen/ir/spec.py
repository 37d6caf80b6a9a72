"""The OpSpec: the one IR object that flows from the parser to the renderer.

`differentiate` turns a parsed expression into an OpSpec by a reverse pass that mirrors
autograd: it walks the tree (functions.py's nodes, one per eager operation) from the
output, carries the incoming gradient as an expression in the symbol GRAD, applies each
node's own PyTorch backward formula (tools/autograd/derivatives.yaml and
FunctionsManual.cpp: `exp` uses its result, `maximum` splits ties with where(), `clamp`
selects, never multiplies by a 0/1 mask) and sums what reaches each input. Then one
common-subexpression pass (sympy's cse, as dag.cse computes it without recursion) over the
forward and every gradient, so the backward reuses what the forward computes.

The tree is a graph: a subexpression used twice is one node, visited once by every walk
here (dag.py), so sharing is never expanded into paths; what the derivation builds counts
against the op's budget (limits.py).

One deliberate difference from eager (README, "Semantics in brief"): the gradient that
`where(c, a, b)` sends into `a` is selected *after* it has flowed through `a`'s subtree
(`where(c, d a, 0)`), not before (`d a` of `where(c, grad, 0)`), so a branch that is not
chosen never turns the gradient into NaN (0 * inf), and contributes +0.
"""

from __future__ import annotations

import hashlib
import dataclasses
import json
import math
import textwrap
from dataclasses import dataclass

import sympy

from fusegen.ir import dag
from fusegen.ir import limits
from fusegen.ir import primitives as fn
from fusegen.ir import names
from fusegen.ir import rows
from fusegen.ir.rows import RowProgram
from fusegen.errors import SpecError
from fusegen.ir.expr import Parsed, symbol
from fusegen.ir.names import check_op_name
from fusegen.ir.notation import text
from fusegen.version import FUSEGEN_VERSION

GRAD = fn.GRAD  # the incoming gradient, d loss / d out (functions.py defines it)


@dataclass(frozen=True)
class Gradient:
    """d(loss)/d(input) for one tensor input, as an expression in GRAD and the inputs."""

    input: str
    expr: sympy.Expr          # the whole gradient: contains GRAD
    passthrough: bool         # exactly GRAD: it flows through, no kernel work
    output: int | None = None           # the backward kernel's output that holds it (shared
                                        # by identical gradients), None: no kernel output
    dout_steps: tuple | None = None     # a function of GRAD alone: eager's ops on dout,
                                        # (("-", 0.0) | ("*", c) | ("/", c), ...); () is GRAD


@dataclass(frozen=True)
class Plan:
    """What the backward reads, chosen by the bytes forward + backward move (`_plan`)."""

    saved_output: str | None        # the name the forward's output has in the backward, or None
    reads: tuple[str, ...]          # tensors the backward reads besides dout (output first)
    bytes: dict                     # dtype size -> forward + backward bytes per element
    alternative: dict | None        # the plan not taken: {"reads": [...], "bytes": {...}}
    why: str
    saved_index: int = 0            # which output it reads (an op of several outputs)


@dataclass(frozen=True)
class Program:
    """Straight-line code: temporaries (name, expr) then named results.

    Temporaries are renumbered t0, t1, ... per program so each kernel reads on its own."""

    temps: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    results: tuple[tuple[str, sympy.Expr], ...]


@dataclass(frozen=True)
class OpSpec:
    name: str
    text: str                              # the expression as the user wrote it
    inputs: tuple[str, ...]                # tensor inputs, in schema order
    scalars: tuple[str, ...]               # runtime float arguments, after the tensors
    outputs: tuple[sympy.Expr, ...]        # the forward: one tree per output
    gradients: tuple[Gradient, ...]        # one per tensor input, schema order
    forward_program: Program
    backward_program: Program              # computes every non-passthrough gradient
    backward_inputs: tuple[str, ...]       # tensors the backward reads: the saved output
                                           # (plan.saved_output) first, then inputs
    backward_scalars: tuple[str, ...]      # scalars the backward reads
    command: str                           # the CLI line that regenerates the files
    backward_exprs: tuple[sympy.Expr, ...] = ()   # per kernel output, in the backward's tensors
    plan: Plan | None = None
    joined: bool = False                   # the two outputs are the halves of one tensor along
                                           # its last dimension (a final torch.cat): one result
    forward_rows: RowProgram | None = None   # a row op (it reduces over the last dimension):
    backward_rows: RowProgram | None = None  # its kernels' passes over each row (ir/rows.py)
    random: tuple[str, ...] = ()           # its random streams (rand0, ...): drawn per call, the
                                           # backward regenerates them (fusegen-random.h)
    probabilities: tuple[str, ...] = ()    # the scalars that are a dropout's p
    coarse: tuple[str, ...] = ()           # the streams drawn in 16 bits (dropouts', compared
                                           # with 1 - p only)
    index_inputs: tuple[str, ...] = ()     # inputs a gather's index reads: integers, no gradient
    saved_rows: tuple[sympy.Expr, ...] = ()  # a row op's reductions whose row values the forward
                                             # writes for its backward (saved0, ...: the last
                                             # results of forward_rows), in the compute type
    saved_backward_rows: RowProgram | None = None  # the backward reading them (rows.saved_rows)

    @property
    def is_rows(self) -> bool:
        return self.forward_rows is not None

    @property
    def forward(self) -> sympy.Expr:
        """The forward of an op of one output."""
        (tree,) = self.outputs
        return tree

    @property
    def douts(self) -> tuple[sympy.Symbol, ...]:
        """The incoming gradients, one per output (GRAD for one output), in the gradients."""
        return fn.douts(len(self.outputs))

    @property
    def kernel_gradients(self) -> tuple[Gradient, ...]:
        """One gradient per output of the backward kernel (the first input that has it), in
        output order; identical gradients share an output, the others pass grad through or
        are eager ops on dout alone."""
        owners = {}
        for g in self.gradients:
            if g.output is not None:
                owners.setdefault(g.output, g)
        return tuple(owners[k] for k in sorted(owners))

    @property
    def saved_output(self) -> str | None:
        return self.plan.saved_output if self.plan else None

    @property
    def saved_index(self) -> int | None:
        """Which output the backward reads (saved_output), or None."""
        return self.plan.saved_index if self.plan and self.plan.saved_output else None

    def to_json(self, content_hash: str, auxiliary=()) -> str:
        doc = {
            "name": self.name,
            "expression": self.text,
            "inputs": list(self.inputs),
            "scalars": list(self.scalars),
            "forward": _forward_doc(self),
            **({"joined": "torch.cat(forward, -1)"} if self.joined else {}),
            **({"random": list(self.random)} if self.random else {}),
            **({"coarse": list(self.coarse)} if self.coarse else {}),
            "gradients": {g.input: text(g.expr) for g in self.gradients},
            "passthrough": [g.input for g in self.gradients if g.passthrough],
            "from_dout": {g.input: text(g.expr) for g in self.gradients
                          if g.dout_steps and g.output is None},
            "kernel_outputs": {names.grad(g.input): [h.input for h in self.gradients if h.output == g.output]
                               for g in self.kernel_gradients},
            "backward_reads": list(self.backward_inputs) + list(self.backward_scalars),
            "saved": self._saved_doc(),
            **({"saved_row_values": [text(n) for n in self.saved_rows]} if self.saved_rows else {}),
            "auxiliary_ops": {a.name: {"inputs": list(a.inputs) + list(a.scalars), "forward": _forward_doc(a)}
                              for a in auxiliary},
            "fusegen_version": FUSEGEN_VERSION,
            "content_hash": content_hash,
        }
        return json.dumps(doc, indent=2, sort_keys=False) + "\n"

    def _saved_doc(self) -> dict:
        p = self.plan
        if p is None:
            return {"tensors": list(self.backward_inputs), "why": "no backward kernel"}
        doc = {"tensors": list(p.reads), "output": p.saved_output,
               **({"output_index": p.saved_index} if p.saved_output and len(self.outputs) > 1 else {}),
               "bytes_per_element": {_DTYPE_OF_SIZE[k]: v for k, v in p.bytes.items()}}
        if p.alternative is not None:
            doc["instead_of"] = {"tensors": p.alternative["reads"],
                                 "bytes_per_element": {_DTYPE_OF_SIZE[k]: v for k, v in p.alternative["bytes"].items()}}
        doc["why"] = p.why
        return doc

    def summary(self) -> list[str]:
        """One line per gradient, for the CLI and the file headers."""
        lines = []
        first = {}
        for g in self.gradients:
            if g.input in self.index_inputs:
                lines.append(f"d/d{g.input}: none (a gather's index: integers)")
                continue
            note = ""
            if g.output is not None and first.setdefault(g.output, g.input) != g.input:
                note = f"  (= d/d{first[g.output]}: computed and written once)"
            elif g.dout_steps and g.output is None:
                note = "  (eager ops on grad: no kernel)"
            lines.append(f"d/d{g.input} = {text(g.expr)}{note}")
        return lines

    def saved_lines(self) -> list[str]:
        """What the backward reads and why, for the file headers."""
        p = self.plan
        if p is None:
            return []
        reads = ", ".join([text(d) for d in self.douts] + list(p.reads))
        fp32 = p.bytes[4]
        why = textwrap.wrap(f"({p.why})", 86)
        return [f"backward reads: {reads}; forward+backward move {fp32} bytes per element in float32"] + \
            [f"  {line}" for line in why]


def _forward_doc(spec: OpSpec):
    """spec.json's `forward`: the one output's text, or a list of the outputs' texts."""
    texts = [text(o) for o in spec.outputs]
    return texts[0] if len(texts) == 1 else texts


def differentiate(parsed: Parsed, name: str | None = None, command: str | None = None,
                  auxiliary: bool = False) -> OpSpec:
    """Derive every tensor input's gradient and share subexpressions across all of them.
    `auxiliary`: an op fusegen derives itself (`<name>_grad2`, `<name>_jvp`), whose name
    ends in a suffix a user's op may not have."""
    if auxiliary:
        pass
    elif name is not None:
        name = check_op_name(name)
    else:
        name = default_name(parsed)
    with limits.scope(name) as budget:
        return _differentiate(parsed, name, command, auxiliary, budget)


def _differentiate(parsed: Parsed, name: str, command: str | None, auxiliary: bool,
                   budget: limits.Budget) -> OpSpec:
    outputs = parsed.outputs
    single = len(outputs) == 1
    checked = set()
    _check_printable(name, [("the expression", o) for o in outputs], checked)
    wanted = [symbol(i) for i in parsed.inputs]
    derived = backward(outputs, wanted)
    exprs = [derived[sym] for sym in wanted]
    _check_printable(name, [(f"the gradient for '{inp}'", e) for inp, e in zip(parsed.inputs, exprs)], checked)
    budget.add_nodes(dag.count(list(outputs) + exprs), f"the forward and gradients of '{name}'")

    # What the backward reads (`_plan`): the inputs, or one of the forward's outputs when
    # that lets it read fewer tensors (`h = x + r` of a residual add and norm: h, not x and
    # r). The auxiliary ops keep their inputs: the double backward calls
    # <name>_grad2_backward without running <name>_grad2, so there is no output; so does a
    # joined op, whose outputs are halves of one tensor.
    taken = set(parsed.inputs) | set(parsed.scalars)
    out_name = names.fresh(names.SAVED_OUTPUT, taken)
    unsaved = ("an auxiliary op: the double backward runs it without its forward" if auxiliary else
               "a joined op: its outputs are the halves of one tensor" if parsed.joined else None)
    plan, kernel_exprs = _plan(outputs, exprs, parsed.inputs, out_name, unsaved)

    # Identical gradients (the same tree, after the plan's rewriting) are one kernel output;
    # a gradient of GRAD alone (`a - b`: -grad) needs the kernel only when another one does.
    # With several outputs, every gradient comes from the kernel (it reads every dout).
    dout_only = [_dout_steps(e) if single and (not auxiliary or e == GRAD) else None for e in exprs]
    needs_kernel = any(e != GRAD and steps is None for e, steps in zip(exprs, dout_only))
    kernel_outputs: dict[sympy.Expr, int] = {}
    gradients = []
    index_symbols = fn.index_symbols(outputs)
    index_inputs = tuple(x for x in parsed.inputs if symbol(x) in index_symbols)
    for inp, e, ke, steps in zip(parsed.inputs, exprs, kernel_exprs, dout_only):
        if inp in index_inputs:  # integers: autograd never asks for their gradient
            gradients.append(Gradient(inp, sympy.Integer(0), False))
            continue
        output = None
        if e != GRAD and needs_kernel:
            output = kernel_outputs.setdefault(ke, len(kernel_outputs))
        gradients.append(Gradient(inp, e, e == GRAD, output, steps))
    backward_exprs = tuple(kernel_outputs)  # insertion order is output order
    if not backward_exprs:
        plan = None

    # One cse over forward + backward: shared subterms (sigmoid(x) in silu) are found once,
    # then each program keeps only the temporaries its own results reach.
    temps, reduced = dag.cse(list(outputs) + list(backward_exprs), sympy.numbered_symbols("__cse"))
    temp_reads = {s: dag.free_symbols([e]) for s, e in temps}  # once, for both programs
    count = len(outputs)
    forward_program = _program(temps, [(names.output(k, count), e) for k, e in enumerate(reduced[:count])],
                               temp_reads)
    owners = [next(g for g in gradients if g.output == k) for k in range(len(backward_exprs))]
    backward_program = _program(temps, [(names.grad(g.input), e) for g, e in zip(owners, reduced[count:])],
                                temp_reads)

    used = {s.name for s in dag.free_symbols(backward_exprs) if not fn.is_dout(s)}
    reads = tuple(_reads_of(backward_exprs, parsed.inputs, plan.saved_output if plan else None))
    if plan is not None:
        plan = dataclasses.replace(plan, reads=reads)
    if command is None:
        command = default_command(parsed, name)
    forward_rows = backward_rows = None
    if parsed.random and rows.has_reduction(outputs):
        raise SpecError(f"op '{name}': random numbers (rand_like, dropout) in an op that reduces over "
                        "the last dimension are not supported; apply the dropout in an op of its own")
    saved_rows, saved_backward_rows = (), None
    if rows.has_reduction(outputs):
        forward_results = [(names.output(k, count), e) for k, e in enumerate(outputs)]
        if backward_exprs:
            backward_results = [(names.grad(g.input), e) for g, e in zip(owners, backward_exprs)]
            backward_rows = rows.schedule(backward_results, parsed.scalars, name)
            # The row values the backward would compute again, saved by the forward where
            # that saves a pass; not for an auxiliary op, whose backward runs without it.
            if not auxiliary:
                saved_rows, saved_backward_rows = rows.saved_rows(outputs, backward_results, backward_rows,
                                                                  parsed.scalars, name)
        forward_rows = rows.schedule(forward_results + [(rows.saved_row_symbol(k).name, n)
                                                        for k, n in enumerate(saved_rows)],
                                     parsed.scalars, name)
    return OpSpec(
        name=name,
        text=parsed.text,
        inputs=parsed.inputs,
        scalars=parsed.scalars,
        outputs=outputs,
        gradients=tuple(gradients),
        forward_program=forward_program,
        backward_program=backward_program,
        backward_inputs=reads,
        backward_scalars=tuple(s for s in parsed.scalars if s in used),
        command=command,
        backward_exprs=backward_exprs,
        plan=plan,
        joined=parsed.joined,
        forward_rows=forward_rows,
        backward_rows=backward_rows,
        random=tuple(names.random(k) for k in range(parsed.random)),
        probabilities=parsed.probabilities,
        coarse=tuple(names.random(k) for k in parsed.coarse),
        index_inputs=index_inputs,
        saved_rows=saved_rows,
        saved_backward_rows=saved_backward_rows,
    )


# -- what the backward reads ----------------------------------------------------------------
#
# Per element, with dtype size s: the forward reads its inputs and writes its output; the
# backward reads dout and what it needs, and writes its kernel outputs. Reading the
# forward's output instead of inputs costs nothing in the forward (it is written anyway),
# so it wins exactly when it lets the backward read fewer tensors. A gradient is rewritten
# in terms of the output by literal substitution of the forward's tree (eager's formulas
# for exp, sigmoid, tanh, relu, sqrt, ... use `result`) and by _KINKS, conditions on a
# function's argument that are the same condition on its value, for every input, NaN and
# signed zero included.
_SIZES = (4, 2)                     # float32, then float16/bfloat16: the training dtypes
_DTYPE_OF_SIZE = {8: "float64", 4: "float32", 2: "bfloat16/float16"}

# forward node -> {condition on its argument: the same condition on its result}.
# relu(a) = clamp_min(a, 0): a > 0 <=> relu(a) > 0 and a <= 0 <=> relu(a) <= 0 (a = NaN:
# both false; a = -0.0: relu gives -0.0, both <= 0). Not a >= 0: relu(-1) = 0 >= 0.
_KINKS = {
    fn.Relu: lambda a, r: {fn.Greater(a, _ZERO): fn.Greater(r, _ZERO),
                           fn.LessEqual(a, _ZERO): fn.LessEqual(r, _ZERO),
                           fn.Less(_ZERO, a): fn.Less(_ZERO, r),
                           fn.GreaterEqual(_ZERO, a): fn.GreaterEqual(_ZERO, r)},
}


def _in_terms_of_output(forward, exprs, out):
    rules = {forward: out}
    kink = _KINKS.get(type(forward))
    if kink is not None:
        rules.update(kink(forward.args[0], out))
    return dag.substitute(exprs, rules)


def _bytes(num_inputs: int, num_outputs: int, reads: int, grads: int) -> dict:
    """Forward (inputs + outputs) plus backward (douts + what it reads + its outputs) bytes
    per element, per dtype size."""
    return {s: s * ((num_inputs + num_outputs) + (num_outputs + reads + grads)) for s in _SIZES}


def _reads_of(exprs, inputs, out=None) -> list[str]:
    used = dag.free_symbols(exprs)
    names_used = {s.name for s in used if not fn.is_dout(s)}
    return ([out] if out is not None and out in names_used else []) + [i for i in inputs if i in names_used]


def _plan(outputs, exprs, inputs, out_name, unsaved=None):
    """(Plan, the gradients as the backward computes them). `out_name`: the name an output
    would have in the backward; `unsaved`: why it may read none, or None. Of several
    outputs, the first that lets the backward read fewest tensors."""
    n = len(outputs)
    kernel = [e for e in exprs if e != GRAD]
    if n == 1 and all(_dout_steps(e) is not None for e in kernel):
        kernel = []  # eager ops on dout alone: no kernel
    distinct = len(set(kernel))
    by_inputs = _reads_of(kernel, inputs)
    cost_inputs = _bytes(len(inputs), n, len(by_inputs), distinct)
    if unsaved is not None or not kernel:
        why = "no backward kernel" if not kernel else f"the inputs ({unsaved})"
        return Plan(None, tuple(by_inputs), cost_inputs, None, why), list(exprs)
    in_kernel = set(kernel)  # a set: `in` a list compares deep trees pairwise
    best = None
    for k, forward in enumerate(outputs):
        rewritten = _in_terms_of_output(forward, exprs, symbol(out_name))
        by_output = _reads_of([r for e, r in zip(exprs, rewritten) if e in in_kernel], inputs, out_name)
        if best is None or len(by_output) < len(best[2]):
            best = (k, rewritten, by_output)
    k, rewritten, by_output = best
    cost_output = _bytes(len(inputs), n, len(by_output),
                         len({r for e, r in zip(exprs, rewritten) if e in in_kernel}))
    output = "the output" if n == 1 else f"output {k}"
    if len(by_output) < len(by_inputs):
        why = (f"the gradients need only {', '.join(by_output)} once rewritten in terms of {output}, "
               f"{cost_inputs[4] - cost_output[4]} bytes per element less than reading {', '.join(by_inputs)} "
               f"(float32); saved with save_for_backward, so modifying {output} in place before backward "
               "raises, as for eager's relu")
        return (Plan(out_name, tuple(by_output), cost_output, {"reads": by_inputs, "bytes": cost_inputs}, why, k),
                rewritten)
    why = ("no tensor: the gradients read none of the inputs, nor the output" if not by_inputs else
           f"the inputs: in terms of {output} the gradients would read {', '.join(by_output)}, no fewer "
           f"tensors, and {output} would have to stay unmodified until backward")
    return Plan(None, tuple(by_inputs), cost_inputs, {"reads": by_output, "bytes": cost_output}, why), list(exprs)


def _dout_steps(expr):
    """`expr` as eager ops applied to GRAD alone, innermost first (neg, mul or div by a
    number), or None when it reads anything else."""
    steps = []
    while expr != GRAD:
        t, args = type(expr), expr.args
        if t is fn.Negative:
            steps.append(("-", 0.0))
            expr = args[0]
        elif t is fn.Times and fn.is_number(args[1]):
            steps.append(("*", float(args[1])))
            expr = args[0]
        elif t is fn.Times and fn.is_number(args[0]):
            steps.append(("*", float(args[0])))
            expr = args[1]
        elif t is fn.Divide and fn.is_number(args[1]):
            steps.append(("/", float(args[1])))
            expr = args[0]
        else:
            return None
    return tuple(reversed(steps))


# -- the auxiliary ops: higher order from the same pipeline ----------------------------------
#
# <name>_backward computes grad_k = dout * f_k(x) for each kernel gradient k. Given the
# gradients gg_k arriving at grad_k, the double backward needs d/d(dout) = sum_k gg_k f_k and
# d/dx_j = dout sum_k gg_k df_k/dx_j: the gradients of the scalar function
# h(dout, x, gg) = sum_k gg_k * grad_k(dout, x), an ordinary elementwise expression. So the
# op <name>_grad2 with forward h has, as its own <name>_grad2_backward called with incoming
# gradient 1, exactly the double backward, fused, with PyTorch's formula at each node (the
# reverse pass runs over the backward's tree, whose nodes are the same eager operations).
# Forward mode: every gradient is linear in GRAD, and eager's forward derivative of an
# elementwise op is its backward formula with grad replaced by the tangent, so
# jvp = sum_i grad_i[GRAD := t_i] is <name>_jvp's forward.

def grad2_spec(spec: OpSpec) -> OpSpec | None:
    """<name>_grad2: h(dout, <inputs the backward reads>, gg_<x>...) = sum_k gg_<x_k> * grad_<x_k>,
    with the backward's scalars. None when every gradient passes dout through."""
    kernel = spec.kernel_gradients
    if not kernel:
        return None
    taken = set(spec.inputs) | set(spec.scalars) | set(spec.backward_inputs)
    douts = []  # its inputs in place of the incoming gradients, named as they are
    for d in spec.douts:
        douts.append(names.fresh(d.name, taken))
        taken.add(douts[-1])
    gg = []
    for g in kernel:
        gg.append(names.fresh(names.GRAD2_GG.format(g.input), taken))
        taken.add(gg[-1])
    tree = None
    rename = {d: symbol(n) for d, n in zip(spec.douts, douts)}
    for e, gname in zip(dag.substitute(spec.backward_exprs, rename), gg):
        term = fn.mul(symbol(gname), e)
        tree = term if tree is None else fn.add(tree, term)
    _check_size(tree, f"the double backward of '{spec.name}'")
    inputs = tuple(douts) + spec.backward_inputs + tuple(gg)
    # An op that draws keeps its streams (the same symbols): the double backward passes
    # <name>_grad2_backward the forward's saved state, so it draws the forward's numbers.
    parsed = Parsed(text(tree), (tree,), inputs, spec.backward_scalars, random=len(spec.random),
                    probabilities=tuple(p for p in spec.probabilities if p in spec.backward_scalars),
                    coarse=tuple(spec.random.index(s) for s in spec.coarse))
    return differentiate(parsed, name=spec.name + names.GRAD2_SUFFIX, command=spec.command, auxiliary=True)


def jvp_spec(spec: OpSpec) -> OpSpec | None:
    """<name>_jvp(<inputs it reads>, t_<x> for every input with a gradient, <scalars it
    reads>) = sum_i grad_i with the tangent t_i in place of the incoming gradient."""
    taken = set(spec.inputs) | set(spec.scalars)
    tangents = {}
    for g in spec.gradients:
        if g.expr == 0:
            continue  # sign(x), a comparison: no tangent flows
        tangents[g.input] = names.fresh(names.JVP_TANGENT.format(g.input), taken)
        taken.add(tangents[g.input])
    if not tangents:
        return None  # every gradient is zero (sign(x)): nothing moves, no op
    if spec.is_rows:  # not diagonal: the tangents pushed forward through the tree
        rename = {symbol(x): symbol(t) for x, t in tangents.items()}
        trees = list(forward_tangents(spec.outputs, rename))
        for tree in trees:
            _check_size(tree, f"the forward-mode derivative of '{spec.name}'")
        return _jvp_op(spec, trees, tangents)
    # Per output, the gradients of that output alone (with several outputs, a reverse pass
    # each: setting the other douts to 0 would leave 0 * inf terms, NaN where eager has none).
    if len(spec.outputs) == 1:
        per_output = [{g.input: g.expr for g in spec.gradients}]
    else:
        wanted = [symbol(i) for i in spec.inputs]
        per_output = [{i: d[symbol(i)] for i in spec.inputs} for d in (backward(o, wanted) for o in spec.outputs)]
    trees = []
    for grads in per_output:
        tree = None
        for x, t in tangents.items():
            if grads[x] == 0:
                continue
            (term,) = dag.substitute([grads[x]], {GRAD: symbol(t)})
            tree = term if tree is None else fn.add(tree, term)
        trees.append(_ZERO if tree is None else tree)
        _check_size(trees[-1], f"the forward-mode derivative of '{spec.name}'")
    return _jvp_op(spec, trees, tangents)


def _jvp_op(spec: OpSpec, trees, tangents: dict) -> OpSpec:
    """<name>_jvp of forward `trees` in the primals and `tangents` (input -> its tangent's name)."""
    used = {s.name for s in dag.free_symbols(trees)}
    inputs = tuple(i for i in spec.inputs if i in used) + tuple(tangents.values())
    scalars = tuple(s for s in spec.scalars if s in used)
    parsed = Parsed(_outputs_text(trees), tuple(trees), inputs, scalars)
    return differentiate(parsed, name=spec.name + names.JVP_SUFFIX, command=spec.command, auxiliary=True)


def _outputs_text(trees) -> str:
    """An op's outputs as the expression language writes them: one expression, or a tuple."""
    return text(trees[0]) if len(trees) == 1 else "(" + ", ".join(text(t) for t in trees) + ")"


def _check_size(tree, what: str):
    """An auxiliary op's forward, before it is differentiated: within the graph budget."""
    with limits.scope() as budget:
        budget.check_nodes(dag.count([tree]), what)


def auxiliary_specs(spec: OpSpec) -> tuple[OpSpec, ...]:
    """The ops built beside `spec` into its library: <name>_grad2 (when it has a backward
    kernel) and <name>_jvp (when some gradient is not zero). An op that draws random numbers
    has no _jvp: its forward-mode tangent would need the numbers the forward is drawing
    (refused by the runtime's Autograd kernel); its _grad2 regenerates them from the saved
    state as its backward does."""
    if spec.random:
        return tuple(s for s in (grad2_spec(spec),) if s is not None)
    return tuple(s for s in (grad2_spec(spec), jvp_spec(spec)) if s is not None)


# -- forward mode through reductions -------------------------------------------------------------
#
# An elementwise op's Jacobian is diagonal, so its tangent is its reverse gradient with the
# tangent in place of GRAD (above). A reduction mixes a row's elements, so a row op's
# tangents are pushed forward through the tree instead, node by node: an elementwise
# node's tangent is sum over its arguments of d node/d arg * t_arg, which its backward
# formula gives with the argument's tangent as the incoming gradient (linear, diagonal, and
# where() keeps its guards); a reduction's is torch's forward formula for it.

def _amax_amin_jvp(e, r, t):
    """amax_amin_jvp: the tangent averaged over the elements equal to the result."""
    hit = fn.indicator(fn.Equal(e, r))
    return fn.div(fn.RowSum(fn.mul(t, hit)), fn.RowSum(hit))


_ROW_JVPS = {
    fn.RowSum: lambda e, r, t: fn.RowSum(t),
    fn.RowMean: lambda e, r, t: fn.RowMean(t),
    fn.RowMax: _amax_amin_jvp,
    fn.RowMin: _amax_amin_jvp,
    fn.RowLogSumExp: lambda e, r, t: fn.RowSum(fn.mul(t, fn.Exp(fn.sub(e, r)))),  # logsumexp_jvp
}


def forward_tangents(outputs, tangent_of: dict) -> tuple:
    """Each output's tangent, given `tangent_of` (input symbol -> its tangent's symbol; an
    input without one has a zero tangent)."""
    tangent: dict = dict(tangent_of)
    with limits.scope() as budget:
        work = 0
        for node in dag.postorder(list(outputs)):
            if not isinstance(node, fn.Node) or node.boolean:
                continue
            budget.check_time()
            if fn.is_reduction(node):
                t = tangent.get(node.args[0])
                if t is not None:
                    tangent[node] = _ROW_JVPS[type(node)](node.args[0], node, t)
                continue
            total = None
            for arg in dict.fromkeys(node.args):  # each distinct argument once
                t = tangent.get(arg)
                if t is None:
                    continue
                for a, contribution, guard in _vjp(node, t):
                    if a == arg:
                        total = _sum(total, _guarded(guard, contribution))
                        work += 1
            if total is not None:
                tangent[node] = total
            budget.check_nodes(work, "the forward-mode derivative")
    return tuple(tangent.get(o, _ZERO) for o in outputs)


# -- the reverse pass ---------------------------------------------------------------------------
#
# A gradient flows as a dict guard -> expression. The guard is a tuple of (condition, taken)
# pairs, one per `where` branch the gradient came through; it is applied (as nested where)
# only when the gradient reaches an input. Everything else is eager's formula, verbatim.

def backward(outputs, wanted: list[sympy.Symbol]) -> dict[sympy.Symbol, sympy.Expr]:
    """d(sum_k dout_k . outputs[k])/d(symbol) for each wanted symbol, by PyTorch's backward
    formulas; `outputs`: one tree (whose incoming gradient is GRAD) or a tuple of them (the
    incoming gradients primitives.douts(len(outputs)))."""
    outputs = (outputs,) if isinstance(outputs, sympy.Basic) else tuple(outputs)
    with limits.scope() as budget:
        return _backward(outputs, wanted, budget)


def _backward(outputs, wanted, budget: limits.Budget):
    # The reverse pass works on the graph: a node shared by several parents is visited once,
    # with the sum of what they send it. What can still grow is the number of (node, guard)
    # terms, one per distinct path of `where` branches; each is at least one operation of
    # the result, so they count against MAX_GRAPH_NODES as they are made. Each output starts
    # with its own incoming gradient; an output that is also a subexpression of another adds
    # what flows into it there.
    #
    # Row reductions: what flows is one value per element, which a reduction sums over the
    # row (RowSum(g)) into the gradient of its one value per row. An output of one value per
    # row (it reads no tensor element outside a reduction: a row's logsumexp) has one dout
    # per row, which is that gradient already: it flows in `per_row`, the same way, and a
    # reduction adds it to the row's sum instead of summing it again.
    order = dag.postorder(list(outputs))
    flowing: dict[sympy.Expr, dict[tuple, sympy.Expr]] = {}
    per_row: dict[sympy.Expr, dict[tuple, sympy.Expr]] = {}
    indices = fn.index_symbols(outputs)  # (a gather's index: one value per row)
    elementwise = set(wanted) - indices
    zero = rows.ZeroTest(indices)
    for out, dout in zip(outputs, fn.douts(len(outputs))):
        target = per_row if rows.is_row_value(out, elementwise) else flowing
        _accumulate(target.setdefault(out, {}), (), dout)
    work = 0
    what = "the gradients"
    for node in reversed(order):
        if not isinstance(node, fn.Node):
            continue  # an input or scalar: what reached it stays in `flowing`
        budget.check_time()
        terms = flowing.pop(node, None)
        row_terms = per_row.pop(node, None)
        if fn.is_reduction(node):
            element = row = None
            for guard, g in (terms or {}).items():
                element = _sum(element, _guarded(guard, g))
            if element is not None and zero.vanishes(element):
                element = None  # a shift the body does not depend on (rows.ZeroTest)
            for guard, g in (row_terms or {}).items():
                row = _sum(row, _guarded(guard, g))
            if element is not None or row is not None:
                for arg, contribution in _row_vjp(node, element, row):
                    if _differentiable(arg):
                        _accumulate(flowing.setdefault(arg, {}), (), contribution)
                        work += 1
            budget.check_nodes(work, what)
            continue
        for into, given in ((flowing, terms), (per_row, row_terms)):
            for guard, g in (given or {}).items():
                for arg, contribution, branch in _vjp(node, g):
                    if _differentiable(arg):
                        _accumulate(into.setdefault(arg, {}), guard + branch, contribution)
                        work += 1 + len(branch)
            budget.check_nodes(work, what)
    result = {}
    for s in wanted:
        total = None
        for guard, g in flowing.get(s, {}).items():
            work += 1 + len(guard)
            budget.check_nodes(work, what)
            budget.check_time()
            total = _guarded(guard, g) if total is None else fn.add(total, _guarded(guard, g))
        result[s] = sympy.Integer(0) if total is None else total
    return result


def _sum(total, term):
    """total + term, where either may be None (nothing yet)."""
    return term if total is None else total if term is None else fn.add(total, term)


def _row_vjp(node, element, row):
    """A reduction's arguments' gradients from what flowed into it: `element`, one value
    per element (or None), and `row`, one per row (or None). Its primitive's formula states
    them for an elementwise g, through RowSum(g) (RowMean(g)), the gradient of its row value:
    here that is RowSum(element) + row (divided by the row's length, RowSum(1))."""
    marker = sympy.Symbol("row_gradient")
    total = _sum(None if element is None else fn.RowSum(element), row)
    mean = fn.RowMean(element) if row is None else fn.div(total, fn.RowSum(sympy.Integer(1)))
    contributions = _FORMULAS[type(node)](node.args, node, marker)
    return [(arg, c) for arg, c in zip([a for a, _ in contributions],
                                       dag.substitute([c for _, c in contributions],
                                                      {fn.RowSum(marker): total, fn.RowMean(marker): mean}))]


def _differentiable(arg) -> bool:
    return not fn.is_number(arg) and not fn.is_condition(arg)


def _accumulate(terms: dict, guard: tuple, g):
    terms[guard] = fn.add(terms[guard], g) if guard in terms else g


def _guarded(guard, g):
    for condition, taken in reversed(guard):
        g = fn.Where(condition, g, _ZERO) if taken else fn.Where(condition, _ZERO, g)
    return g


_ZERO = sympy.Integer(0)


def _vjp(node, g):
    """[(argument, its gradient contribution, where-branch guard)] for one node, given the
    gradient g of its result: derivatives.yaml's formula for that op (_FORMULAS)."""
    formula = _FORMULAS.get(type(node))
    if formula is None:
        raise SpecError(f"no backward formula for {type(node).__name__}")
    # `r` is `result` in derivatives.yaml: the node's own value.
    if type(node) is fn.Where:
        return formula(node.args, node, g)  # its own guards: the branch not taken gets 0
    return [(arg, d, ()) for arg, d in formula(node.args, node, g)]


# node class -> formula(args, result, grad) -> [(argument, gradient contribution)]: each
# primitive's backward (primitives.PRIMITIVES); conditions have none (no gradient flows).
_FORMULAS = {p.node: p.backward for p in fn.PRIMITIVES if p.backward is not None}


def _check_printable(name: str, items, seen: set):
    """Every function must be one of functions.py's nodes (the printer knows no other).
    `items`: (what, expr) in order; `seen`: nodes already checked (shared by the calls)."""
    for what, expr in items:
        for a in dag.preorder(expr, seen):
            if a is sympy.zoo or (isinstance(a, sympy.Function) and not isinstance(a, fn.Node)):
                raise SpecError(f"fusegen op '{name}': {what} contains {a}, which has no finite value in C; "
                                "expected an expression defined for real inputs")


def straight_line(results) -> Program:
    """One cse over `results` (name, expr) alone: their program, temporaries t0, t1, ..."""
    temps, reduced = dag.cse([e for _, e in results], sympy.numbered_symbols("__cse"))
    reads = {s: dag.free_symbols([e]) for s, e in temps}
    return _program(temps, [(n, e) for (n, _), e in zip(results, reduced)], reads)


def _program(temps, results, reads) -> Program:
    """Keep the temporaries `results` depend on, in order, renamed t0, t1, ...
    `reads`: each temporary's free symbols."""
    needed: set[sympy.Symbol] = set()
    frontier = dag.free_symbols([e for _, e in results])
    while frontier:
        s = frontier.pop()
        if s in reads and s not in needed:
            needed.add(s)
            frontier |= reads[s]
    kept = [(s, e) for s, e in temps if s in needed]
    # No assumptions: a temporary never equals a user's name (real=True), even `t0`.
    rename = {s: sympy.Symbol(f"{names.TEMP_PREFIX}{i}") for i, (s, _) in enumerate(kept)}
    renamed = dag.substitute([e for _, e in kept] + [e for _, e in results], rename)
    return Program(
        temps=tuple((rename[s], e) for (s, _), e in zip(kept, renamed)),
        results=tuple((n, e) for (n, _), e in zip(results, renamed[len(kept):])),
    )


def default_name(parsed: Parsed) -> str:
    """Unnamed ops get a stable name from their content: fused_<8 hex>."""
    key = json.dumps([parsed.text, parsed.inputs, parsed.scalars])
    return "fused_" + hashlib.sha256(key.encode()).hexdigest()[:8]


def default_command(parsed: Parsed, name: str) -> str:
    parts = ["fusegen", json.dumps(parsed.text), "--name", name]
    if parsed.inputs:
        parts += ["--inputs", ",".join(parsed.inputs)]
    for s in parsed.scalars:
        parts += ["--scalar", s]
    return " ".join(parts)

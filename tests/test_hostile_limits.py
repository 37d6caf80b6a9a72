"""Short valid text that asks for a lot of work, and @fused functions whose meaning the
source does not show.

fusegen bounds the work, not the text (fusegen/ir/limits.py): the derived graph (distinct
operations of the op's forward and gradients, its _grad2 and _jvp ops included), the
generated source, and the CPU time derivation may take. Every walk over an expression
visits a shared subexpression once and never recurses, so sharing is kept (a @fused body of
ten lines `y = y*y + 1` is a graph of 20 operations, and its gradient is linear too) and deep
expressions within the parser's limits meet no recursion limit. Where a gradient really is
large, a LimitError says which limit and its value, quickly.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import time

import pytest
import sympy
import torch

import fusegen
from fusegen.pytorch import composite
from fusegen.ir import dag
from fusegen.ir import limits
from fusegen.ir import primitives as fn
from fusegen.api import Request, _with_c_names, generate
from fusegen.tools.cli import main
from fusegen.errors import FusegenError, LimitError, ParseError, SpecError
from fusegen.files import write
from fusegen.ir.notation import MAX_TEXT_NODES, text
from fusegen.frontend.parse import parse
from fusegen.ir.names import MAX_OP_NAME
from fusegen.codegen.printer import print_op
from fusegen.codegen.render import render
from fusegen.ir.spec import GRAD, auxiliary_specs, differentiate

from corpus import CORPUS


def nested_maximum(depth: int) -> str:
    e = "x"
    for _ in range(depth):
        e = f"maximum({e}, y)"
    return e


def power_chain(depth: int) -> str:
    e = "x"
    for _ in range(depth):
        e = f"({e})**y"
    return e


def shared_lines(n: int, line: str = "y = y*y + 1") -> str:
    return "def f(x):\n    y = x\n" + f"    {line}\n" * n + "    return y\n"


def own_source(files) -> int:
    return sum(len(t.encode()) for t in files.values())


def timed(make):
    """(result or the exception raised, CPU seconds of this thread)."""
    start = time.thread_time()
    try:
        result = make()
    except Exception as err:  # noqa: BLE001 - the caller asserts on it
        result = err
    return result, time.thread_time() - start


# -- short text, large work: each case a correct op or a LimitError, in well under 5 s -------

@pytest.mark.parametrize("depth", [4, 5, 6])
def test_nested_maximum_a_few_deep_is_an_op_of_bounded_size(depth):
    g, seconds = timed(lambda: generate(Request(nested_maximum(depth), name=f"hl_max{depth}")))
    assert not isinstance(g, Exception), g
    assert own_source(g.files) < limits.MAX_SOURCE_BYTES
    assert seconds < 3


@pytest.mark.parametrize("make, name", [(lambda: nested_maximum(7), "hl_max7"),
                                        (lambda: power_chain(20), "hl_pow20"),
                                        (lambda: "*".join(f"x{i}" for i in range(150)), "hl_prod150")])
def test_short_text_whose_gradients_are_large_is_a_limit_error_quickly(make, name):
    expr = make()
    err, seconds = timed(lambda: generate(Request(expr, name=name)))
    assert isinstance(err, LimitError), err
    assert err.limit == "MAX_GRAPH_NODES" and err.value == limits.MAX_GRAPH_NODES
    assert f"MAX_GRAPH_NODES={limits.MAX_GRAPH_NODES}" in str(err) and f"'{name}'" in str(err)
    assert seconds < 3


def test_a_fused_body_of_shared_lines_is_a_small_graph_and_works():
    """Ten lines `y = y*y + 1`: 20 operations, not the 2**10 paths; the gradient and the
    auxiliary ops are linear too, and the trees compute what eager autograd does."""
    g, seconds = timed(lambda: generate(Request(shared_lines(10), name="hl_square10", params=("x",))))
    assert not isinstance(g, Exception), g
    assert seconds < 2
    spec = g.spec
    assert dag.count([spec.forward]) == 20
    assert dag.count([spec.gradients[0].expr]) <= 60
    assert sum(dag.count([a.forward] + [x.expr for x in a.gradients]) for a in g.auxiliary) < 1000
    assert len(spec.backward_program.temps) < 60

    x = torch.linspace(-1.1, 1.1, 7, dtype=torch.float64, requires_grad=True)
    y = x
    for _ in range(10):
        y = y * y + 1
    dout = torch.linspace(0.5, 1.5, 7, dtype=torch.float64)
    (want,) = torch.autograd.grad(y, x, dout)
    X = sympy.Symbol("x", real=True)
    out, grad = composite.evaluate([spec.forward, spec.gradients[0].expr], {X: x.detach(), GRAD: dout},
                                   (7,), torch.float64, x.device)
    torch.testing.assert_close(out, y.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)


def test_sharing_keeps_the_source_linear_in_the_body():
    """Twice the lines, about twice the code: nothing is written out path by path."""
    sizes = [own_source(generate(Request(shared_lines(n), name=f"hl_square{n}", params=("x",))).files)
             for n in (20, 40)]
    assert sizes[1] < 2.5 * sizes[0], sizes


def test_headers_describe_an_expression_too_long_to_write_out():
    g = generate(Request(shared_lines(10), name="hl_square10b", params=("x",)))
    header = g.files["hl_square10b.h"]
    assert "d/dx = <more than" in header and "read the code" in header
    assert max(len(line) for line in header.splitlines()) < 1000
    # An ordinary gradient is still written out in full.
    assert text(differentiate(parse("x*sigmoid(x)"), name="hl_silu").gradients[0].expr) == \
        "grad*sigmoid(x) + grad*x*(1 - sigmoid(x))*sigmoid(x)"


@pytest.mark.slow
def test_a_fused_body_of_shared_lines_builds_and_matches_eager():
    @fusegen.fused(name="hl_square_built")
    def square10(x):
        y = x * x + 1
        y = y * y + 1
        y = y * y + 1
        y = y * y + 1
        y = y * y + 1
        y = y * y + 1
        y = y * y + 1
        y = y * y + 1
        y = y * y + 1
        y = y * y + 1
        return y

    x = torch.linspace(-1.05, 1.05, 33, dtype=torch.float64, requires_grad=True)
    got = square10(x)
    want = square10.eager(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    dout = torch.rand(33, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(got, x, dout)[0], torch.autograd.grad(want, x, dout)[0],
                               rtol=1e-12, atol=0)


# -- no RecursionError, at any depth the parser allows ------------------------------------------

DEEP = {
    "sum499": ("+".join(f"x{i}" for i in range(499)), None),
    "minus300": ("-".join(f"x{i}" for i in range(300)), None),
    "sin_lines": (shared_lines(190, "y = torch.sin(y)"), ("x",)),
    "fused_sum400": ("def f(x):\n    return " + " + ".join(["x"] * 400) + "\n", ("x",)),
}


@pytest.mark.parametrize("name", sorted(DEEP))
def test_deep_expressions_within_the_parser_limits_need_no_recursion(name):
    """With Python's recursion limit far below the expressions' depth, every stage after
    Python's own parser (whose C code counts against the limit) still runs: nothing of
    fusegen's walks a tree by recursion."""
    expr, params = DEEP[name]
    request = Request(expr, name=f"hl_{name}", params=params)
    generate(Request("x*y", name="hl_warm"))  # imports and templates loaded at the usual limit
    parsed = request.parse()
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 150)
    try:
        with limits.scope(request.name):
            spec = differentiate(parsed, name=request.name)
            auxiliary = auxiliary_specs(spec)
            printed = [print_op(_with_c_names(s)) for s in (spec,) + auxiliary]
            files = render(spec, printed[0], tuple(zip(auxiliary, printed[1:])))
    finally:
        sys.setrecursionlimit(old)
    assert own_source(files) < limits.MAX_SOURCE_BYTES
    assert files == generate(request).files


def test_a_deep_product_of_one_input_is_a_limit_error_not_a_recursion_error():
    err, seconds = timed(lambda: generate(Request("*".join(["x"] * 499), name="hl_pow_by_hand")))
    assert isinstance(err, LimitError) and err.limit == "MAX_GRAPH_NODES", err
    assert seconds < 4


def test_a_recursion_error_inside_a_stage_becomes_a_limit_error(monkeypatch):
    """The last resort: a sympy walk fusegen does not own that still recursed."""
    from fusegen.ir import spec as spec_module
    def deep(*args):
        raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(spec_module, "_vjp", deep)
    with pytest.raises(LimitError, match="nested too deeply") as info:
        generate(Request("x*y", name="hl_recursion"))
    assert info.value.limit == "recursion"


def test_the_composite_evaluates_a_deep_tree_without_recursion():
    x = sympy.Symbol("x", real=True)
    tree = x
    for _ in range(3000):
        tree = fn.Sin(tree)
    t = torch.tensor([0.5], dtype=torch.float64)
    (got,) = composite.evaluate([tree], {x: t}, (1,), torch.float64, t.device)
    want = t
    for _ in range(3000):
        want = torch.sin(want)
    torch.testing.assert_close(got, want)


# -- the limits themselves -----------------------------------------------------------------------

def test_the_graph_limit_names_itself_and_its_value(monkeypatch):
    monkeypatch.setattr(limits, "MAX_GRAPH_NODES", 40)
    with pytest.raises(LimitError, match=r"more than 40 operations \(the limit MAX_GRAPH_NODES=40") as info:
        generate(Request("0.5*x*(1+tanh(0.7978845608*(x+0.044715*x*x*x)))", name="hl_gelu"))
    assert (info.value.limit, info.value.value) == ("MAX_GRAPH_NODES", 40)


def test_the_source_limit_names_itself_and_its_value(monkeypatch):
    monkeypatch.setattr(limits, "MAX_SOURCE_BYTES", 10_000)
    with pytest.raises(LimitError, match=r"over the limit MAX_SOURCE_BYTES=10000") as info:
        generate(Request("a*b+c", name="hl_fma"))
    assert info.value.limit == "MAX_SOURCE_BYTES"


def test_the_deadline_is_checked_inside_the_derivation(monkeypatch):
    monkeypatch.setenv(limits.SECONDS_ENV, "0.05")
    err, seconds = timed(lambda: generate(Request(power_chain(12), name="hl_deadline")))
    assert isinstance(err, LimitError) and err.limit == limits.SECONDS_ENV and err.value == 0.05, err
    assert f"{limits.SECONDS_ENV}=0.05" in str(err) and "CPU time" in str(err)
    assert seconds < 1


def test_the_deadline_can_be_raised_or_turned_off(monkeypatch):
    monkeypatch.setenv(limits.SECONDS_ENV, "inf")
    assert generate(Request("a*b+c", name="hl_fma_inf")).spec.name == "hl_fma_inf"
    assert limits.derive_seconds() == math.inf
    monkeypatch.delenv(limits.SECONDS_ENV)
    assert limits.derive_seconds() == limits.DEFAULT_DERIVE_SECONDS


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan"])
def test_a_bad_deadline_setting_is_refused(monkeypatch, value):
    monkeypatch.setenv(limits.SECONDS_ENV, value)
    with pytest.raises(FusegenError, match=f"{limits.SECONDS_ENV} must be a positive number"):
        generate(Request("a*b+c", name="hl_fma_bad"))


def test_the_cli_reports_a_limit_as_one_message(capsys):
    assert main([nested_maximum(7), "--name", "hl_cli_max7", "--no-build", "--out", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "MAX_GRAPH_NODES=10000" in err and "Traceback" not in err


# -- the graph walks do what sympy's do ------------------------------------------------------------

def _family_trees():
    for case in CORPUS:
        spec = differentiate(parse(case.expr, case.inputs, case.scalars), name=case.name)
        for s in (spec,) + auxiliary_specs(spec):
            yield s.name, [s.forward] + list(s.backward_exprs)


def test_fusegens_cse_is_sympys():
    """dag.cse gives sympy.cse's temporaries, in order, named alike (the golden files
    depend on it), for the forward and backward of every corpus op and its auxiliary ops."""
    for name, exprs in _family_trees():
        ours = dag.cse(exprs, sympy.numbered_symbols("__cse"))
        theirs = sympy.cse(exprs, symbols=sympy.numbered_symbols("__cse"), order="none")
        assert ours[0] == theirs[0] and ours[1] == list(theirs[1]), name


def test_fusegens_walks_are_sympys():
    for name, exprs in _family_trees():
        assert dag.free_symbols(exprs) == set().union(*(e.free_symbols for e in exprs)), name
        rules = {GRAD: sympy.Symbol("g2"), sympy.Symbol("x", real=True): sympy.Symbol("in_x", real=True)}
        assert dag.substitute(exprs, rules) == [e.xreplace(rules) for e in exprs], name
        for e in exprs:
            assert list(dag.preorder(e)) == list(dict.fromkeys(sympy.preorder_traversal(e))), name
            assert dag.written_size(e, 10 ** 9) == sum(1 for _ in sympy.preorder_traversal(e)), name


def test_equal_nodes_are_one_object():
    x, y = sympy.Symbol("x", real=True), sympy.Symbol("y", real=True)
    assert fn.Plus(fn.Times(x, y), sympy.Integer(1)) is fn.Plus(fn.Times(x, y), sympy.Integer(1))
    assert fn.Times(x, y) is not fn.Times(y, x)
    built = fn.Maximum(x, y)
    by_sympy = sympy.Function.__new__(fn.Maximum, x, y)
    assert built == by_sympy and hash(built) == hash(by_sympy) and built.nargs == by_sympy.nargs


# -- @fused: what the source shows is what the op computes -------------------------------------------

def negated(f):
    @functools.wraps(f)
    def wrapper(*args):
        return -f(*args)
    return wrapper


def registered(f):
    return f  # changes nothing, but a decorator the op would not see is refused all the same


def test_fused_refuses_a_function_another_decorator_wrapped():
    with pytest.raises(SpecError, match="wrapped by another decorator .*__wrapped__"):
        @fusegen.fused(name="hl_wrapped")
        @negated
        def f(x):
            return x * 2


def test_fused_refuses_a_decorator_between_it_and_the_def():
    with pytest.raises(ParseError, match=r"another decorator below @fused \(@registered\)") as info:
        @fusegen.fused(name="hl_below")
        @registered
        def f(x):
            return x * 2
    assert "@registered" in str(info.value) and "put @fused directly above the def" in str(info.value)


def test_fused_refuses_a_function_decorated_in_its_source_and_fused_by_a_call():
    @registered
    def f(x):
        return x * 2
    with pytest.raises(ParseError, match="another decorator below @fused"):
        fusegen.fused(f, name="hl_called")


def test_fused_accepts_decorators_above_it_and_its_own_aliases():
    from fusegen import fused as fz
    silu_like = fusegen.fused(name="hl_alias")

    @registered
    @fusegen.fused(name="hl_above")
    def f(x):
        return x * 3

    @fz(name="hl_as")
    def g(x):
        return x * 4

    @silu_like
    def h(x):
        return x * torch.sigmoid(x)

    assert [type(v).__name__ for v in (f, g, h)] == ["FusedFunction"] * 3


@pytest.mark.parametrize("source, params, culprit", [
    ("def f(exp):\n    return exp(exp)\n", ("exp",), "parameter 'exp' shadows the function exp()"),
    ("def f(torch):\n    return torch.exp(torch)\n", ("torch",), "parameter 'torch' shadows the module 'torch'"),
    ("def f(x, math):\n    return x * math.pi\n", ("x", "math"), "parameter 'math' shadows the module 'math'"),
    ("def f(F, x):\n    return F.relu(x)\n", ("F", "x"), "parameter 'F' shadows the module 'F'"),
    ("def f(x):\n    sigmoid = x + 1\n    return sigmoid(sigmoid)\n", ("x",),
     "local name 'sigmoid' shadows the function"),
    ("def f(x):\n    y = exp(x)\n    exp = y\n    return exp\n", ("x",), "local name 'exp' shadows the function"),
])
def test_fused_refuses_names_that_shadow_what_the_body_calls(source, params, culprit):
    with pytest.raises(ParseError, match=culprit.replace("(", r"\(").replace(")", r"\)")) as info:
        generate(Request(source, name="hl_shadow", params=params))
    assert "eager Python would" in str(info.value)


def test_fused_refuses_a_parameter_that_shadows_a_function_at_the_def():
    with pytest.raises(ParseError, match="parameter 'exp' shadows the function exp()"):
        @fusegen.fused(name="hl_shadow_def")
        def f(exp):
            return exp(exp)


def test_a_parameter_named_like_a_function_but_not_called_is_fine():
    g = generate(Request("def f(exp, x):\n    return exp * torch.exp(x)\n", name="hl_param_exp",
                         params=("exp", "x")))
    assert g.spec.inputs == ("exp", "x")
    assert generate(Request("exp(exp)", name="hl_text_exp")).spec.inputs == ("exp",)  # text: as before


# -- names and literals ----------------------------------------------------------------------------

def test_a_long_op_name_is_refused_before_it_names_a_file(tmp_path):
    with pytest.raises(SpecError, match=f"op name too long \\(240 characters, limit {MAX_OP_NAME}\\)"):
        generate(Request("x*2", name="o" * 240))
    files = generate(Request("x*2", name="o" * MAX_OP_NAME)).files
    assert max(len(f.encode()) for f in files) < 255
    write(files, tmp_path / ("o" * MAX_OP_NAME))  # no OSError: every file name fits

    def f(x):
        return x * 2
    f.__name__ = "f" * 240  # @fused names the op after the function
    with pytest.raises(SpecError, match="op name too long"):
        fusegen.fused(f)


@pytest.mark.parametrize("literal", ["3.1e38", "3.4028235e38", "-3.4e38", "3.4028234663852886e38"])
def test_literals_up_to_float32s_maximum_are_accepted(literal):
    assert parse(f"x*{literal}").tree.args[1] == fn.number(float(literal))


@pytest.mark.parametrize("literal", ["3.41e38", "1e39"])
def test_literals_beyond_float32s_maximum_are_refused_with_the_range(literal):
    with pytest.raises(ParseError, match=r"outside the float32 range \(\|value\| <= 3.4028235e38\)"):
        parse(f"x*{literal}")

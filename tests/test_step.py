"""Step ops: statement programs that update inputs in place (fusegen/frontend/statements.py,
fusegen/ir/step.py, templates/runtime/fusegen-step.cpp), against the same statements run
eagerly in float64."""

import pytest
import torch

import fusegen
from fusegen.errors import ParseError, SpecError
from fusegen.frontend.statements import parse_program
from fusegen.ir.expr import Parsed

ADAMW = ("m = beta1*m + (1-beta1)*g; v = beta2*v + (1-beta2)*g*g; "
         "p = p*(1-lr*wd) - lr*(m/bc1)/(sqrt(v/bc2)+eps)")
SCALARS = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1, bc1=0.1, bc2=0.001)


@pytest.fixture(scope="module")
def adamw():
    return fusegen.fuse(ADAMW, name="t_step_adamw", inputs="p,g,m,v", scalars="lr,beta1,beta2,eps,wd,bc1,bc2")


@pytest.fixture(scope="module")
def axpy():
    """p read after another input is updated: an alias of p and x is refused."""
    return fusegen.fuse("x = x * 2\np = p + a * x", name="t_step_axpy", scalars="a")


def eager_adamw(p, g, m, v, lr, beta1, beta2, eps, wd, bc1, bc2):
    """The statements, run eagerly (the oracle)."""
    m.copy_(beta1 * m + (1 - beta1) * g)
    v.copy_(beta2 * v + (1 - beta2) * g * g)
    p.copy_(p * (1 - lr * wd) - lr * (m / bc1) / ((v / bc2).sqrt() + eps))


def state(shape, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p, g = (torch.randn(shape, generator=gen, dtype=dtype) for _ in range(2))
    m = torch.randn(shape, generator=gen, dtype=dtype) * 0.1
    v = torch.rand(shape, generator=gen, dtype=dtype) * 0.01
    return [p, g, m, v]


# -- the language -----------------------------------------------------------------------------

def test_reads_see_values_as_the_statements_go():
    prog = parse_program("m = 2*m + g; p = p - m", inputs="p,g,m")
    assert [u for u, _ in prog.updates] == ["p", "m"]
    new_p = dict(prog.updates)["p"]
    assert {s.name for s in new_p.free_symbols} == {"p", "m", "g"}  # p - (2m + g)
    assert prog.reads == ("p", "g", "m")


def test_temporaries_are_not_inputs_and_a_result_makes_an_ordinary_op():
    parsed = parse_program("t = a*b\nt + c")
    assert isinstance(parsed, Parsed) and parsed.inputs == ("a", "b", "c")
    prog = parse_program("t = g*g; v = v + t")
    assert prog.inputs == ("g", "v") and [u for u, _ in prog.updates] == ["v"]


def test_a_write_only_input_is_named_in_inputs():
    prog = parse_program("p = p - lr*g; q = p", inputs="p,g,q", scalars="lr")
    assert [u for u, _ in prog.updates] == ["p", "q"] and prog.reads == ("p", "g")


@pytest.mark.parametrize("text, message", [
    ("m += g", "augmented assignment"),
    ("m = m + g; m + 1", "also ends in an expression"),
    ("lr = 2; p = p - lr", "assignment to scalar"),
    ("m = m +", "invalid syntax"),
    ("a, b = b, a", "unsupported statement"),
    ("import os", "unsupported statement"),
    ("m = __import__('os')", "unknown function '__import__'"),
    ("__m = g", "must not start with '__'"),
])
def test_bad_programs_get_clear_errors(text, message):
    with pytest.raises((ParseError, SpecError)) as err:
        parse_program(text, scalars=("lr",) if "lr" in text else ())
    assert message in str(err.value)


def test_schema_marks_every_updated_input(adamw):
    schema = str(adamw.op.default._schema)
    assert "Tensor(a!) p, Tensor g, Tensor(b!) m, Tensor(c!) v" in schema and schema.endswith("-> ()")
    foreach = str(adamw.foreach_op.default._schema)
    assert "Tensor(a!)[] p" in foreach and "Tensor?[] scalar_tensors" in foreach
    assert adamw.updated == ("p", "m", "v")


# -- results ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1000,), (3, 5, 7), (0,), ()])
def test_matches_the_statements_run_eagerly_in_float64(adamw, shape):
    ours, ref = state(shape), [t.clone() for t in state(shape)]
    assert adamw(*ours, **SCALARS) is None
    eager_adamw(*ref, **SCALARS)
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_torch_ops_call_and_positional_scalars(adamw):
    ours, ref = state((64,)), [t.clone() for t in state((64,))]
    torch.ops.fusegen.t_step_adamw(*ours, *SCALARS.values())
    eager_adamw(*ref, **SCALARS)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-12, atol=1e-14)


def test_foreach_over_shapes_and_mixed_dtypes(adamw):
    """bf16 parameters and gradients beside fp32 state, several shapes, in one call: each
    computed in float32 from its own dtypes, rounded once into each."""
    shapes = [(7,), (3, 4), (70000,), (2, 3, 5)]
    ps = [torch.randn(s).bfloat16() for s in shapes]
    gs = [torch.randn(s).bfloat16() for s in shapes]
    ms = [torch.randn(s) * 0.1 for s in shapes]
    vs = [torch.rand(s) * 0.01 for s in shapes]
    want = []
    for p, g, m, v in zip(ps, gs, ms, vs):
        r = [p.double(), g.double(), m.double(), v.double()]
        eager_adamw(*r, **SCALARS)
        want.append(r)
    adamw.foreach(ps, gs, ms, vs, **SCALARS)
    for (p, _, m, v), (wp, _, wm, wv) in zip(zip(ps, gs, ms, vs), want):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        torch.testing.assert_close(p.double(), wp.to(torch.bfloat16).double(), rtol=8e-3, atol=1e-5)
        torch.testing.assert_close(m.double(), wm, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(v.double(), wv, rtol=1e-5, atol=1e-9)


def test_scalars_as_0d_tensors(adamw):
    ours, ref = state((100,)), [t.clone() for t in state((100,))]
    adamw(*ours, **dict(SCALARS, lr=torch.tensor(1e-2, dtype=torch.float64), bc2=torch.tensor(0.001)))
    eager_adamw(*ref, **SCALARS)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=1e-9)  # bc2 went through float32


def test_non_contiguous_and_differently_laid_out_tensors(adamw):
    base = state((6, 8))
    ours = [base[0].t(), base[1].t().contiguous(), base[2].t(), base[3].t()]  # g has other strides
    ref = [t.clone() for t in ours]
    adamw(*ours, **SCALARS)
    eager_adamw(*ref, **SCALARS)
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    sliced = [t[::2] for t in state((20,))]
    ref = [t.clone() for t in sliced]
    adamw(*sliced, **SCALARS)
    eager_adamw(*ref, **SCALARS)
    torch.testing.assert_close(sliced[0], ref[0], rtol=1e-12, atol=1e-14)


def test_version_counters_move_as_for_eager_in_place_ops(adamw):
    p, g, m, v = state((10,))
    before = [t._version for t in (p, g, m, v)]
    adamw(p, g, m, v, **SCALARS)
    assert [t._version - b for t, b in zip((p, g, m, v), before)] == [1, 0, 1, 1]


# -- refusals ----------------------------------------------------------------------------------

def test_an_updated_tensor_that_requires_grad_is_refused_in_grad_mode(adamw):
    p, g, m, v = state((10,))
    p.requires_grad_()
    with pytest.raises(RuntimeError, match="argument 'p' requires grad and is updated in place"):
        adamw(p, g, m, v, **SCALARS)
    with torch.no_grad():
        adamw(p, g, m, v, **SCALARS)  # as an optimizer steps


def test_aliasing_follows_eager(adamw, axpy):
    # m's statement reads g before m is written, but v's reads g after: m is g is refused.
    p, g, _, v = state((10,))
    with pytest.raises(RuntimeError, match="'m' is updated in place and is the same tensor as argument 'g'"):
        adamw(p, g, g, v, **SCALARS)
    # x is updated first, p's statement reads x after: p may be a (read before), not x.
    x, p, a = torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 3.0
    with pytest.raises(RuntimeError, match="is the same tensor as argument"):
        axpy(x, x, a=a)
    buf = torch.zeros(8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="overlaps"):
        axpy(buf[:6], buf[2:], a=a)
    with pytest.raises(RuntimeError, match="share memory"):
        axpy(torch.zeros(1, dtype=torch.float64).expand(4), p, a=a)


def test_alias_allowed_where_the_kernel_gives_eagers_result():
    step = fusegen.fuse("p = p - lr * g", name="t_step_sgd", scalars="lr")
    t = torch.tensor([1.0, 2.0], dtype=torch.float64)
    ref = t.clone()
    step(t, t, lr=0.5)   # p.copy_(p - lr * p)
    ref.copy_(ref - 0.5 * ref)
    torch.testing.assert_close(t, ref)


@pytest.mark.parametrize("call, message", [
    (lambda s, t: s(t[0], t[1][:3], t[2], t[3], **SCALARS), "has shape"),
    (lambda s, t: s(t[0], t[1].long(), t[2], t[3], **SCALARS), "has dtype Long"),
    (lambda s, t: s.foreach([t[0]], [t[1], t[1]], [t[2]], [t[3]], **SCALARS), "has 2 tensors, expected 1"),
    (lambda s, t: s(t[0], t[1], t[2], t[3], **dict(SCALARS, lr=torch.ones(2))), "scalar 'lr' must be"),
    (lambda s, t: s(t[0], t[1], t[2], t[3], **dict(SCALARS, lr="x")), "scalar 'lr' must be"),
    (lambda s, t: s(t[0], t[1], t[2], **SCALARS), "missing a required argument: 'v'"),
    (lambda s, t: s(t[0], t[1], t[2], t[3], **dict(SCALARS, lrr=1)), "unexpected keyword argument 'lrr'"),
    (lambda s, t: s.foreach(t[0], [t[1]], [t[2]], [t[3]], **SCALARS), "must be a list of tensors"),
])
def test_bad_calls_name_the_op_and_the_argument(adamw, call, message):
    with pytest.raises((RuntimeError, TypeError)) as err:
        call(adamw, state((5,)))
    assert message in str(err.value) and "t_step_adamw" in str(err.value)


def test_one_name_one_program(adamw):
    with pytest.raises(fusegen.errors.LoadError, match="already defined"):
        fusegen.fuse("p = p - g", name="t_step_adamw")
    assert fusegen.fuse(ADAMW, name="t_step_adamw", inputs="p,g,m,v",
                        scalars="lr,beta1,beta2,eps,wd,bc1,bc2") is adamw


# -- torch.library and torch.compile -------------------------------------------------------------

def test_opcheck(adamw):
    p, g, m, v = state((16,), dtype=torch.float32)
    torch.library.opcheck(adamw.op.default, (p, g, m, v, *SCALARS.values()))
    torch.library.opcheck(adamw.foreach_op.default,
                          ([p], [g], [m], [v], list(SCALARS.values()), [None] * len(SCALARS)))


def test_torch_compile_functionalizes_and_updates_in_place(adamw):
    def train_step(p, g, m, v, lr):
        adamw.foreach([p], [g], [m], [v], **dict(SCALARS, lr=lr))
        return p.sum()

    compiled = torch.compile(train_step, backend="aot_eager", fullgraph=True)
    ours, ref = state((32,), dtype=torch.float32), state((32,), dtype=torch.float32)
    for step in range(3):
        lr = torch.tensor(1e-2 / (step + 1))
        compiled(*ours, lr)
        eager_adamw(*ref, **dict(SCALARS, lr=1e-2 / (step + 1)))
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_torch_export_records_the_mutation(adamw):
    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("m", torch.zeros(8))
            self.register_buffer("v", torch.zeros(8))

        def forward(self, p, g):
            adamw(p, g, self.m, self.v, **SCALARS)
            return p * 1

    p, g = torch.randn(8), torch.randn(8)
    exported = torch.export.export(Step(), (p.clone(), g))
    assert "t_step_adamw" in str(exported.graph)
    functional = exported.run_decompositions()  # auto_functionalized: the mutations in the signature
    assert sorted(functional.graph_signature.buffers_to_mutate.values()) == ["m", "v"]
    assert list(functional.graph_signature.user_inputs_to_mutate.values()) == ["p"]


def test_a_cached_step_op_loads_without_sympy(adamw, tmp_path):
    """A new process finds the step op in the request index: no parser, no sympy, no Jinja."""
    import subprocess
    import sys

    script = tmp_path / "load.py"
    script.write_text(f"""
import sys, torch, fusegen
step = fusegen.fuse({ADAMW!r}, name="t_step_adamw", inputs="p,g,m,v", scalars="lr,beta1,beta2,eps,wd,bc1,bc2")
assert not any(m in sys.modules for m in ("sympy", "jinja2")), "the pipeline ran"
p, g, m, v = (torch.ones(3) for _ in range(4))
step(p, g, m, v, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0, bc1=1.0, bc2=1.0)
assert step.updated == ("p", "m", "v") and float(m[0]) == 1.0
assert fusegen.load("t_step_adamw") is step and fusegen.ops.t_step_adamw is step
print(step.spec.name)  # the spec on request: the pipeline runs now
""")
    by_name = tmp_path / "by_name.py"
    by_name.write_text("""
import sys, fusegen
step = fusegen.load("t_step_adamw")  # by name, from the index: a FusedStep
assert type(step).__name__ == "FusedStep" and step.updated == ("p", "m", "v")
assert "sympy" not in sys.modules
""")
    run = subprocess.run([sys.executable, str(by_name)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "t_step_adamw"


def test_fp32_master_copy_beside_bf16_params():
    """Mixed precision as optimizers keep it: the fp32 master weights updated, the bf16
    model weights written from them (a write-only input), in one pass."""
    step = fusegen.fuse("w = w - lr * g; p = w", name="t_step_master", inputs="w,g,p", scalars="lr")
    master = [torch.randn(5, 3), torch.randn(70)]
    grads = [torch.randn(t.shape).bfloat16() for t in master]
    model = [t.bfloat16() for t in master]
    want = [w - 0.1 * g.float() for w, g in zip(master, grads)]
    step.foreach(master, grads, model, lr=0.1)
    for w, p, ref in zip(master, model, want):
        torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-7)
        assert p.dtype == torch.bfloat16 and torch.equal(p, ref.bfloat16())
    assert step.updated == ("w", "p")


# -- hostile programs ------------------------------------------------------------------------------

def test_repeated_squaring_stays_a_graph_not_a_tree():
    """64 statements that each double the expression's tree size are 64 nodes of a graph:
    the work is bounded by distinct operations, not by the tree they would expand to."""
    text = "; ".join(["x = x*x + 1"] * 64)
    prog = parse_program(text)
    from fusegen.ir import dag
    assert dag.count([e for _, e in prog.updates]) <= 2 * 64 + 2


@pytest.mark.parametrize("text, message", [
    ("; ".join(["x = x + 1"] * 65), "limit 64"),
    ("x = " + "exp(" * 60 + "x" + ")" * 60, "nested too deeply"),
    ("x = x + 1\n" * 500, "too long"),
    ("x = x\u00b2", "non-ASCII"),
    ("x = lambda: 1", "unsupported syntax"),
    ("x = [x]", "unsupported syntax"),
    ("x.y = 1", "unsupported statement"),
    ("del x", "unsupported statement"),
])
def test_hostile_programs_are_refused_with_a_clear_error(text, message):
    with pytest.raises((ParseError, SpecError)) as err:
        parse_program(text)
    assert message in str(err.value)


def test_too_many_operands_is_refused_before_any_build():
    names_ = [f"x{i}" for i in range(25)]
    text = "; ".join(f"{n} = {n} + 1" for n in names_)
    with pytest.raises(SpecError, match="at most 24 in all"):
        fusegen.fuse(text, name="t_step_wide")

"""@fused functions that update their parameters in place (`p.copy_(expr)`): the step op of
the same statements (frontend/statements.py parse_function, frontend/decorator.py
FusedStepFunction), against the undecorated function run eagerly."""

import pytest
import torch

import fusegen
from fusegen.errors import ParseError, SpecError
from fusegen.frontend import statements
from fusegen.frontend.statements import parse_program
from fusegen.pytorch.step import FusedStep


@fusegen.fused(scalars=("lr", "beta"), name="t_fused_momentum")
def momentum_step(p, g, b, lr, beta):
    """SGD with momentum: reads of b after its copy_ see the new value."""
    b.copy_(beta * b + g)
    p.copy_(p - lr * b)


@fusegen.fused(name="t_fused_decay")
def decay_step(p, g, lr: float, wd=0.01):
    scale = 1 - lr * wd
    p.copy_(p * scale - lr * torch.sign(g))
    return None


def tensors(n=33, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(3)]


def test_the_body_is_the_program_fuse_reads():
    source = "def f(p, g, b, lr, beta):\n    b.copy_(beta * b + g)\n    p.copy_(p - lr * b)\n"
    parsed = statements.parse_function(source, ["p", "g", "b", "lr", "beta"], ["lr", "beta"])
    same = parse_program("b = beta*b + g; p = p - lr*b", inputs="p,g,b", scalars="lr,beta")
    assert parsed.text == "b = beta * b + g; p = p - lr * b"
    assert (parsed.inputs, parsed.scalars, parsed.updates, parsed.reads) == \
        (same.inputs, same.scalars, same.updates, same.reads)


def test_calling_updates_in_place_as_eager_does():
    ours, ref = tensors(), tensors()
    assert momentum_step(*ours, lr=0.1, beta=0.9) is None
    momentum_step.eager(*ref, lr=0.1, beta=0.9)
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert ours[1].equal(ref[1])  # g is read only


def test_it_is_the_step_op_with_foreach():
    step = momentum_step.step
    assert isinstance(step, FusedStep) and step.name == "t_fused_momentum"
    assert momentum_step.op is torch.ops.fusegen.t_fused_momentum is step.op
    assert momentum_step.updated == ("p", "b") and momentum_step.scalars == ("lr", "beta")
    assert "Tensor(a!) p, Tensor g, Tensor(b!) b" in str(momentum_step.op.default._schema)
    lists = [tensors(n, seed=n) for n in (5, 70)]
    refs = [[t.clone() for t in ts] for ts in lists]
    momentum_step.foreach(*[list(ts) for ts in zip(*lists)], lr=0.05, beta=0.5)
    for ts, rs in zip(lists, refs):
        momentum_step.eager(*rs, lr=0.05, beta=0.5)
        for got, want in zip(ts, rs):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_defaults_locals_and_return_none():
    p, g, _ = tensors()
    ref = p.clone()
    decay_step(p, g, 0.1)  # wd's default
    decay_step.eager(ref, g, 0.1)
    torch.testing.assert_close(p, ref, rtol=1e-12, atol=1e-14)
    assert decay_step.scalars == ("lr", "wd")


def test_fuse_of_the_same_program_and_name_is_the_same_step():
    momentum_step.step
    again = fusegen.fuse("b = beta * b + g; p = p - lr * b", name="t_fused_momentum", inputs="p,g,b",
                         scalars="lr,beta")
    assert again is momentum_step.step


def test_under_torch_compile():
    def train(p, g, b, lr):
        momentum_step(p, g, b, lr, 0.9)
        return p.sum()

    compiled = torch.compile(train, backend="aot_eager", fullgraph=True)
    ours, ref = [t.float() for t in tensors()], [t.float() for t in tensors()]
    for k in range(2):
        compiled(*ours, torch.tensor(0.1 / (k + 1)))
        momentum_step.eager(*ref, lr=0.1 / (k + 1), beta=0.9)
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _define(tmp_path, body: str, params="p, g, lr"):
    """A @fused function of `body`, from a module file of its own (inspect.getsource reads it)."""
    import importlib.util

    path = tmp_path / "step_module.py"
    path.write_text("import fusegen\nimport torch\n\n\n@fusegen.fused(scalars=('lr',))\n"
                    f"def f({params}):\n" + "".join(f"    {line}\n" for line in body.split("\n")))
    spec = importlib.util.spec_from_file_location("step_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.f


@pytest.mark.parametrize("body, message", [
    ("t = p * 2\nt.copy_(g)", "copy_ on a local name ('t'), not a parameter of 'f'"),
    ("g.mul(2).copy_(p)", "copy_ on an expression"),
    ("p.copy_(g, non_blocking=True)", "p.copy_ takes one argument here, got 1 positional and 1 keyword"),
    ("p.copy_(g, p)", "takes one argument here, got 2 positional"),
    ("p.copy_(p - lr * g)\nreturn p", "updates parameters in place (copy_) and also returns a value"),
    ("lr.copy_(p)", "copy_ on scalar parameter 'lr'"),
    ("p = p - lr * g\np.copy_(p)", "assignment to parameter 'p' rebinds the name"),
    ("p.copy_(g.copy_(p) * lr)", "copy_ inside an expression"),
    ("p.copy_(p - lr * h)", "'h', which is not among inputs"),
    ("p += g\np.copy_(p * lr)", "unsupported statement in @fused function 'f': AugAssign"),
])
def test_refusals_are_clear(tmp_path, body, message):
    with pytest.raises((ParseError, SpecError)) as err:
        _define(tmp_path, body)
    assert message in str(err.value)


def test_refusals_of_the_decorator():
    with pytest.raises(SpecError, match="scalars=.*names 'rate', which is not a parameter"):
        fusegen.fused(scalars=("rate",))(decay_step.eager)
    with pytest.raises(SpecError, match="a step op has one mode under torch.compile"):
        fusegen.fused(compile="decompose")(momentum_step.eager)
    with pytest.raises(SpecError, match="must not end in '_foreach'"):
        fusegen.fused(name="t_fused_foreach", scalars=("lr", "beta"))(momentum_step.eager)

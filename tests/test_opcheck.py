"""The registered ops behave as ordinary PyTorch ops: opcheck (schema, fake/Meta impl,
autograd registration, AOT dispatch), gradcheck in float64, and torch.compile."""

from __future__ import annotations

import pytest
import torch

from corpus import CORPUS, BY_NAME


def _sample(case, dtype, n=9, seed=0):
    tensors = [t.requires_grad_(True) for t in case.sample(n, dtype, seed=seed)]
    return tuple(tensors) + tuple(case.scalar_values)


@pytest.mark.parametrize("case", CORPUS, ids=repr)
def test_opcheck(corpus_ops, case):
    op = corpus_ops[case.name].op
    dtype = torch.float32 if case.category in ("seed", "scalar") else torch.float64
    result = torch.library.opcheck(op, _sample(case, dtype))
    assert result and all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("case", CORPUS, ids=repr)
def test_opcheck_without_grad(corpus_ops, case):
    """The same checks with no input requiring grad (the path below autograd)."""
    op = corpus_ops[case.name].op
    args = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in _sample(case, torch.float64))
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("case", CORPUS, ids=repr)
def test_gradcheck(corpus_ops, case):
    op = corpus_ops[case.name]
    args = _sample(case, torch.float64, n=7, seed=11)
    assert torch.autograd.gradcheck(op, args, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_backward_op_is_registered(corpus_ops):
    fma = corpus_ops["cp_fma"]
    assert fma.op is torch.ops.fusegen.cp_fma
    assert fma.backward_op is torch.ops.fusegen.cp_fma_backward
    assert corpus_ops["cp_add"].backward_op is None  # both gradients pass grad through
    a, b, c = (torch.randn(6, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(6, dtype=torch.float64)
    ga, gb = torch.ops.fusegen.cp_fma_backward(grad, a, b, [True, True])
    torch.testing.assert_close(ga, grad * b)
    torch.testing.assert_close(gb, grad * a)
    (gb_only,) = torch.ops.fusegen.cp_fma_backward(grad, a, b, [False, True])
    torch.testing.assert_close(gb_only, grad * a)


def test_meta_shapes_and_dtype(corpus_ops):
    a = torch.empty(3, 1, 5, device="meta", dtype=torch.float32)
    b = torch.empty(4, 1, device="meta", dtype=torch.float64)
    c = torch.empty(5, device="meta", dtype=torch.float32)
    out = corpus_ops["cp_fma"].op(a, b, c)
    assert out.device.type == "meta" and out.shape == (3, 4, 5) and out.dtype == torch.float64


@pytest.mark.parametrize("name", ["cp_fma", "cp_silu", "cp_swish_beta", "cp_bias_gelu"])
def test_torch_compile_fullgraph(corpus_ops, name):
    case, op = BY_NAME[name], corpus_ops[name]
    torch._dynamo.reset()

    def f(*args):
        return op.op(*args) * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    tensors = case.sample(129, torch.float32, seed=5)
    scalars = list(case.scalar_values)
    leaves_c = [t.clone().requires_grad_(True) for t in tensors]
    leaves_e = [t.clone().requires_grad_(True) for t in tensors]
    out_c = compiled(*leaves_c, *scalars)
    out_e = case.eager(*leaves_e, *scalars) * 2.0
    torch.testing.assert_close(out_c, out_e, rtol=2e-5, atol=2e-5)
    grad = torch.randn_like(out_e)
    gc = torch.autograd.grad(out_c, leaves_c, grad)
    ge = torch.autograd.grad(out_e, leaves_e, grad)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_torch_compile_inductor_forward_backward(corpus_ops):
    """The default backend too (inductor on CPU), once: it traces through the Meta impls
    and calls the op as an extern kernel."""
    op = corpus_ops["cp_fma"]
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: op.op(a, b, c).sin(), fullgraph=True)
    a, b, c = (torch.randn(64, requires_grad=True) for _ in range(3))
    out = compiled(a, b, c)
    torch.testing.assert_close(out, (a * b + c).sin())
    out.sum().backward()
    torch.testing.assert_close(a.grad, b.detach() * (a * b + c).detach().cos())
    torch.testing.assert_close(c.grad, (a * b + c).detach().cos())


def test_torch_compile_fullgraph_of_a_fusedop_call(corpus_ops):
    """A FusedOp call (the Python autograd.Function path outside torch.compile) compiles
    with fullgraph=True: under dynamo it is the op itself."""
    op = corpus_ops["cp_swish_beta"]
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: op(x, y, beta=1.5, alpha=0.25).sin(), fullgraph=True, backend="aot_eager")
    x, y = (torch.randn(65, requires_grad=True) for _ in range(2))
    out = compiled(x, y)
    want = BY_NAME["cp_swish_beta"].eager(x, y, 1.5, 0.25).sin()
    torch.testing.assert_close(out, want)
    for got, w in zip(torch.autograd.grad(out.sum(), (x, y)), torch.autograd.grad(want.sum(), (x, y))):
        torch.testing.assert_close(got, w)


def _args_from_schema(op):
    g = torch.Generator().manual_seed(7)
    args = []
    for a in op._schema.arguments:
        kind = str(a.type)
        if kind == "Tensor":
            args.append(torch.randn(5, generator=g, dtype=torch.float64).requires_grad_())
        elif kind == "float":
            args.append(0.7)
        else:  # bool[K] output_mask: everything
            args.append([True] * a.N)
    return tuple(args)


@pytest.mark.parametrize("name", ["cp_silu_backward", "cp_silu_grad2_backward", "cp_silu_jvp",
                                  "cp_swish_beta_grad2_backward", "cp_swish_beta_jvp_backward",
                                  "cp_bias_gelu_grad2"])
def test_opcheck_auxiliary_ops(corpus_ops, name):
    """The auxiliary ops are ordinary ops too (schema, fake impl, autograd registration,
    AOT dispatch), the composite autograd kernel of <name>_grad2_backward included."""
    corpus_ops[max((n for n in corpus_ops if name.startswith(n + "_")), key=len)].load_auxiliary()  # built on first use
    op = getattr(torch.ops.fusegen, name).default
    result = torch.library.opcheck(op, _args_from_schema(op))
    assert all(v == "SUCCESS" for v in result.values()), result

"""Higher-order gradients and torch.func: second derivatives fused (gradgradcheck
over the whole corpus, with no composite fallback), third order right, kinks as eager,
forward-mode AD and torch.func's transforms matching eager, vmap with no fallback warning,
and a gradient-penalty training step that matches eager step for step."""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from corpus import BY_NAME, CORPUS, SEEDS
from helpers import FusegenCalls


def _args(case, n=6, seed=3, dtype=torch.float64, grad=True):
    tensors = [t.requires_grad_(grad) for t in case.sample(n, dtype, seed=seed)]
    return tensors, list(case.scalar_values)


@pytest.fixture
def no_composite(caplog):
    """Fails the test if any derivative ran as the eager composite (it must be fused)."""
    caplog.set_level(logging.INFO, logger="fusegen")
    yield
    fallbacks = [r.getMessage() for r in caplog.records if "is not fused" in r.getMessage()]
    assert not fallbacks, fallbacks


@pytest.mark.parametrize("case", CORPUS, ids=repr)
def test_gradgradcheck(corpus_ops, case, no_composite):
    op = corpus_ops[case.name]
    tensors, scalars = _args(case)
    fn = lambda *t: op(*t, *scalars)  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, tuple(tensors), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", CORPUS, ids=repr)
def test_second_derivatives_match_eager(corpus_ops, case, no_composite):
    """d/d(dout) and d/dx of the backward, with random incoming gradients, against eager."""
    op = corpus_ops[case.name]
    results = []
    for f in (op, case.eager):
        tensors, scalars = _args(case, n=9, seed=5)
        out = f(*tensors, *scalars)
        dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1)).requires_grad_()
        grads = torch.autograd.grad(out, tensors, dout, create_graph=True)
        g = torch.Generator().manual_seed(2)
        total = sum((gr * torch.randn(gr.shape, dtype=gr.dtype, generator=g)).sum()
                    for gr in grads if gr.requires_grad)
        if not isinstance(total, torch.Tensor):
            results.append(None)
            continue
        results.append(torch.autograd.grad(total, tensors + [dout], allow_unused=True, materialize_grads=True))
    if results[0] is None or results[1] is None:
        assert results[0] is results[1] or all(float(r.abs().max()) == 0 for r in results[0] or results[1])
        return
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


def _third(f, x, scalars=()):
    g, = torch.autograd.grad(f(x, *scalars).sum(), x, create_graph=True)
    gg, = torch.autograd.grad(g.sum(), x, create_graph=True)
    ggg, = torch.autograd.grad(gg.sum(), x)
    return g, gg, ggg


@pytest.mark.parametrize("name", ["cp_silu", "cp_gelu_tanh", "cp_exp_sin", "cp_swish_beta_x"])
def test_third_order_matches_eager(third_order_ops, name):
    op, eager, scalars = third_order_ops[name]
    x = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    for got, want in zip(_third(op, x, scalars), _third(eager, x, scalars)):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    # Orders three and four against finite differences of the fused second derivative.
    second = lambda t: torch.autograd.grad(  # noqa: E731
        torch.autograd.grad(op(t, *scalars).sum(), t, create_graph=True)[0].sum(), t, create_graph=True)[0]
    assert torch.autograd.gradgradcheck(second, (x,), eps=1e-6, atol=1e-4)


@pytest.fixture(scope="module")
def extra_ops():
    """Two more ops, one library: a third-order case and user names spelled like the
    auxiliary ops' own inputs (dout, gg_<x>, t_<x>)."""
    from fusegen.api import Request, fuse_many
    exp_sin, weird = fuse_many([Request("exp(x)*sin(x)", name="cp_exp_sin"),
                                Request("dout*sin(gg_dout)*t_dout + grad*x", name="cp_aux_names")])
    return {"cp_exp_sin": exp_sin, "cp_aux_names": weird}


def test_user_names_spelled_like_auxiliary_inputs(extra_ops):
    op = extra_ops["cp_aux_names"]
    grad2 = torch.ops.fusegen.cp_aux_names_grad2.default._schema
    assert [a.name for a in grad2.arguments][:2] == ["dout_", "dout"]
    tensors = tuple(torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in op.spec.inputs)
    assert torch.autograd.gradgradcheck(op, tensors)
    assert torch.autograd.gradgradcheck(op.op, tensors)
    tangents = tuple(torch.randn(3, dtype=torch.float64) for _ in tensors)
    primals = tuple(t.detach() for t in tensors)
    eager = lambda d, g, t, gr, x: d * torch.sin(g) * t + gr * x  # noqa: E731
    torch.testing.assert_close(torch.func.jvp(op, primals, tangents), torch.func.jvp(eager, primals, tangents))


@pytest.fixture(scope="module")
def third_order_ops(corpus_ops, extra_ops):
    exp_sin = extra_ops["cp_exp_sin"]
    beta = 1.702
    return {
        "cp_silu": (corpus_ops["cp_silu"], BY_NAME["cp_silu"].eager, ()),
        "cp_gelu_tanh": (corpus_ops["cp_gelu_tanh"], BY_NAME["cp_gelu_tanh"].eager, ()),
        "cp_exp_sin": (exp_sin, lambda x: torch.exp(x) * torch.sin(x), ()),
        "cp_swish_beta_x": (lambda x: corpus_ops["cp_swish_beta"](x, torch.zeros_like(x), beta, 0.0),
                            lambda x: x * torch.sigmoid(beta * x), ()),
    }


def test_kinks_second_order_as_eager(corpus_ops):
    """relu'' = abs'' = 0 everywhere, clamp's and maximum's second derivatives at their
    bounds and ties: what eager's double backward gives."""
    x = torch.tensor([-1.0, 0.0, 0.0, 0.5, 2.0], dtype=torch.float64)
    y = torch.tensor([0.3, 0.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    for name in ("cp_relu_mul", "cp_abs_sign", "cp_max_min", "cp_clamp", "cp_where"):
        case, op = BY_NAME[name], corpus_ops[name]
        results = []
        for f in (op, case.eager):
            a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
            ga, gb = torch.autograd.grad(f(a, b).sum(), (a, b), create_graph=True)
            total = sum(g.sum() * w for g, w in ((ga, 1.0), (gb, 0.5)) if g.requires_grad)
            results.append(torch.autograd.grad(total, (a, b), allow_unused=True, materialize_grads=True)
                           if isinstance(total, torch.Tensor) else (torch.zeros_like(x), torch.zeros_like(y)))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, msg=name)


# -- torch.func and forward mode -----------------------------------------------------------------

@contextlib.contextmanager
def _no_vmap_fallback():
    """vmap's per-sample fallback warns ("There is a performance drop because we have not
    yet implemented the batching rule for fusegen::..."): an error here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        warnings.filterwarnings("error", message=".*batching rule.*")
        yield


FUNC_CASES = [c for c in CORPUS if c.name in ("cp_fma", "cp_silu", "cp_gelu_tanh", "cp_swish_beta", "cp_bias_gelu",
                                               "cp_relu_mul", "cp_pow", "cp_where", "cp_trig", "cp_clamp_tensor")]


def _scalar_fn(f, case):
    scalars = list(case.scalar_values)
    return lambda *t: f(*t, *scalars).sum()


@pytest.mark.parametrize("case", FUNC_CASES, ids=repr)
def test_torch_func_matches_eager(corpus_ops, case):
    op = corpus_ops[case.name]
    tensors, scalars = _args(case, n=5, grad=False)
    argnums = tuple(range(len(tensors)))
    with _no_vmap_fallback():
        for transform in (torch.func.grad, torch.func.jacrev, torch.func.jacfwd, torch.func.hessian):
            got = transform(_scalar_fn(op, case), argnums=argnums)(*tensors)
            want = transform(_scalar_fn(case.eager, case), argnums=argnums)(*tensors)
            torch.testing.assert_close(got, want, msg=f"{transform.__name__}")
        tangents = [torch.randn_like(t) for t in tensors]
        got = torch.func.jvp(lambda *t: op(*t, *scalars), tuple(tensors), tuple(tangents))
        want = torch.func.jvp(lambda *t: case.eager(*t, *scalars), tuple(tensors), tuple(tangents))
        torch.testing.assert_close(got, want)
        batched = [torch.stack([t, 2 * t, t + 1]) for t in tensors]
        got = torch.func.vmap(lambda *t: op(*t, *scalars))(*batched)
        want = torch.func.vmap(lambda *t: case.eager(*t, *scalars))(*batched)
        torch.testing.assert_close(got, want)
        per_sample = torch.func.vmap(torch.func.grad(_scalar_fn(op, case), argnums=argnums))(*batched)
        want = torch.func.vmap(torch.func.grad(_scalar_fn(case.eager, case), argnums=argnums))(*batched)
        torch.testing.assert_close(per_sample, want)


@pytest.mark.parametrize("case", [BY_NAME[n] for n in ("cp_silu", "cp_swish_beta", "cp_bias_gelu")], ids=repr)
def test_reverse_over_reverse_under_torch_func_is_fused(corpus_ops, case, no_composite):
    """jacrev(jacrev) through the autograd.Function path: <name>_grad2_backward, no composite."""
    op = corpus_ops[case.name]
    tensors, scalars = _args(case, n=4, grad=False)
    argnums = tuple(range(len(tensors)))
    second = [torch.func.jacrev(torch.func.jacrev(_scalar_fn(f, case), argnums=argnums), argnums=argnums)(*tensors)
              for f in (op, case.eager)]
    torch.testing.assert_close(second[0], second[1])


@pytest.mark.parametrize("case", FUNC_CASES, ids=repr)
def test_forward_ad_dual_numbers(corpus_ops, case, no_composite):
    """torch.autograd.forward_ad: the fused <name>_jvp kernel, tangents on some inputs only."""
    op = corpus_ops[case.name]
    tensors, scalars = _args(case, n=7, grad=False)
    g = torch.Generator().manual_seed(9)
    tangents = [torch.randn(t.shape, dtype=t.dtype, generator=g) if i % 2 == 0 else None
                for i, t in enumerate(tensors)]
    results = []
    for f in (op, case.eager):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(t, d) if d is not None else t for t, d in zip(tensors, tangents)]
            primal, tangent = fwAD.unpack_dual(f(*duals, *scalars))
            results.append((primal, tangent))
    torch.testing.assert_close(results[0], results[1])


def test_torch_ops_keeps_a_tangent_beside_the_graph(corpus_ops):
    """torch.ops.fusegen.<name> with an input that has a tangent and requires grad: the
    output has the tangent (fused <name>_jvp) and the op's node, as the FusedOp's has."""
    op = corpus_ops["cp_fma"]
    a, b, c = (torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with fwAD.dual_level():
        dual = fwAD.make_dual(a, torch.ones(4, dtype=torch.float64))
        for f in (op.op, op):
            out = f(dual, b, c)
            torch.testing.assert_close(fwAD.unpack_dual(out).tangent, b.detach())
            assert out.requires_grad


def test_forward_mode_uses_the_jvp_kernel(corpus_ops, monkeypatch):
    """jvp calls fusegen::<name>_jvp, one op, not a loop of ops."""
    from fusegen.pytorch import autograd
    calls = []
    real = autograd.call
    monkeypatch.setattr(autograd, "call", lambda name, *a: calls.append(name) or real(name, *a))
    x = torch.randn(4, dtype=torch.float64)
    torch.func.jvp(corpus_ops["cp_silu"], (x,), (torch.ones_like(x),))
    assert calls == ["cp_silu", "cp_silu_jvp"]


def test_vmap_of_every_op_directly_has_a_batching_rule(corpus_ops):
    """torch.ops.fusegen.<name>, <name>_backward and the auxiliary ops batch without the
    per-sample fallback (which warns), batch dims anywhere, broadcasting included."""
    a = torch.randn(5, 3, 4, dtype=torch.float64)    # batch dim 1
    b = torch.randn(4, dtype=torch.float64)          # unbatched, broadcast
    c = torch.randn(1, 4, 3, dtype=torch.float64)    # batch dim 2
    with _no_vmap_fallback():
        got = torch.func.vmap(torch.ops.fusegen.cp_fma, in_dims=(1, None, 2))(a, b, c)
        want = torch.stack([a[:, i] * b + c[:, :, i] for i in range(3)])
        torch.testing.assert_close(got, want)
        dout = torch.randn(3, 5, 4, dtype=torch.float64)
        got = torch.func.vmap(lambda d, x, y: torch.ops.fusegen.cp_fma_backward(d, x, y, [True, True]),
                              in_dims=(0, 1, None))(dout, a, b)
        torch.testing.assert_close(got[0], dout * b)
        torch.testing.assert_close(got[1], dout * a.movedim(1, 0))


def test_aux_op_names_are_reserved():
    from fusegen.errors import SpecError
    import fusegen
    for suffix in ("_backward", "_grad2", "_jvp"):
        with pytest.raises(SpecError, match=f"must not end in '{suffix}'"):
            fusegen.fuse("x*2", name="mine" + suffix)


def test_double_backward_is_fused_one_op(corpus_ops):
    """Double backward of <name>_backward runs <name>_grad2_backward once: no composite."""
    a, b, c = (torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with FusegenCalls() as ops:
        ga, gb, gc = torch.autograd.grad(corpus_ops["cp_fma"](a, b, c).sum(), (a, b, c), create_graph=True)
        torch.autograd.grad((ga * gb).sum(), (a, b))
    assert ops.names == ["cp_fma", "cp_fma_backward", "cp_fma_grad2_backward"]


# -- a real use: gradient penalty -----------------------------------------------------------------

def gradient_penalty_run(silu, gelu, device="cpu", steps=4, dtype=torch.float64):
    """The benchmark's gradient-penalty step (fusegen/bench/core.py), a few times: the
    parameters after each step."""
    from fusegen.bench.core import GradientPenaltyMLP
    model = GradientPenaltyMLP(silu, gelu, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    history = []
    for _ in range(steps):
        model.step(torch.randn(32, 8, generator=g, dtype=dtype).to(device))
        history.append([p.detach().clone() for p in model.params])
    return history


def test_gradient_penalty_step_matches_eager(corpus_ops, no_composite):
    fused = gradient_penalty_run(corpus_ops["cp_silu"], corpus_ops["cp_gelu_tanh"])
    eager = gradient_penalty_run(BY_NAME["cp_silu"].eager, BY_NAME["cp_gelu_tanh"].eager)
    for step, (got, want) in enumerate(zip(fused, eager)):
        for p, q in zip(got, want):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=f"step {step}")


def test_seeds_cover_double_backward(corpus_ops):
    """Every seed with a backward kernel has its fused second derivative registered (once
    its auxiliary ops are loaded: they are built on first use)."""
    for case in SEEDS:
        op = corpus_ops[case.name].load_auxiliary()
        if op.spec.kernel_gradients:
            assert hasattr(torch.ops.fusegen, f"{case.name}_grad2_backward")
        assert hasattr(torch.ops.fusegen, f"{case.name}_jvp")


@pytest.mark.slow
def test_third_order_from_a_warm_cache(tmp_path):
    """<name>_grad2, built on first use into the op's library, is in that library when a later
    process loads it from the cache, and the runtime then never asks for it: the third
    derivative (its composite kernel) must work there as in the first process."""
    import os
    import pathlib
    import subprocess
    import sys
    env = {**os.environ, "FUSEGEN_CACHE_DIR": str(tmp_path / "cache")}
    here = pathlib.Path(__file__).resolve()
    for run in ("first", "later"):
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here),
                            "-k", "test_third_order_matches_eager"], cwd=here.parent.parent, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{run} process:\n{r.stdout[-3000:]}"

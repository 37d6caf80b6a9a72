"""Forward-mode AD and torch.func on every way of calling an op: the FusedOp, a @fused
function and `torch.ops.fusegen.<name>` itself, under torch.autograd.forward_ad,
torch.func.jvp, jacfwd and hessian (and grad, vjp, jacrev on the registered op), against
eager PyTorch in float64: one input, several inputs with runtime scalars, a broadcast input,
an input whose gradient is zero. A standalone library (a packaged wheel) is checked in
tests/test_package.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fusegen
from corpus import BY_NAME
from helpers import FusegenCalls

CASES = [BY_NAME[n] for n in ("cp_silu", "cp_swish_beta", "cp_bias_gelu", "cp_fma", "cp_abs_sign", "cp_where")]


@fusegen.fused
def _swish_beta(x, y, beta: float = 1.702, alpha: float = -0.75):
    return x * torch.sigmoid(beta * x) + alpha * y


# The @fused function computes the same as cp_swish_beta (its eager reference).
_DECORATED = {"cp_swish_beta": _swish_beta}


def _callers(corpus_ops, case):
    """path -> a function of the case's tensors and scalars."""
    op = corpus_ops[case.name]
    paths = {"FusedOp": op, "torch.ops": getattr(torch.ops.fusegen, case.name)}
    if case.name in _DECORATED:
        paths["@fused"] = _DECORATED[case.name]
    return paths


def _tensors(case, seed=3):
    return tuple(case.sample(5, torch.float64, seed=seed))


def _tangents(tensors, seed=7):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t.shape, dtype=t.dtype, generator=g) for t in tensors)


def _unpack(dual):
    """(primal, tangent), a missing tangent as the zeros it stands for (eager leaves the
    tangent of a constant gradient undefined, fused kernels compute its zeros)."""
    primal, tangent = fwAD.unpack_dual(dual)
    return primal, torch.zeros_like(primal) if tangent is None else tangent


def _modes(case):
    """mode -> (f, tensors) -> what it computes (tangents and derivatives of f)."""
    scalars = list(case.scalar_values)
    argnums = tuple(range(len(case.domains)))

    def bound(f):
        return lambda *t: f(*t, *scalars)

    def total(f):
        return lambda *t: f(*t, *scalars).sum()

    def forward_ad(f, tensors):
        tangents = _tangents(tensors)
        with fwAD.dual_level():
            # a tangent on every other input only; the others are plain tensors
            duals = [fwAD.make_dual(t, d) if i % 2 == 0 else t for i, (t, d) in enumerate(zip(tensors, tangents))]
            return _unpack(f(*duals, *scalars))

    def forward_over_reverse(f, tensors):
        # the tangent of a gradient (create_graph), as a gradient-penalty's jvp would be
        leaves = [t.clone().requires_grad_() for t in tensors]
        with fwAD.dual_level():
            duals = [fwAD.make_dual(t, d) for t, d in zip(leaves, _tangents(tensors))]
            grads = torch.autograd.grad(f(*duals, *scalars).sum(), duals, create_graph=True)
            return [_unpack(g)[1] for g in grads]

    def reverse_over_forward(f, tensors):
        leaves = [t.clone().requires_grad_() for t in tensors]
        with fwAD.dual_level():
            duals = [fwAD.make_dual(t, d) for t, d in zip(leaves, _tangents(tensors))]
            tangent = _unpack(f(*duals, *scalars))[1]
        return torch.autograd.grad(tangent.sum(), leaves, allow_unused=True, materialize_grads=True)

    return {
        "forward_ad": forward_ad,
        "forward_over_reverse": forward_over_reverse,
        "reverse_over_forward": reverse_over_forward,
        "jvp": lambda f, t: torch.func.jvp(bound(f), t, _tangents(t)),
        "jacfwd": lambda f, t: torch.func.jacfwd(bound(f), argnums=argnums)(*t),
        "hessian": lambda f, t: torch.func.hessian(total(f), argnums=argnums)(*t),
        "grad": lambda f, t: torch.func.grad(total(f), argnums=argnums)(*t),
        "vjp": lambda f, t: torch.func.vjp(bound(f), *t)[1](_tangents([torch.broadcast_tensors(*t)[0]])[0]),
        "jacrev": lambda f, t: torch.func.jacrev(bound(f), argnums=argnums)(*t),
        "jacrev_jacrev": lambda f, t: torch.func.jacrev(torch.func.jacrev(total(f), argnums=argnums),
                                                        argnums=argnums)(*t),
        "jacfwd_jacfwd": lambda f, t: torch.func.jacfwd(torch.func.jacfwd(total(f), argnums=argnums),
                                                        argnums=argnums)(*t),
        "jacrev_jacfwd": lambda f, t: torch.func.jacrev(torch.func.jacfwd(total(f), argnums=argnums),
                                                        argnums=argnums)(*t),
        "vmap_jvp": lambda f, t: torch.func.vmap(lambda *b: torch.func.jvp(bound(f), b, b))(
            *[torch.stack([x, 2 * x]) for x in t]),
    }


MODES = list(_modes(CASES[0]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_every_path_matches_eager(corpus_ops, case, mode):
    tensors = _tensors(case)
    compute = _modes(case)[mode]
    want = compute(case.eager, tensors)
    for path, f in _callers(corpus_ops, case).items():
        torch.testing.assert_close(compute(f, tensors), want, msg=lambda m: f"{path}, {mode}: {m}")


@pytest.mark.parametrize("transform", ["forward_ad", "jvp", "jacfwd"])
def test_registered_op_uses_the_fused_jvp_kernel(corpus_ops, transform, caplog):
    """First-order forward mode of torch.ops.fusegen.<name>: one call of <name>_jvp beside
    the op, no composite."""
    caplog.set_level(logging.INFO, logger="fusegen")
    op = torch.ops.fusegen.cp_swish_beta
    x, y = _tensors(BY_NAME["cp_swish_beta"])
    with FusegenCalls() as mode:
        if transform == "forward_ad":
            with fwAD.dual_level():
                fwAD.unpack_dual(op(fwAD.make_dual(x, torch.ones_like(x)), y, 1.5, 0.5))
        elif transform == "jvp":
            torch.func.jvp(lambda x: op(x, y, 1.5, 0.5), (x,), (torch.ones_like(x),))
        else:
            torch.func.jacfwd(lambda x: op(x, y, 1.5, 0.5))(x)
    assert mode.names == ["cp_swish_beta", "cp_swish_beta_jvp"]
    assert not [r for r in caplog.records if "is not fused" in r.getMessage()]


def test_registered_op_with_tangent_and_graph(corpus_ops):
    """An input that requires grad and has a tangent: the output has both, the graph's node
    is the fused one, and the tangent is differentiable (reverse over forward)."""
    a, b, c = (torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    t = torch.randn(4, dtype=torch.float64)
    with fwAD.dual_level():
        out = torch.ops.fusegen.cp_fma(fwAD.make_dual(a, t), b, c)
        primal, tangent = fwAD.unpack_dual(out)
    assert out.grad_fn.name() == "FusedBackward(fusegen::cp_fma)"
    torch.testing.assert_close(primal, a * b + c)
    torch.testing.assert_close(tangent, t * b)
    torch.testing.assert_close(torch.autograd.grad(tangent.sum(), b)[0], t)


def test_tangent_of_a_broadcast_input_only(corpus_ops):
    """A tangent on the broadcast bias only: the jvp kernel's result is expanded to the
    output's shape (the primals it reads broadcast to less)."""
    case = BY_NAME["cp_bias_gelu"]
    x, b, s = _tensors(case)
    tb = torch.randn_like(b)
    got = torch.func.jvp(lambda b: torch.ops.fusegen.cp_bias_gelu(x, b, s), (b,), (tb,))
    want = torch.func.jvp(lambda b: case.eager(x, b, s), (b,), (tb,))
    assert got[1].shape == want[1].shape == torch.broadcast_shapes(x.shape, b.shape, s.shape)
    torch.testing.assert_close(got, want)


def test_zero_gradient_gives_a_zero_tangent(corpus_ops):
    """sign(y) has gradient 0: a tangent on y alone moves nothing (eager's zeros)."""
    case = BY_NAME["cp_abs_sign"]
    x, y = _tensors(case)
    got = torch.func.jvp(lambda y: torch.ops.fusegen.cp_abs_sign(x, y), (y,), (torch.ones_like(y),))
    want = torch.func.jvp(lambda y: case.eager(x, y), (y,), (torch.ones_like(y),))
    torch.testing.assert_close(got, want)
    assert float(got[1].abs().max()) == 0


def test_double_backward_node_is_fused(corpus_ops):
    """create_graph records FusedDoubleBackward, whose backward is <name>_grad2_backward."""
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(torch.ops.fusegen.cp_silu(x).sum(), x, create_graph=True)
    assert g.grad_fn.name() == "FusedDoubleBackward(fusegen::cp_silu_backward)"
    with FusegenCalls() as mode:
        (h,) = torch.autograd.grad(g.sum(), x)
    assert mode.names == ["cp_silu_grad2_backward"]
    want = torch.func.hessian(lambda x: BY_NAME["cp_silu"].eager(x).sum())(x.detach()).sum(0)
    torch.testing.assert_close(h, want)


def test_forward_mode_of_a_derivative_runs_the_composite(corpus_ops, caplog):
    """hessian = jacfwd(jacrev) needs the forward mode of <name>_backward, which has no
    kernel: fusegen::__composite computes it, logged once."""
    from fusegen.pytorch import autograd
    autograd._info("cp_silu_backward")._derived.pop("logged its forward-mode derivative", None)  # once per process
    caplog.set_level(logging.INFO, logger="fusegen")
    x = _tensors(BY_NAME["cp_silu"])[0]
    torch.func.hessian(lambda x: torch.ops.fusegen.cp_silu(x).sum())(x)
    messages = [r.getMessage() for r in caplog.records if "is not fused" in r.getMessage()]
    assert any("fusegen::cp_silu_backward: its forward-mode derivative" in m for m in messages), messages

"""Row reductions (sum, mean, amax, amin, logsumexp over the last dimension) on the CPU: the
values and gradients against eager PyTorch in float64, second order, forward mode, ties, rows
of length 1, odd lengths and no rows, broadcast weights, per-row inputs, strided rows, the
16-bit dtypes, the torch integrations, and the errors."""

from __future__ import annotations

import functools

import pytest
import sympy
import torch
import torch.nn.functional as F

import fusegen
from fusegen.errors import ParseError

D = torch.float64
EPS = 1e-5

RMS = "x * torch.rsqrt((x*x).mean(-1, keepdim=True) + eps) * w"
LAYER = ("(x - x.mean(-1, keepdim=True)) * torch.rsqrt(((x - x.mean(-1, keepdim=True))**2).mean(-1, keepdim=True)"
         " + eps) * w + b")
SOFTMAX = ("torch.exp(x - torch.amax(x, -1, keepdim=True)) / "
           "torch.exp(x - torch.amax(x, -1, keepdim=True)).sum(-1, keepdim=True)")
LOG_SOFTMAX = "x - torch.logsumexp(x, -1, keepdim=True)"
RESIDUAL_RMS = "h = x + r; (h, h * torch.rsqrt((h*h).mean(-1, keepdim=True) + eps) * w)"

# name -> (text, scalars, eager reference of the tensors in the op's input order)
OPS = {
    "rms_norm": (RMS, ["eps"], lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS)),
    "layer_norm": (LAYER, ["eps"], lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS)),
    "softmax": (SOFTMAX, [], lambda x: torch.softmax(x, -1)),
    "log_softmax": (LOG_SOFTMAX, [], lambda x: torch.log_softmax(x, -1)),
    "residual_rms": (RESIDUAL_RMS, ["eps"], lambda x, r, w: (x + r, F.rms_norm(x + r, x.shape[-1:], w, EPS))),
    "row_lse": ("torch.logsumexp(x, -1, keepdim=True)", [], lambda x: torch.logsumexp(x, -1, keepdim=True)),
    "row_extremes": ("torch.amax(x, -1, keepdim=True) * x - torch.amin(x*x, -1, keepdim=True)", [],
                     lambda x: torch.amax(x, -1, keepdim=True) * x - torch.amin(x * x, -1, keepdim=True)),
    "row_sum": ("(x * y).sum(-1, keepdim=True) * x", [], lambda x, y: (x * y).sum(-1, keepdim=True) * x),
}
# inputs of one value per column (a weight of shape (H,)); the others have the full shape
COLUMNS = {"w", "b"}


@functools.cache
def op(name):
    text, scalars, _ = OPS[name]
    return fusegen.fuse(text, name=f"rows_{name}", scalars=scalars)


def inputs(name, shape, dtype=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape[-1:] if x in COLUMNS else shape, generator=g, dtype=dtype).requires_grad_()
            for x in op(name).spec.inputs]


def call(name):
    o = op(name)
    kw = {s: EPS for s in o.spec.scalars}
    return lambda *xs: o(*xs, **kw)


def as_tuple(v):
    return v if isinstance(v, tuple) else (v,)


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("shape", [(3, 8), (2, 3, 5), (4, 1), (3, 33)])
def test_values_and_gradients_match_eager(name, shape):
    xs = inputs(name, shape)
    got = as_tuple(call(name)(*xs))
    want = as_tuple(OPS[name][2](*xs))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    douts = [torch.randn_like(w) for w in want]
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in
               zip(torch.autograd.grad(got, xs, douts), torch.autograd.grad(want, xs, douts)))


@pytest.mark.parametrize("name", sorted(OPS))
def test_gradcheck_and_gradgradcheck(name):
    xs = inputs(name, (3, 6))
    assert torch.autograd.gradcheck(call(name), xs)
    assert torch.autograd.gradgradcheck(call(name), xs)


@pytest.mark.parametrize("name", ["rms_norm", "softmax", "row_lse", "row_extremes"])
def test_forward_mode_matches_eager(name):
    xs = [x.detach() for x in inputs(name, (3, 7))]
    tangents = [torch.randn_like(x) for x in xs]
    got = torch.func.jvp(call(name), tuple(xs), tuple(tangents))[1]
    want = torch.func.jvp(OPS[name][2], tuple(xs), tuple(tangents))[1]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    first = lambda x: as_tuple(call(name)(x, *xs[1:]))[-1].sum()  # noqa: E731
    ref = lambda x: as_tuple(OPS[name][2](x, *xs[1:]))[-1].sum()  # noqa: E731
    torch.testing.assert_close(torch.func.hessian(first)(xs[0]), torch.func.hessian(ref)(xs[0]))


@pytest.mark.parametrize("reduction", ["amax", "amin"])
def test_ties_split_the_gradient_evenly_as_torch(reduction):
    o = fusegen.fuse(f"torch.{reduction}(x, -1, keepdim=True) * x", name=f"rows_tie_{reduction}")
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [-2.0, -2.0, -2.0, 5.0]], dtype=D, requires_grad=True)
    f = getattr(torch, reduction)
    got = torch.autograd.grad(o(x).sum(), x)[0]
    want = torch.autograd.grad((f(x, -1, keepdim=True) * x).sum(), x)[0]
    assert torch.equal(got, want)


def test_no_rows_and_empty_rows():
    x, w = inputs("rms_norm", (0, 6))
    y = call("rms_norm")(x, w)
    assert y.shape == (0, 6)
    gx, gw = torch.autograd.grad(y.sum(), (x, w), allow_unused=True)
    assert gx.shape == (0, 6) and (gw is None or torch.equal(gw, torch.zeros(6, dtype=D)))
    assert call("rms_norm")(torch.empty(3, 0, dtype=D), torch.empty(0, dtype=D)).shape == (3, 0)
    with pytest.raises(RuntimeError, match="last dimension has size 0"):
        call("row_lse")(torch.empty(3, 0, dtype=D))
    with pytest.raises(RuntimeError, match="every tensor argument is 0-d"):
        call("row_lse")(torch.tensor(1.0, dtype=D))


def test_per_row_inputs_strided_rows_and_broadcast_weights():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=g, dtype=D).t().requires_grad_()     # rows 5 apart, elements 1 apart: strided
    y = torch.randn(5, 1, generator=g, dtype=D).requires_grad_()         # one value per row
    got = call("row_sum")(x, y)
    want = OPS["row_sum"][2](x, y)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), (x, y)), torch.autograd.grad(want.sum(), (x, y)))
    w = torch.randn(6, generator=g, dtype=D).requires_grad_()
    base = torch.randn(2, 5, 12, generator=g, dtype=D)
    sliced = base[..., ::2].requires_grad_()                              # a row's every other element
    torch.testing.assert_close(call("rms_norm")(sliced, w), OPS["rms_norm"][2](sliced, w))


@pytest.mark.parametrize("name, forward, backward", [("rms_norm", 1, 1), ("layer_norm", 2, 2), ("softmax", 2, 2),
                                                   ("residual_rms", 1, 1)])
def test_factors_of_one_value_per_row_leave_the_sums_early(name, forward, backward):
    """A sum's factors of one value per row (rsqrt(mean + eps) ** 3 in RMSNorm's backward, a
    runtime scalar among them) are applied after the sum, so the sum joins an earlier pass:
    RMSNorm's backward reads its row once; the values are those of eager (above)."""
    spec = op(name).spec
    assert (spec.forward_rows.levels, spec.backward_rows.levels) == (forward, backward)


def test_a_shift_the_body_does_not_depend_on_gets_no_gradient():
    """The stable softmax's maximum receives a row sum that cancels (-(A/S - A/S)): the
    backward leaves it out, as written with .detach(): its sums and the gradient's values
    are the detached form's, and no tie is counted."""
    spec = op("softmax").spec
    detached = fusegen.fuse("torch.exp(x - torch.amax(x, -1, keepdim=True).detach()) / "
                            "torch.exp(x - torch.amax(x, -1, keepdim=True).detach()).sum(-1, keepdim=True)",
                            name="rows_softmax_detached").spec
    assert str(spec.backward_rows) == str(detached.backward_rows).replace("Detach(row0)", "row0")
    assert [a.kind for a in spec.backward_rows.accumulators] == ["max", "sum", "sum"]
    x = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, 0.5, 0.5, 0.5]], dtype=D, requires_grad=True)  # ties
    g = torch.randn(2, 4, dtype=D, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(call("softmax")(x), x, g)[0]
    want = torch.autograd.grad(torch.softmax(x, -1), x, g)[0]
    torch.testing.assert_close(got, want)
    # a maximum the body does depend on keeps its gradient, split among ties
    top = fusegen.fuse("x * torch.amax(x, -1, keepdim=True)", name="times_max").spec
    assert len(top.backward_rows.accumulators) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_narrow_dtypes_compute_in_float(dtype):
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    for name in ("rms_norm", "layer_norm", "softmax", "log_softmax"):
        xs = inputs(name, (4, 300), dtype)
        got = call(name)(*xs)
        assert got.dtype == dtype
        want = OPS[name][2](*[x.detach().double() for x in xs])
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 4)


def test_same_bits_every_run():
    xs = inputs("layer_norm", (64, 777), torch.float32)
    a = call("layer_norm")(*xs)
    b = call("layer_norm")(*xs)
    assert torch.equal(a, b)
    douts = torch.randn_like(a)
    assert all(torch.equal(p, q) for p, q in zip(torch.autograd.grad(a, xs, douts), torch.autograd.grad(b, xs, douts)))


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "log_softmax"])
def test_rows_split_over_threads_give_the_bits_of_one_thread(name):
    """Enough rows for the CPU loop to split them over threads (run_rows_cpu): values and
    gradients, a weight's summed per range of rows included, equal eager's in float64 and
    are the same bits on one thread as on several."""
    xs = inputs(name, (700, 301), D)
    douts = torch.randn(700, 301, dtype=D)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            out = call(name)(*xs)
            runs.append([out, *torch.autograd.grad(out, xs, douts)])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    want = OPS[name][2](*xs)
    for got, ref in zip(runs[0], [want, *torch.autograd.grad(want, xs, douts)]):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def _grads(name, xs, dout, **kw):
    """Each input's gradient, and the names of the ATen ops the backward ran."""
    y = call(name)(*xs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        grads = torch.autograd.grad(y, xs, dout, **kw)
    return grads, {e.name for e in prof.events()}


# the norms as their expressions spell them (F.rms_norm takes a weight of shape (H,) only)
EAGER = {"rms_norm": lambda x, w: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * w,
         "layer_norm": lambda x, w, b: F.layer_norm(x, x.shape[-1:], eps=EPS) * w + b}


def _reference(name, xs, dout):
    """Eager's gradients in float64."""
    ref = [x.detach().double().requires_grad_() for x in xs]
    return torch.autograd.grad(EAGER[name](*ref), ref, dout.double())


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("shape, column", [
    ((64, 33), (33,)),        # odd length
    ((2, 3, 5), (5,)),        # 3-d input, a weight of shape (H,)
    ((2, 3, 5), (1, 1, 5)),   # ... and of shape (1, 1, H)
    ((7, 6), (1, 6)),
    ((9, 1), (1,)),           # rows of one element
    ((0, 6), (6,)),           # no rows: the gradient is zeros
])
def test_weight_gradients_are_summed_in_the_row_kernel(name, shape, column):
    """A weight's gradient (an input of one value per column) is summed over the rows by the
    backward's own loop, not written at the (rows, H) shape for ATen's sum, and so is
    LayerNorm's bias's (dout itself, an input of that loop): the same values as eager in
    float64, of the inputs' shapes, and no aten::sum."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(column if x in COLUMNS else shape, generator=g, dtype=D).requires_grad_()
          for x in op(name).spec.inputs]
    dout = torch.randn(shape, generator=g, dtype=D)
    got, ran = _grads(name, xs, dout)
    for x, a, b in zip(xs, got, _reference(name, xs, dout)):
        assert a.shape == x.shape and a.dtype == x.dtype
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert "aten::sum" not in ran


BIASED = "x * torch.rsqrt((x*x).mean(-1, keepdim=True) + eps) * w - b + c / 4"


@pytest.mark.parametrize("needs", ["xwbc", "xb", "wb", "bc"])  # bc: no kernel runs, ATen sums
@pytest.mark.parametrize("c_shape", [(6, 10), (10,)])
def test_a_gradient_of_dout_alone_is_summed_in_the_row_kernel_that_runs(needs, c_shape):
    """A gradient of dout alone (`- b`: -dout; `c / 4`: dout / 4) of an input of one value
    per column is dout summed over the rows by the backward's loop, where that loop runs for
    another gradient, with the steps applied to the sum; one of the full shape is dout's
    steps as before, never the sum (two such inputs of different shapes each get theirs)."""
    o = fusegen.fuse(BIASED, name="rows_biased", scalars=["eps"])
    g = torch.Generator().manual_seed(8)
    shapes = {"x": (6, 10), "w": (10,), "b": (10,), "c": c_shape}
    xs = [torch.randn(shapes[n], generator=g, dtype=D).requires_grad_(n in needs) for n in o.spec.inputs]
    wanted = [x for x in xs if x.requires_grad]
    dout = torch.randn(6, 10, generator=g, dtype=D)
    y = o(*xs, eps=EPS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = torch.autograd.grad(y, wanted, dout)
    ref = [x.detach().requires_grad_(x.requires_grad) for x in xs]
    x, w, b, c = ref
    want = torch.autograd.grad(x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * w - b + c / 4,
                               [t for t in ref if t.requires_grad], dout)
    for a, e, t in zip(got, want, wanted):
        assert a.shape == t.shape
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)
    summed = sum(e.name == "aten::sum" for e in prof.events())
    assert summed == (0 if needs != "bc" else 1 + (c_shape == (10,)))


@pytest.mark.parametrize("column", [(13, 1), (13, 40)])
def test_inputs_not_one_value_per_column_keep_ATen_sum(column):
    """An input of one value per row is summed by ATen as before; one of the full shape has
    nothing to sum."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(13, 40, generator=g, dtype=D).requires_grad_()
    w = torch.randn(column, generator=g, dtype=D).requires_grad_()
    dout = torch.randn(13, 40, generator=g, dtype=D)
    got, ran = _grads("rms_norm", [x, w], dout)
    for a, b in zip(got, _reference("rms_norm", [x, w], dout)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert ("aten::sum" in ran) == (column == (13, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_summed_weight_gradients_in_narrow_dtypes_are_the_same_bits_every_run(dtype):
    """The summed gradient is added in float and rounded once to the weight's dtype; in a
    fixed order, so two runs give the same bits."""
    g = torch.Generator().manual_seed(5)
    for name in ("rms_norm", "layer_norm"):
        xs = [torch.randn(777 if x in COLUMNS else (300, 777), generator=g).to(dtype).requires_grad_()
              for x in op(name).spec.inputs]
        dout = torch.randn(300, 777, generator=g).to(dtype)
        first, _ = _grads(name, xs, dout)
        second, _ = _grads(name, xs, dout)
        assert all(torch.equal(a, b) for a, b in zip(first, second))
        for a, b in zip(first, _reference(name, xs, dout)):
            assert a.dtype == dtype
            scale = b.abs().max().item()
            tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
            torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * scale)


def test_the_residual_norm_backward_reads_the_sum_it_returns():
    o = op("residual_rms")
    assert o.spec.saved_output == "result" and o.spec.saved_index == 0
    assert o.spec.backward_inputs == ("result", "w")  # not x and r: their sum, output 0
    x, r, w = inputs("residual_rms", (5, 24))
    h, y = call("residual_rms")(x, r, w)
    h.add_(1)  # the saved sum changed: autograd refuses, as for eager's saved tensors
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    h, y = call("residual_rms")(x, r, w)
    y.add_(1)  # the other output is not saved
    (h.sum() + y.sum()).backward()
    # through the dispatcher (torch.func, torch.compile) too: <name>_backward takes the sum
    def loss(f):
        return lambda *tensors: sum((o * o).sum() for o in f(*tensors))

    xs = [t.detach() for t in (x, r, w)]
    want = torch.func.grad(loss(OPS["residual_rms"][2]), argnums=(0, 1, 2))(*xs)
    compiled = torch.compile(loss(call("residual_rms")), backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in xs]
    for got in (torch.func.grad(loss(call("residual_rms")), argnums=(0, 1, 2))(*xs),
                torch.autograd.grad(compiled(*leaves), leaves)):
        for g, expected in zip(got, want):
            torch.testing.assert_close(g, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name, saved, backward", [("softmax", 2, 1), ("layer_norm", 2, 1), ("log_softmax", 1, 1),
                                                 ("rms_norm", 0, 1), ("residual_rms", 0, 1)])
def test_the_forward_saves_the_row_values_that_spare_the_backward_a_pass(name, saved, backward):
    """The forward's row values the backward would compute again (softmax's maximum and sum,
    LayerNorm's mean and variance) are saved where that spares the backward a pass over the
    row; RMSNorm's backward makes one pass either way, and saves nothing."""
    spec = op(name).spec
    assert len(spec.saved_rows) == saved
    assert (spec.saved_backward_rows.levels if saved else spec.backward_rows.levels) == backward
    assert spec.forward_rows.per_row[len(spec.outputs):] == (True,) * saved


def _saved_by_the_node(fn, *args):
    """fn(*args) and its gradients by backward(), and the tensors its autograd node saved."""
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    out.backward(torch.ones_like(out))
    return [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad], packed


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_cross_entropy_backward_reads_the_saved_logsumexp(dtype):
    """The forward saves each row's logsumexp and its label's count, in the compute type
    (float for bf16: rounded to bf16 they would move the softmax by 3 %), and the backward
    reads them instead of its two passes: the same gradients as the backward that computes
    them again (create_graph takes that one), eager's within rounding."""
    ce = fusegen.fuse("torch.logsumexp(x, -1, keepdim=True) - x.gather(-1, label)", name="rows_ce",
                      inputs="x,label")
    assert len(ce.spec.saved_rows) == 2 and ce.spec.saved_backward_rows.levels == 0
    g = torch.Generator().manual_seed(5)
    x0 = (3 * torch.randn(9, 40, generator=g, dtype=D)).to(dtype)
    label = torch.randint(0, 40, (9, 1), generator=g)
    x = x0.clone().requires_grad_()
    (grad,), packed = _saved_by_the_node(ce, x, label)
    rows = [t for t in packed if t.shape == (9, 2)]
    assert len(rows) == 1 and rows[0].dtype == (D if dtype == D else torch.float32), [t.shape for t in packed]
    torch.testing.assert_close(rows[0][:, 1:].double(), torch.logsumexp(x0.double(), -1, keepdim=True),
                               rtol=1e-6, atol=1e-6)
    x2 = x0.clone().requires_grad_()
    (again,) = torch.autograd.grad(ce(x2, label), x2, torch.ones(9, 1, dtype=dtype), create_graph=True)
    assert torch.equal(grad, again.detach())
    want = torch.softmax(x0.double(), -1) - F.one_hot(label[:, 0], 40).double()
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(grad.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["softmax", "layer_norm"])
def test_saved_row_values_give_the_gradients_of_eager(name):
    """Softmax and LayerNorm in float64 through the saved row values: eager's gradients, and
    nothing saved when no gradient is recorded."""
    xs = inputs(name, (5, 17))
    grads, packed = _saved_by_the_node(call(name), *xs)
    assert any(t.shape == (5, 2) for t in packed), [t.shape for t in packed]
    ref = [x.detach().clone().requires_grad_() for x in xs]
    out = OPS[name][2](*ref)
    out.backward(torch.ones_like(out))
    for got, want in zip(grads, [r.grad for r in ref]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        _, packed = _saved_by_the_node(lambda *a: call(name)(*a).requires_grad_(), *[x.detach() for x in xs])
    assert packed == []
    empty = [x.detach()[:, :0].requires_grad_() if x.dim() == 2 else x.detach()[:0].requires_grad_() for x in xs]
    grads, _ = _saved_by_the_node(call(name), *empty)  # rows of no element: nothing to save
    assert [g.shape for g in grads] == [x.shape for x in empty]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["softmax", "layer_norm", "log_softmax"])
def test_the_saved_row_values_give_the_bits_of_computing_them_again(name, dtype):
    """The backward that reads the saved row values (autograd's direct call) and the one that
    computes them again (<name>_backward, create_graph) factor the same row values out of
    their sums: x's gradient has the same bits."""
    g = torch.Generator().manual_seed(11)
    xs = [x.detach().to(dtype) for x in inputs(name, (6, 300))]
    dout = torch.randn(6, 300, generator=g, dtype=D).to(dtype)
    saved = [x.clone().requires_grad_() for x in xs]
    call(name)(*saved).backward(dout)
    again = [x.clone().requires_grad_() for x in xs]
    grads = torch.autograd.grad(call(name)(*again), again, dout, create_graph=True)
    assert torch.equal(saved[0].grad, grads[0].detach())


def test_per_row_output_has_a_last_dimension_of_one():
    assert call("row_lse")(torch.randn(2, 3, 7, dtype=D)).shape == (2, 3, 1)
    assert call("row_lse")(torch.empty(2, 3, 7, device="meta")).shape == (2, 3, 1)


def test_torch_integrations():
    name = "rms_norm"
    xs = [x.detach() for x in inputs(name, (4, 8))]
    torch.library.opcheck(torch.ops.fusegen.rows_rms_norm.default, (*xs, EPS))
    torch.library.opcheck(op("row_lse").op.default, (xs[0],))
    batched = torch.vmap(call(name), in_dims=(0, None))(xs[0].view(2, 2, 8), xs[1])
    torch.testing.assert_close(batched, call(name)(*xs).view(2, 2, 8))
    jac = torch.func.jacrev(call(name))(xs[0][0], xs[1])
    torch.testing.assert_close(jac, torch.func.jacrev(OPS[name][2])(xs[0][0], xs[1]))


@pytest.mark.parametrize("mode", ["opaque", "decompose"])
def test_torch_compile(mode):
    text, scalars, ref = OPS["softmax"]
    o = fusegen.fuse(text, name=f"rows_softmax_{mode}", compile=mode)
    x = torch.randn(4, 9, dtype=D, requires_grad=True)
    y = torch.compile(lambda x: o(x) * 2, backend="aot_eager" if mode == "opaque" else "inductor")(x)
    torch.testing.assert_close(y, ref(x) * 2)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], torch.autograd.grad((ref(x) * 2).sum(), x)[0])


def test_a_fused_function_with_method_reductions():
    @fusegen.fused(scalars=["eps"])
    def rows_fused_norm(x, w, eps):
        inv = torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
        return x * inv * w

    xs = inputs("rms_norm", (3, 8))
    torch.testing.assert_close(rows_fused_norm(*xs, eps=EPS), OPS["rms_norm"][2](*xs))


@pytest.mark.parametrize("text, message", [
    ("x.sum()", "reduces over the last dimension only: expected dim=-1, got no dim"),
    ("x.sum(0, keepdim=True)", "expected dim=-1, got dim=0"),
    ("x - x.mean(-1)", "needs keepdim=True, got no keepdim"),
    ("torch.amax(x, -1, keepdim=False) * x", "needs keepdim=True, got keepdim=False"),
    ("x.mean(-1, keepdim=True, dtype=x)", "unexpected keyword argument 'dtype'"),
    ("torch.softmax(x, -1)", "write softmax with those"),
])
def test_reductions_are_spelled_as_torch_spells_them(text, message):
    with pytest.raises(ParseError, match=message):
        fusegen.fuse(text)


def test_onnx_export_lowers_the_reductions():
    onnx = pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    names = ["rms_norm", "softmax", "log_softmax", "row_lse", "row_extremes", "residual_rms"]

    class Model(torch.nn.Module):
        def forward(self, x, w, r):
            args = {"x": x, "w": w, "r": r, "y": r}
            outs = []
            for n in names:
                out = call(n)(*[args[i] for i in op(n).spec.inputs])
                outs += list(as_tuple(out))
            return outs

    g = torch.Generator().manual_seed(2)
    x, r = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g)
    w = torch.randn(16, generator=g)
    x[0, 0, 3] = x[0, 0, 5] = 4.0  # a tie for the maximum
    program = torch.onnx.export(Model().eval(), (x, w, r), dynamo=True, verbose=False,
                                custom_translation_table=fusegen.onnx_translations(*[op(n) for n in names]))
    proto = program.model_proto
    onnx.checker.check_model(proto, full_check=True)
    assert not proto.functions and {n.op_type for n in proto.graph.node} >= {"ReduceMean", "ReduceMax", "ReduceSum"}
    model = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: t.numpy() for i, t in zip(model.get_inputs(), (x, w, r))}
    got = [torch.from_numpy(o) for o in model.run(None, feeds)]
    want = Model()(x, w, r)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_too_many_values_per_row_is_a_limit_error():
    from fusegen.errors import LimitError
    terms = " + ".join(f"torch.amax(x * {k + 2}, -1, keepdim=True)" for k in range(70))
    with pytest.raises(LimitError, match="values per row .* MAX_ROW_VALUES=64"):
        fusegen.fuse(f"x * ({terms})", name="rows_too_many")


def test_detach_stops_the_gradient_as_torch_does():
    stable = ("torch.exp(x - torch.amax(x, -1, keepdim=True).detach()) / "
              "torch.exp(x - torch.amax(x, -1, keepdim=True).detach()).sum(-1, keepdim=True)")
    o = fusegen.fuse(stable, name="rows_softmax_detached")
    # no gradient through the maximum: the backward reduces three values per row, as the
    # plain softmax's, whose maximum's gradient cancels
    assert len(o.spec.backward_rows.accumulators) == len(op("softmax").spec.backward_rows.accumulators) == 3
    x = torch.randn(4, 9, dtype=D, requires_grad=True)
    torch.testing.assert_close(o(x), torch.softmax(x, -1))
    assert torch.autograd.gradcheck(o, (x,)) and torch.autograd.gradgradcheck(o, (x,))
    d = fusegen.fuse("x * y.detach() + torch.detach(x)", name="rows_detach_product")
    a, b = (torch.randn(5, dtype=D, requires_grad=True) for _ in range(2))
    ga, gb = torch.autograd.grad(d(a, b).sum(), (a, b))
    torch.testing.assert_close(ga, b.detach())
    assert torch.equal(gb, torch.zeros_like(b))  # zeros, where eager's autograd.grad gives None
    with pytest.raises(ParseError, match="detach\\(\\) takes no arguments"):
        fusegen.fuse("x.detach(1)")


def test_the_zero_test_is_exact_and_bounded():
    """ZeroTest: sums that cancel only through the row values' algebra (mean(x) = sum(x)/n,
    decimals as the doubles they are) are found zero, others are not; a chain of four
    softmax and LayerNorm layers (every layer's sums tested) derives within the deadline."""
    from fusegen.frontend.statements import parse_program
    from fusegen.ir import primitives as fn
    from fusegen.ir import rows, spec as ir_spec
    x, w = (sympy.Symbol(n, real=True) for n in "xw")
    test = rows.ZeroTest()
    centered = fn.sub(x, fn.RowMean(x))
    assert test.vanishes(fn.mul(fn.RowMax(w), centered))
    assert test.vanishes(fn.sub(fn.mul(sympy.Float(0.1), x), fn.div(x, sympy.Integer(10)))) is False  # 0.1 is not 1/10
    assert test.vanishes(fn.sub(fn.mul(sympy.Float(0.5), x), fn.div(x, sympy.Integer(2))))
    assert not test.vanishes(fn.mul(w, centered))  # w varies along the row
    assert not test.vanishes(fn.sub(x, fn.RowMax(x)))
    layer = ("m = torch.amax(y, -1, keepdim=True); e = torch.exp(y - m); y = e / e.sum(-1, keepdim=True) * w; "
             "mu = y.mean(-1, keepdim=True); y = (y - mu) * torch.rsqrt(((y - mu)**2).mean(-1, keepdim=True) + 1e-5)")
    spec = ir_spec.differentiate(parse_program("y = x; " + "; ".join([layer] * 4) + "; y"), name="rows_chain")
    assert len(spec.backward_rows.accumulators) < 36  # 36 without the test

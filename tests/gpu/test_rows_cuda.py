"""On a GPU: ops that reduce over the last dimension (RMSNorm, LayerNorm, softmax,
log_softmax, residual + RMSNorm of two outputs) through every shape of the row kernel (rows
of up to 1024 elements one per warp, longer ones one per block of 256 threads, or of 128
for 16-bit rows held in registers, up to 4096 elements in a forward and 2048 in a backward;
held or read again by each pass), every
dtype, against eager in float64 on the same values, forward and every gradient; 3-D, transposed, sliced and per-row broadcast inputs;
two runs, and the two compilers (NVRTC, nvcc), give the same bits; amax's and amin's
gradient is split evenly between ties; no rows, no work; a weight's gradient summed over the
rows in the kernel (large shapes, two runs, deterministic mode); the backward that reads the
row values its forward saved gives the bits of the one that computes them again; long rows
in few rows split over blocks.

    PYTHONPATH=. python -m pytest -q -m cuda tests/gpu/test_rows_cuda.py
"""

from __future__ import annotations

import pytest
import torch

import fusegen

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol as a share of the reference's largest magnitude): one rounding of the result
# to the storage type, after float math whose sums run over up to 8192 elements.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
# Around the warp/block boundary (1024) and a warp's 32 lanes; 1 is a row of one element;
# 2048: a 16-bit row that a block of 128 threads holds (fusegen-cuda-rows.cuh,
# kRowHalfBlock; 4096 too in a forward); 20000 and 60000 are longer than a block holds in
# registers (fusegen-runtime.h, row_cache_vectors): read again by each pass, in unrolled
# loops with a remainder, and split over blocks, ROWS being few (row_split_chunk).
LENGTHS = [1, 7, 64, 1000, 1024, 1025, 2048, 4096, 8192, 20000, 60000]
ROWS = 37  # not a multiple of the 8 rows a block of warps takes: the last block is partial


def _mean(t):
    return t.mean(-1, keepdim=True)


def _rmsnorm(x, w):
    return x * torch.rsqrt(_mean(x * x) + EPS) * w


def _layernorm(x, w, b):
    c = x - _mean(x)
    return c * torch.rsqrt(_mean(c * c) + EPS) * w + b


def _resnorm(x, r, w):
    return x + r, _rmsnorm(x + r, w)


# name -> (expression, inputs, scalars, eager, the inputs of one value per element of x)
OPS = {
    "rmsnorm": ("x * torch.rsqrt((x*x).mean(-1, keepdim=True) + eps) * w", "x,w", ["eps"], _rmsnorm, "x"),
    "layernorm": ("(x - x.mean(-1, keepdim=True)) * torch.rsqrt(((x - x.mean(-1, keepdim=True))**2)"
                  ".mean(-1, keepdim=True) + eps) * w + b", "x,w,b", ["eps"], _layernorm, "x"),
    "softmax": ("torch.exp(x - torch.amax(x, -1, keepdim=True)) / "
                "torch.exp(x - torch.amax(x, -1, keepdim=True)).sum(-1, keepdim=True)", "x", [],
                lambda x: torch.softmax(x, -1), "x"),
    "log_softmax": ("x - torch.logsumexp(x, -1, keepdim=True)", "x", [], lambda x: torch.log_softmax(x, -1),
                    "x"),
    "resnorm": ("(x + r, (x + r) * torch.rsqrt(((x + r)*(x + r)).mean(-1, keepdim=True) + eps) * w)", "x,r,w",
                ["eps"], _resnorm, "x,r"),
}
EXTREMES = {"amax": ("torch.amax(x, -1, keepdim=True)", torch.amax),
            "amin": ("torch.amin(x, -1, keepdim=True)", torch.amin)}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def ops(monkeypatch_module):
    """route -> name -> FusedOp: every op once per compiler, each route's in one library."""
    built = {}
    for route in ("nvrtc", "nvcc"):
        monkeypatch_module.setenv("FUSEGEN_CUDA_COMPILER", route)
        requests = [{"expr": text, "name": f"test_rows_{name}_{route}", "inputs": inputs, "scalars": scalars}
                    for name, (text, inputs, scalars, _, _) in OPS.items()]
        requests += [{"expr": text, "name": f"test_rows_{name}_{route}"}
                     for name, (text, _) in EXTREMES.items()]
        names = list(OPS) + list(EXTREMES)
        built[route] = dict(zip(names, fusegen.fuse_many(requests)))
    return built


def _call(op, name):
    """The op as a function of its tensors (eps positional, as a user may pass it)."""
    return (lambda *t: op(*t, EPS)) if OPS[name][2] else op


def _inputs(name, lead, n, dtype, seed=0):
    """The op's inputs: x (and r) of shape lead + (n,), the weights of shape (n,)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, device="cuda", generator=g) * scale + shift).to(dtype)

    make = {"x": lambda: r(*lead, n), "r": lambda: r(*lead, n), "w": lambda: r(n, scale=0.1, shift=1.0),
            "b": lambda: r(n, scale=0.1)}
    return [make[k]() for k in OPS[name][1].split(",")]


def _run(f, leaves, douts, view=None):
    """(outputs..., gradient of every leaf...) of f at view(leaves), synchronized."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    args = view(*leaves) if view is not None else leaves
    out = f(*args)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    grads = torch.autograd.grad(outs, leaves, douts)
    torch.cuda.synchronize()
    return [o.detach() for o in outs] + list(grads)


def _douts(name, leaves, dtype, view=None, seed=1):
    """Output gradients of the shapes eager's outputs have."""
    args = view(*leaves) if view is not None else leaves
    out = OPS[name][3](*args)
    outs = list(out) if isinstance(out, tuple) else [out]
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(o.shape, device="cuda", generator=g).to(dtype) for o in outs]


def _check(name, ops, leaves, douts, dtype, what, view=None, floor=None):
    """Both routes give the same bits, and they match eager in float64 on the same values;
    `floor`: result index -> the least magnitude its tolerance is a share of (a result that
    is a sum cancelling to about zero)."""
    got = {route: _run(_call(built[name], name), leaves, douts, view) for route, built in ops.items()}
    for k, (a, b) in enumerate(zip(got["nvrtc"], got["nvcc"])):
        assert torch.equal(a, b), f"{what}, result {k}: NVRTC and nvcc differ"
    want = _run(OPS[name][3], [t.double() for t in leaves], [d.double() for d in douts], view)
    rtol, atol = TOL[dtype]
    for k, (a, w) in enumerate(zip(got["nvrtc"], want)):
        assert a.shape == w.shape and a.dtype == dtype, f"{what}, result {k}: {a.shape} {a.dtype}"
        scale = max(float(w.abs().max()) if w.numel() else 1.0, (floor or {}).get(k, 0.0), 1e-30)
        torch.testing.assert_close(a.double(), w, rtol=rtol, atol=atol * scale,
                                   msg=lambda m: f"{what}, result {k}: {m}")
    return got["nvrtc"]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_matches_float64_eager_and_both_routes_agree(ops, name, dtype, n):
    leaves = _inputs(name, (ROWS,), n, dtype)
    _check(name, ops, leaves, _douts(name, leaves, dtype), dtype, f"{name} {dtype} rows of {n}")


def _layout(name, layout, dtype):
    """(leaves, view): the op's inputs in one layout, and the function making its arguments
    of them (None: the leaves themselves)."""
    g = torch.Generator(device="cuda").manual_seed(2)

    def r(*shape):
        return torch.randn(shape, device="cuda", generator=g).to(dtype)

    inputs = OPS[name][1].split(",")
    if layout == "3d":  # leading dimensions collapsed into rows
        return _inputs(name, (3, 5), 1000, dtype), None
    if layout == "transposed":  # x's elements 64 apart along a row, its rows adjacent
        leaves = _inputs(name, (64,), 777, dtype)
        leaves[0] = r(777, 64).t()
        return leaves, None
    if layout == "sliced":  # rows 1030 apart, the first element not aligned to a vector
        leaves = _inputs(name, (40,), 1024, dtype)
        leaves[0] = r(40, 1030)[:, 3:1027]
        return leaves, None
    # per row: an input of one value per row broadcast along it (shape (rows, 1))
    if inputs == ["x"]:  # x itself, expanded along the row (stride 0), its gradient summed back
        return [r(50, 1)], lambda x: [x.expand(50, 300)]
    leaves = _inputs(name, (50,), 300, dtype)
    k = inputs.index("r" if "r" in inputs else inputs[-1])  # resnorm's r, rmsnorm's w, layernorm's b
    leaves[k] = r(50, 1)
    return leaves, None


@pytest.mark.parametrize("layout", ["3d", "transposed", "sliced", "per_row"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_layouts(ops, name, dtype, layout):
    leaves, view = _layout(name, layout, dtype)
    douts = _douts(name, leaves, dtype, view)
    floor = None
    if view is not None:  # x's gradient summed over its expanded row is 0 up to the rounding of each term
        n = view(*leaves)[0].shape[-1]
        floor = {1: float(douts[0].abs().max()) * n ** 0.5}
    _check(name, ops, leaves, douts, dtype, f"{name} {dtype} {layout}", view, floor)


@pytest.mark.parametrize("n", [7, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_two_runs_give_the_same_bits(ops, name, dtype, n):
    """Each row is reduced in a fixed order (no atomics): identical bits on every run, in
    torch's default (nondeterministic) mode; a weight's gradient is summed by the kernel's
    blocks, and their partial rows by ATen's sum, in a fixed order too."""
    op = _call(ops["nvrtc"][name], name)
    leaves = _inputs(name, (300,), n, dtype, seed=3)
    douts = _douts(name, leaves, dtype)
    first, second = _run(op, leaves, douts), _run(op, leaves, douts)
    for k, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"{name} {dtype} rows of {n}, result {k}"


def _again_alike(ops, name, leaves, douts, first):
    """The NVRTC route's op, after checking that a second run gives `first`'s bits."""
    op = _call(ops["nvrtc"][name], name)
    assert all(torch.equal(a, b) for a, b in zip(first, _run(op, leaves, douts)))
    return op


def _sums_of(op, leaves, douts):
    """The input shapes of the aten::sum calls of op's backward."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    out = op(*leaves)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.autograd.grad(out, leaves, douts)
        torch.cuda.synchronize()
    return [tuple(e.input_shapes[0]) for e in prof.events() if e.name == "aten::sum"]


@pytest.mark.parametrize("shape", [(4096, 4096), (333, 1000), (1000, 512), (1500, 2048), (16384, 8192),
                                   (64, 8200)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["rmsnorm", "layernorm"])
def test_weight_gradients_are_summed_in_the_row_kernel(ops, name, dtype, shape):
    """A weight's gradient (shape (H,)) is summed over the rows by the backward kernel, each
    block into one partial row, which ATen sums: no (rows, H) gradient is written for it
    (rows past 8192 elements, and 16-bit rows a warp takes, up to 1024, still are).
    LayerNorm's bias's, dout itself, is summed by the same kernel where two sums fit (rows
    of up to 4096 elements a block takes, 512 a warp), by ATen elsewhere. The
    float32 rows of 512, 2048 and 4096 elements and the 16-bit ones of 2048 are held in
    registers (a warp's, a block's), the others read again. It matches eager in float64, and
    two runs give the same bits, also under torch.use_deterministic_algorithms (no atomics)."""
    rows, n = shape
    leaves = _inputs(name, (rows,), n, dtype, seed=4)
    douts = _douts(name, leaves, dtype)
    first = _check(name, ops, leaves, douts, dtype, f"{name} {dtype} {shape}")
    op = _again_alike(ops, name, leaves, douts, first)
    torch.use_deterministic_algorithms(True)
    try:
        assert all(torch.equal(a, b) for a, b in zip(first, _run(op, leaves, douts)))
    finally:
        torch.use_deterministic_algorithms(False)
    summed = _sums_of(op, leaves, douts)
    full = [s for s in summed if s == shape]  # summed by ATen
    # (16-bit rows a warp takes write the weight's gradient whole: row_sums_fit)
    whole = n > 8192 or (dtype != torch.float32 and n <= 1024)
    two = n <= 4096 and (n > 1024 or (dtype == torch.float32 and n <= 512))
    assert len(full) == (name == "layernorm" and not two) + whole, summed
    props = torch.cuda.get_device_properties(0)
    assert all(s[0] <= 3 * props.multi_processor_count for s in summed if s != shape), summed


def _kernels_of(op, leaves, douts):
    """The names of the CUDA kernels op's forward and backward launch."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _run(op, leaves, douts)
    return {e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA}


@pytest.mark.parametrize("shape", [(16, 262144), (3, 65539), (200, 20480)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_long_rows_in_few_rows_are_split_over_blocks(ops, name, dtype, shape):
    """Rows too few to fill the GPU with one block each, and long enough for chunks of 8192
    elements (fusegen-runtime.h, row_split_chunk), are split over blocks, a launch per pass
    (rows_split_kernel; 65539: not whole vectors, one element an access): they match eager in
    float64 on both routes, and two runs give the same bits."""
    rows, n = shape
    leaves = _inputs(name, (rows,), n, dtype, seed=5)
    douts = _douts(name, leaves, dtype)
    first = _check(name, ops, leaves, douts, dtype, f"{name} {dtype} {shape}")
    op = _again_alike(ops, name, leaves, douts, first)
    kernels = _kernels_of(op, leaves, douts)
    assert any("rows_split_kernel" in k for k in kernels), kernels
    assert not any("rows_kernel" in k.replace("rows_split_kernel", "") for k in kernels), kernels


def _tied_rows(n: int, sign: float) -> torch.Tensor:
    """Rows whose extreme (max for sign 1, min for -1) appears once, twice, three times
    (the first and last elements among them) and everywhere."""
    x = torch.randn(4, n, dtype=torch.float64).clamp(-2, 2) * sign
    top = 3.0 * sign
    x[0, n // 2] = top
    x[1, [0, n - 1]] = top
    x[2, [0, n // 3, n - 1]] = top
    x[3] = top
    return x


@pytest.mark.parametrize("n", [7, 1000, 2000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(EXTREMES))
def test_ties_share_the_gradient_evenly(ops, name, dtype, n):
    """amax/amin's gradient: the row's output gradient divided evenly between its tied
    extremes (as torch's amax/amin), never all to one of them."""
    x = _tied_rows(n, 1.0 if name == "amax" else -1.0).to(dtype).cuda()
    dout = torch.tensor([[1.0], [2.0], [3.0], [4.0]], device="cuda").to(dtype)
    eager = EXTREMES[name][1]
    for route in ("nvrtc", "nvcc"):
        got = _run(ops[route][name], [x], [dout])
        want = _run(lambda t: eager(t, -1, keepdim=True), [x.double()], [dout.double()])
        torch.testing.assert_close(got[0].double(), want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1].double(), want[1], rtol=TOL[dtype][0], atol=0,
                                   msg=lambda m: f"{route} {name}: {m}")
        counts = (x == got[0]).sum(-1).tolist()
        assert counts[:3] == [1, 2, 3] and counts[3] == n
        nonzero = (got[1] != 0).sum(-1).tolist()
        assert nonzero == counts, f"{route} {name}: the gradient reaches {nonzero} elements of ties {counts}"


@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_no_rows_gives_empty_results(ops, name, lead):
    leaves = _inputs(name, lead, 64, torch.float32)
    douts = _douts(name, leaves, torch.float32)
    got = _run(_call(ops["nvrtc"][name], name), leaves, douts)
    want = _run(OPS[name][3], leaves, douts)
    for k, (a, w) in enumerate(zip(got, want)):
        assert a.shape == w.shape and (a.numel() == 0 or torch.equal(a, w)), f"{name} {lead}, result {k}"


@pytest.mark.parametrize("n", [7, 1000, 4096, 20000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["softmax", "layernorm", "log_softmax"])
def test_saved_row_values_give_the_gradient_of_computing_them_again(ops, name, dtype, n):
    """softmax's, LayerNorm's and log_softmax's forward save row values for the backward
    (docs/rows.md): the backward autograd calls directly reads them, the one through
    <name>_backward (create_graph) computes them again. x's gradient has the same bits for
    softmax and log_softmax; LayerNorm's output expression is a sum of products, which nvcc
    contracts into multiply-adds as each kernel's code allows: a few float roundings apart
    at most (a weight's gradient is summed in the kernel on the direct path
    only, in another order)."""
    op = ops["nvrtc"][name]
    assert op.spec.saved_rows
    leaves = _inputs(name, (ROWS,), n, dtype)
    douts = _douts(name, leaves, dtype)
    saved = _run(_call(op, name), leaves, douts)
    xs = [t.detach().requires_grad_() for t in leaves]
    again = torch.autograd.grad(_call(op, name)(*xs), xs, douts, create_graph=True)
    got, want = saved[1], again[0].detach()
    if name != "layernorm":
        assert torch.equal(got, want), f"{name} {dtype} rows of {n}"
        return
    # (a few float roundings of the largest gradient, then one of the storage type)
    tol = 2.0**-20 + torch.finfo(dtype).eps
    scale = want.double().abs().max().item()
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale,
                               msg=lambda m: f"{name} {dtype} rows of {n}: {m}")

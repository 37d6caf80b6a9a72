"""Fusion across a fused op under torch.compile (fusegen/pytorch/decompose.py).

In "decompose" mode torch.compile sees the op as ATen ops of its expression (no fusegen op
in the graphs AOTAutograd hands the compiler), through a FusedOp call and through
`torch.ops.fusegen.<name>` alike, with eager PyTorch's gradients at kinks and NaNs; in
"opaque" mode the op stays one call. The tests compile with a capture backend
(AOTAutograd, then the captured ATen graphs run as they are: seconds, and exactly eager's
arithmetic); the benchmark's smoke run compiles with Inductor end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

import fusegen
from fusegen.pytorch import composite, decompose
from fusegen.errors import SpecError
from helpers import forward_backward

GELU = "0.5*x*(1 + tanh(0.7978845608*(x + 0.044715*x*x*x)))"
GLU = "a * torch.sigmoid(a) * b"
RESNORM = "h = x + r; (h, h * torch.rsqrt((h*h).mean(-1, keepdim=True) + eps) * w)"
KINKS = "relu(x) + abs(y) + slope*maximum(x, y) + where(y > 0, log(y), y)"


def gelu_eager(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def kinks_eager(x, y, slope):
    return torch.relu(x) + torch.abs(y) + slope * torch.maximum(x, y) + torch.where(y > 0, torch.log(y), y)


@pytest.fixture(scope="module")
def ops():
    fusegen.fuse_many([{"expr": GELU, "name": "cf_gelu_dec"}, {"expr": GELU, "name": "cf_gelu_opq"},
                       {"expr": KINKS, "name": "cf_kinks", "scalars": ["slope"]},
                       {"expr": GLU, "name": "cf_glu_dec"},
                       {"expr": RESNORM, "name": "cf_resnorm_dec", "scalars": ["eps"]}])  # one build
    return {"dec": fusegen.fuse(GELU, name="cf_gelu_dec", compile="decompose"),
            "opq": fusegen.fuse(GELU, name="cf_gelu_opq", compile="opaque"),
            "kinks": fusegen.fuse(KINKS, name="cf_kinks", scalars=["slope"], compile="decompose"),
            "glu": fusegen.fuse(GLU, name="cf_glu_dec", compile="decompose"),
            "resnorm": fusegen.fuse(RESNORM, name="cf_resnorm_dec", scalars=["eps"], compile="decompose")}


class Capture:
    """A torch.compile backend: AOTAutograd, keeping the forward and backward graphs, which
    then run as captured (ATen ops, eagerly)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        return aot_autograd(fw_compiler=self._keep, bw_compiler=self._keep)(gm, example_inputs)

    def _keep(self, gm, _):
        self.graphs.append(gm)
        return make_boxed_func(gm.forward)

    def targets(self, k):
        return [str(n.target) for n in self.graphs[k].graph.nodes if n.op == "call_function"]


def _block_inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (12, 8), (12,), (16, 12)]              # x, linear weight and bias, residual
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_(True) for s in shapes]


def _forward_backward(f, inputs):
    """[out, *gradients] for grad = 1 (helpers.forward_backward, flattened for zip)."""
    out, grads = forward_backward(f, inputs, grad=1.0)
    return [out, *grads]


def _block(act):
    """linear -> fused activation -> residual add."""
    return lambda x, w, b, r: act(F.linear(x, w, b)) + r


@pytest.mark.parametrize("path", ["FusedOp", "torch.ops"])
def test_decompose_leaves_no_fusegen_op_and_matches_eager(ops, path):
    act = ops["dec"] if path == "FusedOp" else torch.ops.fusegen.cf_gelu_dec
    capture = Capture()
    inputs = _block_inputs()
    got = _forward_backward(torch.compile(_block(act), backend=capture, fullgraph=True), inputs)
    forward, backward = capture.targets(0), capture.targets(1)
    assert not [t for t in forward + backward if "fusegen" in t]
    # tanh's derivative reads its result: the backward recomputes it from tanh's input
    # (composite._Recomputed) and applies derivatives.yaml's formula, not tanh_backward
    assert "aten.tanh.default" in forward and "aten.tanh.default" in backward
    for g, w in zip(got, _forward_backward(_block(gelu_eager), inputs)):
        torch.testing.assert_close(g, w)
    with torch.profiler.profile() as prof:  # eager calls keep the kernels
        _forward_backward(_block(act), inputs)
    assert {"fusegen::cf_gelu_dec", "fusegen::cf_gelu_dec_backward"} <= {e.name for e in prof.events()}


def test_opaque_keeps_the_op(ops):
    capture = Capture()
    inputs = _block_inputs()
    got = _forward_backward(torch.compile(_block(ops["opq"]), backend=capture, fullgraph=True), inputs)
    assert "fusegen.cf_gelu_opq.default" in capture.targets(0)
    assert "fusegen.cf_gelu_opq_backward.default" in capture.targets(1)
    for g, w in zip(got, _forward_backward(_block(gelu_eager), inputs)):
        torch.testing.assert_close(g, w)


def test_decomposed_gradients_are_eager_at_kinks_and_nans(ops):
    """relu and abs at 0, maximum ties, NaN inputs, and the unchosen `where` branch (log at
    y = 0: eager's NaN, which the fused kernel does not give): bit for bit eager's."""
    nan = float("nan")
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, nan, 0.0, 3.0], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0.0, 1.0, 1.0, -1.0, nan, 1.0, -2.0, 0.0], dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(lambda x, y: ops["kinks"](x, y, 0.5), backend=Capture(), fullgraph=True)
    got = _forward_backward(compiled, [x, y])
    want = _forward_backward(lambda x, y: kinks_eager(x, y, 0.5), [x, y])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    assert got[2][7].isnan()
    fused = _forward_backward(lambda x, y: ops["kinks"](x, y, 0.5), [x, y])
    assert fused[2][7] == 1  # eager calls keep the kernels, and their documented choice


def _resnorm_eager(x, r, w):  # both outputs, in one
    h = x + r
    return h + 2 * F.rms_norm(h, h.shape[-1:], w, 1e-6)


def _resnorm(op):
    def both(x, r, w):
        h, normed = op(x, r, w, 1e-6)
        return h + 2 * normed
    return both


@pytest.mark.parametrize("name, shapes, eager", [
    # sigmoid's result, which its derivative reads, recomputed from the bf16 input
    ("glu", [(8, 64), (8, 64)], lambda a, b: a * torch.sigmoid(a) * b),
    # the norm reads h as stored (bf16), and its backward reads that
    ("resnorm", [(8, 64), (8, 64), (64,)], _resnorm_eager),
])
def test_a_16_bit_op_saves_no_float_tensor_of_its_size(ops, name, shapes, eager):
    """A bf16 op computes in float; under the min-cut partitioner (Inductor's) its forward
    saves no float32 tensor of the input's size for the backward (one value a row may be
    float32), and its gradients are float64's within bf16 rounding."""
    saved = []

    def forward_graph(gm, _):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved.extend(n.meta["val"] for n in out if isinstance(n, torch.fx.Node))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward_graph, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           partition_fn=min_cut_rematerialization_partition)
    gen = torch.Generator().manual_seed(0)
    exact = [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_(True) for s in shapes]
    low = [t.detach().bfloat16().requires_grad_(True) for t in exact]
    op = ops[name] if name == "glu" else _resnorm(ops[name])
    got = _forward_backward(torch.compile(op, backend=backend, fullgraph=True), low)
    wide = [tuple(t.shape) for t in saved if t.dtype != torch.bfloat16 and t.shape[-1:] != (1,)]
    assert saved and not wide
    for g, w in zip(got, _forward_backward(eager, exact)):  # float math, rounded to bf16
        assert (g.double() - w).norm() <= 1e-2 * w.norm()


@pytest.mark.slow
def test_inductor_saves_the_decoder_block_in_16_bits():
    """A bf16 decoder layer of fusegen's ops (`fusegen bench block`'s model) through
    Inductor's own graph passes (torch 2.11's drop a float -> bf16 -> float round trip as
    pointless): its forward saves no float32 tensor of the activations' size for the
    backward (the loss, one value a row and the attention's logsumexp may be float32), as
    torch.compile of the eager model saves none: not sigmoid's result, not the residual
    sum."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from fusegen.bench import block
    saved = []

    def inner(gm, example_inputs, **kwargs):
        if not saved:  # the forward comes first
            out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            saved.extend(n.meta["val"] for n in out if isinstance(n, torch.fx.Node))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    cfg = block.Config(layers=1, hidden=256, heads=4, head_dim=64, mlp=512, vocab=1024, batch=2, seq=64)
    model = block.Decoder(cfg, block.fusegen_kernels()).to(torch.bfloat16)
    model.load_state_dict(block.initial_weights(cfg, torch.bfloat16, "cpu"))
    compiled = torch.compile(model, backend=lambda gm, ex: compile_fx(gm, ex, inner_compile=inner))
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph skips inner
        compiled(*block.batch(cfg, "cpu")).backward()
    activation = cfg.batch * cfg.seq * cfg.hidden
    assert saved and not [tuple(t.shape) for t in saved if t.dtype == torch.float32 and t.numel() >= activation]


@pytest.mark.parametrize("node", sorted(composite._RESULT_GRADIENTS, key=lambda n: n.__name__),
                         ids=lambda n: n.__name__)
def test_recomputed_primitives_are_eager_under_autograd_and_torch_func(node):
    """Each primitive that recomputes its result: eager's values and first and second
    derivatives, forward mode, and vmap of its gradient."""
    f = composite._TENSOR_FUNCTIONS[node]

    def recomputed(x):
        return composite._Recomputed.apply(x, node)

    x = (torch.rand(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 0.5 + 0.5)
    x.requires_grad_(True)
    torch.testing.assert_close(recomputed(x), f(x))
    torch.autograd.gradcheck(recomputed, (x,))
    torch.autograd.gradgradcheck(recomputed, (x,))
    tangent = torch.randn_like(x)
    for got, want in zip(torch.func.jvp(recomputed, (x,), (tangent,)), torch.func.jvp(f, (x,), (tangent,))):
        torch.testing.assert_close(got, want)
    per_row = torch.func.vmap(torch.func.grad(lambda row: recomputed(row).sum()))
    torch.testing.assert_close(per_row(x), torch.func.vmap(torch.func.grad(lambda row: f(row).sum()))(x))


def test_the_backward_op_decomposes_too(ops):
    x, dout = torch.randn(2, 7, dtype=torch.float64).unbind()
    backward = torch.ops.fusegen.cf_gelu_dec_backward
    capture = Capture()
    (got,) = torch.compile(lambda d, x: backward(d, x, [True]), backend=capture, fullgraph=True)(dout, x)
    assert not [t for t in capture.targets(0) if "fusegen" in t]
    torch.testing.assert_close(got, backward(dout, x, [True])[0])


def test_fused_decorator_takes_the_mode():
    @fusegen.fused(name="cf_swiglu", compile="decompose")
    def swiglu(gate, up):
        return gate * torch.sigmoid(gate) * up

    fusegen.build_pending()  # dynamo cannot trace a build (fullgraph=True refuses the break)
    gate, up = (torch.randn(6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    capture = Capture()
    got = _forward_backward(torch.compile(swiglu, backend=capture, fullgraph=True), [gate, up])
    assert swiglu.op.compile_mode == "decompose"
    assert not [t for k in range(2) for t in capture.targets(k) if "fusegen" in t]
    for g, w in zip(got, _forward_backward(swiglu.eager, [gate, up])):
        torch.testing.assert_close(g, w)
    with pytest.raises(SpecError, match="fusegen op 'cf_bad'.*got 'yes'"):
        fusegen.fused(name="cf_bad", compile="yes")(swiglu.eager)


def test_torch_export_keeps_the_op(ops):
    class Block(torch.nn.Module):
        def forward(self, x):
            return ops["dec"](x) + x

    ep = torch.export.export(Block(), (torch.randn(5),))
    assert torch.ops.fusegen.cf_gelu_dec.default in {n.target for n in ep.graph.nodes}


def test_modes_and_the_cache_tag(ops):
    assert (ops["dec"].compile_mode, ops["opq"].compile_mode) == ("decompose", "opaque")
    tag = torch.compiler.config.cache_key_tag
    assert f"cf_gelu_dec={ops['dec'].entry.digest}" in tag and "cf_gelu_opq" not in tag
    with pytest.raises(SpecError, match="expected compile mode 'decompose' or 'opaque', got 'fast'"):
        fusegen.fuse(GELU, name="cf_gelu_opq", compile="fast")
    assert ops["opq"].compile_mode == "opaque"


CACHED_LOAD = """
import sys, torch
import fusegen
op = fusegen.fuse(sys.argv[1], name="cf_gelu_dec")
light = "sympy" not in sys.modules
from torch._dynamo.backends.common import aot_autograd
from functorch.compile import make_boxed_func
seen = []
backend = aot_autograd(fw_compiler=lambda gm, _: seen.append(gm) or make_boxed_func(gm.forward))
x = torch.randn(6)
torch.testing.assert_close(torch.compile(lambda x: op(x) * 2, backend=backend, fullgraph=True)(x), 2 * op(x))
print(op.library.cached, light, op.compile_mode, any("fusegen" in str(n.target) for n in seen[0].graph.nodes))
"""


def test_cached_load_with_decompose_by_environment_imports_no_sympy(ops):
    """FUSEGEN_COMPILE=decompose: a cached load registers the decomposition without sympy,
    which the first compile then derives."""
    env = dict(os.environ, FUSEGEN_COMPILE="decompose")
    out = subprocess.run([sys.executable, "-c", CACHED_LOAD, GELU], capture_output=True, text=True,
                         env=env, check=True).stdout.split()
    assert out == ["True", "True", "decompose", "False"]


@pytest.mark.slow
def test_bench_compile_runs_on_the_cpu(tmp_path):
    """The benchmark's smoke run: every form, the decomposed step runs no fusegen op and
    computes what the compiled PyTorch expression computes."""
    from fusegen.bench import compile as bench_compile
    out = tmp_path / "rows.json"
    bench_compile.main(["--device", "cpu", "--acts", "gelu_tanh", "--dtypes", "float32", "--tokens", "8",
                        "--width", "8", "--hidden", "16", "--reps", "2", "--json", str(out)])
    rows = {r["form"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(bench_compile.FORMS)
    assert [rows[f]["fusegen_ops"] for f in bench_compile.FORMS] == [2, 2, 0, 0]  # forward, backward
    assert rows["compile: decomposed op"]["max_rel_diff"] < 1e-5


@pytest.mark.parametrize("name, shapes, scalars", [
    ("cp_relu_add", [(16,), (16,)], ()),               # saves its output
    ("cp_fma", [(3, 4), (4,), (3, 1)], ()),             # broadcast inputs: gradients summed back
    ("cp_swish_beta", [(8,), (8,)], (1.702, -0.75)),  # scalars the backward reads
])
def test_compiled_autograd_runs_the_fused_backward(corpus_ops, name, shapes, scalars):
    """torch._dynamo.compiled_autograd captures the op's autograd node (its compiled_args and
    apply_with_saved) as one call, with eager's gradients, and under torch.compile too."""
    from torch._dynamo import compiled_autograd
    op = corpus_ops[name]
    leaves = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    want = torch.autograd.grad(op(*leaves, *scalars).sum(), leaves)
    graphs = []
    for compiler in (lambda gm: graphs.append(gm) or gm, torch.compile(backend="aot_eager")):
        for t in leaves:
            t.grad = None
        with compiled_autograd._enable(compiler):
            op(*leaves, *scalars).sum().backward()
        for t, w in zip(leaves, want):
            torch.testing.assert_close(t.grad, w, rtol=0, atol=0)
    assert any(f"FusedBackward(fusegen::{name})" in str(n.target) for n in graphs[0].graph.nodes)

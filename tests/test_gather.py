"""x.gather(-1, index) with one integer index per row, on the CPU: the cross-entropy of each
row (with and without ignore_index) against F.cross_entropy in float64, second order,
forward mode, int32 and int64 labels, a vocabulary that bfloat16 cannot index, rows of
length 1 and no rows, an index outside the row, the torch integrations, and the errors."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import fusegen
from fusegen.errors import ParseError
from fusegen.tools.reference import evaluate_text

D = torch.float64
CROSS_ENTROPY = "torch.logsumexp(x, -1, keepdim=True) - x.gather(-1, label)"
IGNORING = ("torch.where(label == -100, 0, torch.logsumexp(x, -1, keepdim=True) - "
            "torch.gather(x, -1, torch.clamp(label, min=0)))")


@functools.cache
def op(text=CROSS_ENTROPY, name="gather_ce"):
    return fusegen.fuse(text, name=name, inputs=["x", "label"])


def ignoring():
    return op(IGNORING, "gather_ce_ignore")


def eager(x, label, **kw):
    """F.cross_entropy per row, as the op returns it: shape (..., 1)."""
    rows = F.cross_entropy(x.reshape(-1, x.shape[-1]), label.reshape(-1), reduction="none", **kw)
    return rows.reshape(label.shape)


def logits(shape, dtype=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype).requires_grad_()


def labels(shape, vocab, seed=1, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape[:-1] + (1,), generator=g).to(dtype)


@pytest.mark.parametrize("shape", [(3, 8), (2, 3, 5), (4, 1), (3, 33)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_values_and_gradients_match_cross_entropy(shape, index_dtype):
    x, label = logits(shape), labels(shape, shape[-1], dtype=index_dtype)
    got, want = op()(x, label), eager(x, label.long())
    assert got.shape == want.shape == shape[:-1] + (1,)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(got, x, dout)[0], torch.autograd.grad(want, x, dout)[0],
                               rtol=1e-10, atol=1e-12)


def test_ignore_index_as_cross_entropy_has_it():
    x, label = logits((6, 7)), labels((6, 7), 7)
    label[1] = label[4] = -100
    got, want = ignoring()(x, label), eager(x, label, ignore_index=-100)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert got[1].item() == got[4].item() == 0.0
    kept = (label != -100).sum()
    mean = got.sum() / kept  # the mean stays outside, over the rows not ignored
    torch.testing.assert_close(mean, F.cross_entropy(x, label[:, 0], ignore_index=-100))
    torch.testing.assert_close(torch.autograd.grad(mean, x)[0],
                               torch.autograd.grad(F.cross_entropy(x, label[:, 0], ignore_index=-100), x)[0])


@pytest.mark.parametrize("which", ["plain", "ignoring"])
def test_gradcheck_and_gradgradcheck(which):
    o = op() if which == "plain" else ignoring()
    x, label = logits((3, 6)), labels((3, 6), 6)
    if which == "ignoring":
        label[0] = -100
    assert torch.autograd.gradcheck(lambda x: o(x, label), (x,))
    assert torch.autograd.gradgradcheck(lambda x: o(x, label), (x,))


def test_forward_mode_matches_eager():
    x, label = logits((4, 9)).detach(), labels((4, 9), 9)
    t = torch.randn_like(x)
    got = torch.func.jvp(lambda x: op()(x, label), (x,), (t,))[1]
    want = torch.func.jvp(lambda x: eager(x, label), (x,), (t,))[1]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_vocabulary_the_narrow_dtypes_cannot_index(dtype):
    """The index is compared in float, not in the op's dtype: bfloat16 holds 128255 as 128000."""
    vocab = 128256
    x = logits((3, vocab), dtype=torch.float32).detach().to(dtype)
    label = torch.tensor([[vocab - 1], [vocab - 255], [12345]])
    x[0, vocab - 1] = x[1, vocab - 255] = x[2, 12345] = 8.0  # the picked logits stand out
    want = eager(x.float(), label)
    torch.testing.assert_close(op()(x, label).float(), want, rtol=2e-2, atol=2e-2)


def test_rows_of_one_element_no_rows_and_an_index_outside_the_row():
    x = logits((3, 1))
    torch.testing.assert_close(op()(x, torch.zeros(3, 1, dtype=torch.long)), eager(x, torch.zeros(3, 1, dtype=torch.long)))
    assert op()(torch.empty(0, 5, dtype=D), torch.empty(0, 1, dtype=torch.long)).shape == (0, 1)
    x, label = logits((4, 5)), labels((4, 5), 5)
    label[1], label[2] = 5, -1  # torch.gather raises; a kernel cannot without a synchronisation
    got = op()(x, label).detach()
    assert got[1].isnan() and got[2].isnan()
    torch.testing.assert_close(got[[0, 3]], eager(x, label.clamp(0, 4))[[0, 3]].detach())


def test_same_bits_every_run():
    x, label = logits((64, 1000)).detach().float(), labels((64, 1000), 1000)
    assert torch.equal(op()(x, label), op()(x, label))


def test_the_oracle_evaluates_the_text_as_eager():
    x, label = logits((5, 6)).detach(), labels((5, 6), 6)
    torch.testing.assert_close(evaluate_text(CROSS_ENTROPY, {"x": x, "label": label}), eager(x, label))


def test_torch_integrations():
    x, label = logits((4, 8)).detach(), labels((4, 8), 8)
    torch.library.opcheck(op().op.default, (x, label))
    assert op()(torch.empty(4, 8, device="meta"), torch.empty(4, 1, dtype=torch.long, device="meta")).shape == (4, 1)
    batched = torch.vmap(op(), in_dims=(0, 0))(x.view(2, 2, 8), label.view(2, 2, 1))
    torch.testing.assert_close(batched, op()(x, label).view(2, 2, 1))


@pytest.mark.parametrize("mode", ["opaque", "decompose"])
def test_torch_compile(mode):
    o = fusegen.fuse(IGNORING, name=f"gather_ce_{mode}", inputs=["x", "label"], compile=mode)
    x, label = logits((5, 7)), labels((5, 7), 7)
    label[3] = -100
    y = torch.compile(lambda x, label: o(x, label).sum(), backend="aot_eager")(x, label)
    want = eager(x, label, ignore_index=-100).sum()
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(torch.autograd.grad(y, x)[0], torch.autograd.grad(want, x)[0])


def test_a_bf16_op_decomposes_to_float_math_as_its_kernel_computes():
    # logsumexp of 4096 logits is about 8.3, where bf16's spacing is 1/16: evaluated in bf16,
    # the reduction's value would be rounded before the subtraction; the kernel rounds once
    o = fusegen.fuse(CROSS_ENTROPY, name="gather_ce", inputs=["x", "label"], compile="decompose")
    x = (logits((4, 4096)) * 0.01).detach().bfloat16()
    label = labels((4, 4096), 4096)
    want = (torch.logsumexp(x.double(), -1, keepdim=True) - x.double().gather(-1, label)).bfloat16()
    torch.testing.assert_close(o(x, label), want, rtol=0, atol=0)
    got = torch.compile(lambda x, label: o(x, label), backend="aot_eager")(x, label)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_fused_function():
    @fusegen.fused
    def gather_ce_fused(x, label):
        return torch.logsumexp(x, -1, keepdim=True) - x.gather(-1, label)

    x, label = logits((3, 8)), labels((3, 8), 8)
    torch.testing.assert_close(gather_ce_fused(x, label), eager(x, label))


def test_onnx_translation_is_refused_by_name_and_left_out_of_the_whole_table():
    pytest.importorskip("onnxscript")
    with pytest.raises(fusegen.FusegenError, match="gathers along its rows"):
        fusegen.onnx_translations(op())
    assert op().op.default not in fusegen.onnx_translations()


def test_index_arguments_are_checked():
    x = logits((4, 8)).detach()
    with pytest.raises(RuntimeError, match="argument 'label' is the index of a gather; expected an integer "
                                           "tensor .* got Double"):
        op()(x, torch.zeros(4, 1, dtype=D))
    with pytest.raises(RuntimeError, match="argument 'label' is the index of a gather along the last "
                                           r"dimension, one per row; expected a last dimension of size 1, got shape \[4, 8\]"):
        op()(x, torch.zeros(4, 8, dtype=torch.long))


@pytest.mark.parametrize("text, message", [
    ("x.gather(0, label)", "picks along the last dimension only: expected dim=-1, got dim=0"),
    ("x.gather(-1)", "missing argument 'index'"),
    ("torch.gather(x, -1, label, sparse_grad=True)", "unexpected keyword argument 'sparse_grad'"),
    ("x.gather(-1, label.sum(-1, keepdim=True))", "index must be one value per row of inputs and numbers"),
    ("F.cross_entropy(x, label)", r"logsumexp\(x, -1, keepdim=True\) - x.gather\(-1, label\)"),
])
def test_gather_is_spelled_as_torch_spells_it(text, message):
    with pytest.raises(ParseError, match=message):
        fusegen.fuse(text)

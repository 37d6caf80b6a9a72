"""Bad tensors and bad calls give clear errors that name the op and the argument."""

from __future__ import annotations

import pytest
import torch

f = torch.randn(3)


@pytest.mark.parametrize("position, dtype", [(0, torch.complex64), (2, torch.complex128)])
def test_complex_tensor(corpus_ops, position, dtype):
    args = [f, f, f]
    args[position] = torch.ones(3, dtype=dtype)
    name = "abc"[position]
    with pytest.raises(RuntimeError) as info:
        corpus_ops["cp_fma"](*args)
    message = str(info.value)
    assert "fusegen::cp_fma" in message and f"argument '{name}'" in message
    assert "must be a floating, integer or bool tensor, got Complex" in message


@pytest.mark.parametrize("dtypes", [(torch.int64,) * 3, (torch.bool, torch.int32, torch.uint8)])
def test_all_integer_arguments_are_refused(corpus_ops, dtypes):
    """The documented choice: every argument integer or bool promotes to an integer type,
    which the kernels (floating point) cannot return as eager would; a clear error."""
    args = [torch.ones(3, dtype=d) for d in dtypes]
    with pytest.raises(RuntimeError) as info:
        corpus_ops["cp_fma"](*args)
    message = str(info.value)
    assert "fusegen::cp_fma: the arguments promote to" in message and "a: " in message
    assert "make one argument floating" in message


def test_integer_single_input(corpus_ops):
    with pytest.raises(RuntimeError, match=r"fusegen::cp_silu: the arguments promote to Long \(x: Long\)"):
        corpus_ops["cp_silu"](torch.arange(3))


@pytest.mark.parametrize("shapes, culprit", [
    ([(3,), (4,), (3,)], "b"),
    ([(2, 3), (3,), (2, 1, 4)], "c"),
    ([(5, 1), (1, 5), (4, 5)], "c"),
])
def test_shapes_that_do_not_broadcast(corpus_ops, shapes, culprit):
    args = [torch.randn(s) for s in shapes]
    with pytest.raises(RuntimeError) as info:
        corpus_ops["cp_fma"](*args)
    message = str(info.value)
    assert "fusegen::cp_fma" in message and f"argument '{culprit}'" in message
    assert "does not broadcast" in message
    # eager raises too: same inputs, same verdict
    with pytest.raises(RuntimeError):
        args[0] * args[1] + args[2]


def test_backward_op_checks_its_arguments_too(corpus_ops):
    with pytest.raises(RuntimeError, match=r"fusegen::cp_fma_backward: argument 'b' of shape \[4\]"):
        torch.ops.fusegen.cp_fma_backward(f, f, torch.randn(4), [True, True])


@pytest.mark.parametrize("mask", [[True, True, False], [True], []])
def test_backward_op_output_mask_of_the_wrong_length(corpus_ops, mask):
    """The schema's bool[2] is not checked by the dispatcher; a mask of another length is a
    clear error, not a read past the kernel's outputs (it crashed the process)."""
    with pytest.raises(RuntimeError, match=r"fusegen::cp_fma_backward: argument 'output_mask' must have 2 "
                                           rf"entries \(one per gradient the backward kernel computes\), got {len(mask)}"):
        torch.ops.fusegen.cp_fma_backward(f, f, f, mask)


@pytest.mark.parametrize("args, kwargs, message", [
    ((f, f), {}, "missing a required argument: 'c'"),
    ((f, f, f, f), {}, "too many positional arguments"),
    ((f, f, f), {"a": f}, "multiple values for argument 'a'"),
    ((f, f, f), {"d": f}, "unexpected keyword argument 'd'"),
])
@pytest.mark.parametrize("decorated", [False, True])
def test_wrong_number_of_arguments(corpus_ops, decorated_fma, args, kwargs, message, decorated):
    op, who, name = ((decorated_fma, "@fused function 'err_fma'", "err_fma") if decorated
                     else (corpus_ops["cp_fma"], "fusegen op 'cp_fma'", "cp_fma"))
    with pytest.raises(TypeError) as info:
        op(*args, **kwargs)
    text = str(info.value)
    assert who in text and message in text and f"{name}(a, b, c)" in text


@pytest.mark.parametrize("decorated", [False, True])
@pytest.mark.parametrize("positional, keywords", [("ab", "c"), ("a", "cb"), ("", "bac")])
def test_keywords_in_any_order_bind_as_positional_arguments(corpus_ops, decorated_fma, positional, keywords,
                                                            decorated):
    """The trailing parameters by keyword (`op(x, w, eps=1e-6)`) take a placement without a
    Signature (binding.place); any mix gives what the positional call gives."""
    named = {p: torch.full((3,), v) for p, v in zip("abc", (2.0, 3.0, 4.0))}
    op = decorated_fma if decorated else corpus_ops["cp_fma"]
    out = op(*(named[p] for p in positional), **{k: named[k] for k in keywords})
    torch.testing.assert_close(out, torch.full((3,), 10.0))


def test_fused_positional_only_and_keyword_only_parameters_keep_their_rules():
    """A @fused function's `/` and `*` parameters are bound by Python's rules, not placed."""
    import fusegen

    @fusegen.fused(name="err_kinds")
    def kinds(a, /, b, *, c):
        return a * b + c

    x = torch.full((3,), 2.0)
    torch.testing.assert_close(kinds(x, b=x, c=x), torch.full((3,), 6.0))
    with pytest.raises(TypeError, match="too many positional arguments"):
        kinds(x, x, x)
    with pytest.raises(TypeError, match="'a' parameter is positional only"):
        kinds(a=x, b=x, c=x)


def test_an_unexpected_keyword_is_named_before_a_missing_one(corpus_ops, decorated_fma):
    """`fma(a=, b=, d=)`: the misspelt keyword is the culprit, not the 'c' it left out."""
    for op, who in ((corpus_ops["cp_fma"], "fusegen op 'cp_fma'"), (decorated_fma, "@fused function 'err_fma'")):
        with pytest.raises(TypeError) as info:
            op(a=f, b=f, d=f)
        text = str(info.value)
        assert f"{who}: unexpected keyword argument 'd'; expected" in text and "(a, b, c)" in text, text
        assert "missing" not in text
        with pytest.raises(TypeError, match="unexpected keyword arguments 'd', 'e'"):
            op(a=f, b=f, d=f, e=f)


@pytest.fixture
def decorated_fma():
    import fusegen

    @fusegen.fused(name="err_fma")
    def err_fma(a, b, c):
        return a * b + c

    return err_fma


def test_raw_op_wrong_number_of_arguments(corpus_ops):
    with pytest.raises(RuntimeError, match=r"fusegen::cp_fma.*missing value for argument 'c'"):
        torch.ops.fusegen.cp_fma(f, f)


@pytest.mark.parametrize("value", [torch.tensor([1.0, 2.0]), "1.0", None])
def test_scalar_given_a_tensor_or_non_number(corpus_ops, value):
    op = corpus_ops["cp_swish_beta"]
    with pytest.raises((RuntimeError, TypeError)) as info:
        op(f, f, beta=value, alpha=2.0)
    message = str(info.value)
    assert "fusegen::cp_swish_beta" in message and "'beta'" in message


def test_scalar_given_a_zero_dim_tensor_works_like_eager(corpus_ops):
    """Observed: a 0-d tensor is accepted for a `float` argument (the dispatcher converts
    it), and gives the eager result."""
    op = corpus_ops["cp_swish_beta"]
    x, y = torch.randn(5), torch.randn(5)
    torch.testing.assert_close(op(x, y, torch.tensor(2.0), 0.5), x * torch.sigmoid(2.0 * x) + 0.5 * y)


def test_raw_op_tensor_argument_given_a_number(corpus_ops):
    """torch.ops.fusegen.<name> takes tensors only (the dispatcher's rule for custom ops);
    FusedOp and @fused wrap numbers (tests/test_layouts.py)."""
    with pytest.raises(RuntimeError) as info:
        torch.ops.fusegen.cp_fma(1.0, f, f)
    assert "fusegen::cp_fma" in str(info.value) and "'a'" in str(info.value)


def test_device_mismatch_names_both_arguments(corpus_ops):
    with pytest.raises(RuntimeError) as info:
        corpus_ops["cp_fma"](f, f.to("meta"), f)
    message = str(info.value)
    assert "fusegen::cp_fma: argument 'b' is on meta, expected cpu (the device of 'a')" in message


def test_none_for_a_tensor_names_op_and_argument(corpus_ops):
    with pytest.raises((RuntimeError, TypeError)) as info:
        corpus_ops["cp_fma"](None, f, f)
    assert "cp_fma" in str(info.value) and "'a'" in str(info.value)

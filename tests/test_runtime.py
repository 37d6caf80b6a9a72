"""The shared runtime's host fp16/bf16 conversions (fusegen-runtime.h) round exactly as
c10::Half and c10::BFloat16 do: an op computes in float and stores, so `a + b` in fp16 or
bf16 must equal eager's `(a.float() + b.float()).to(dtype)` bit for bit, ties to even,
subnormals, overflow to inf and NaN included."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_bf16_rounding_matches_c10(corpus_ops, dtype):
    g = torch.Generator().manual_seed(5)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 6e-8, 3e-5,
                            65504.0, 65519.0, 65520.0, 70000.0, 3e38, -1e-45, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11])
    # Random float32 values: their sums land between representable fp16/bf16 values.
    a = torch.cat([torch.randn(1 << 16, generator=g) * 100, special]).to(dtype)
    b = torch.cat([torch.randn(1 << 16, generator=g) * 1e-3, torch.zeros_like(special)]).to(dtype)
    # a + b in float, then one rounding: compare with a float32 `a + b` rounded by c10.
    got = corpus_ops["cp_add"](a, b)
    want = (a.float() + b.float()).to(dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_every_dtype_pair_promotes_like_eager(corpus_ops):
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    for da in dtypes:
        for db in dtypes:
            a, b = torch.randn(5, dtype=da), torch.randn(5, dtype=db)
            out = corpus_ops["cp_add"](a, b)
            assert out.dtype == torch.result_type(a, b), (da, db)

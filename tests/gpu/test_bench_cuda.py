"""`fusegen bench` on the GPU: every peer it races computes what fusegen computes (a
benchmark of a wrong kernel would be worthless), and a tiny run has the CUDA columns.

    PYTHONPATH=. python -m pytest -m cuda tests/gpu/test_bench_cuda.py
"""

from __future__ import annotations

import json

import pytest
import torch

from fusegen.bench import core as bench
from fusegen.bench.command import main as bench_command
from fusegen.bench.peers import build_impls, optional_module

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (4e-2, 4e-2), torch.float16: (1e-2, 1e-2)}  # eager rounds per op


@pytest.fixture(scope="module")
def cases():
    return bench.make_cases([])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_peer_computes_the_op(cases, dtype):
    wanted = ["fusegen", "eager", "compile", "jiterator", "cupy"]
    for case in cases:
        impls, skipped = build_impls(case.op, case.text, dtype, "cuda", wanted, static_compile=False)
        assert "jiterator" in impls, skipped.get("jiterator")
        if optional_module("cupy") is not None and dtype != torch.bfloat16:
            assert "cupy" in impls, skipped.get("cupy")
        xs = [torch.randn(4099, dtype=dtype, device="cuda") for _ in case.op.entry.inputs]
        want = impls["fusegen"].forward(*xs)
        for name, impl in impls.items():
            got = torch.as_tensor(impl.forward(*impl.prepare(xs)), device="cuda")
            rtol, atol = TOLERANCE[dtype]
            torch.testing.assert_close(got.to(dtype), want, rtol=rtol, atol=atol, msg=f"{case.label} {name}")


def test_a_tiny_run_has_the_cuda_columns(tmp_path):
    out = tmp_path / "bench.json"
    assert bench_command(["a*b+c", "--sizes", "2^12,2^16", "--dtypes", "fp32,bf16", "--budget", "0.002",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    impls = {(r["dtype"], r["direction"], r["impl"]) for r in result["rows"]}
    for dtype in ("float32", "bfloat16"):
        assert {(dtype, "fwd", i) for i in ("fusegen", "eager", "compile", "jiterator")} <= impls
        assert {(dtype, "fwd+bwd", i) for i in ("fusegen", "eager", "compile")} <= impls
    small = [r for r in result["rows"] if r["n"] == 1 << 12]
    assert all(r["calls_per_sample"] > 1 for r in small)  # rotated: 2^12 elements sit in L2 otherwise
    assert result["device"]["kind"] == "cuda" and result["settings"]["l2_bytes"] > 0

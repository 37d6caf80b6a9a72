"""On a GPU: the NVRTC route (the default for an op built in the process) and the nvcc route
compute the same bits, in every dtype and through every kernel kind; a kernel is compiled
on its first launch only (an fp32 forward compiles one kernel, never a backward or a
16-bit one), and a later process loads its cubin from the cache and compiles nothing.
A damaged cubin is compiled again, never loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fusegen
from fusegen.build import builder

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]

# (expression, scalars): plain arithmetic, transcendentals (the math library, where
# contraction or a different libdevice would show first), a scalar, a comparison.
EXPRESSIONS = [
    ("a*b + c", {}),
    ("tanh(a) * sigmoid(b) + exp(-c) * alpha", {"alpha": 0.37}),
    ("where(a > b, sqrt(abs(a)) / (1 + b*b), log1p(abs(c)))", {}),
]


def _layouts(dtype):
    """(name, a, b, c): inputs that send the forward and the backward through each kernel
    kind: contiguous, misaligned (strided), transposed (tiled), a broadcast bias (vector,
    and the accumulating backward), a sliced input (vector with gathers)."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    return [
        ("contiguous", r(4096, 257), r(4096, 257), r(4096, 257)),
        ("misaligned", r(1 << 16 | 1)[1:], r(1 << 16), r(1 << 16)),
        ("transposed", r(512, 384).t(), r(384, 512), r(384, 512)),
        ("broadcast", r(2048, 1024), r(1024), r(2048, 1024)),
        ("sliced", r(1024, 2050)[:, 1:1025], r(1024, 1024), r(1024, 1024)),
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _run(op, scalars, a, b, c):
    inputs = [t.detach().requires_grad_() for t in (a, b, c)]
    out = op(*inputs, **scalars)
    out.backward(torch.ones_like(out) * 0.5)
    torch.cuda.synchronize()
    return [out] + [t.grad for t in inputs]


def _both(ops, scalars, a, b, c):
    """Each route's results. A broadcast input's gradient is summed in the backward kernel
    with atomics (accumulating_kernel), whose order varies from run to run on either route:
    those run under torch's deterministic mode, where the sums are ATen's."""
    deterministic = any(t.stride(0) == 0 for t in torch.broadcast_tensors(a, b, c))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic or previous)
    try:
        return _run(ops["nvcc"], scalars, a, b, c), _run(ops["nvrtc"], scalars, a, b, c)
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index", range(len(EXPRESSIONS)))
def test_nvrtc_and_nvcc_routes_agree_bit_for_bit(monkeypatch, dtype, index):
    expr, scalars = EXPRESSIONS[index]
    ops = {}
    for route in ("nvcc", "nvrtc"):
        monkeypatch.setenv("FUSEGEN_CUDA_COMPILER", route)
        ops[route] = fusegen.fuse(expr, name=f"rtc_{route}_{index}", inputs=["a", "b", "c"],
                                  scalars=list(scalars))
    for layout, a, b, c in _layouts(dtype):
        want, got = _both(ops, scalars, a, b, c)
        for k, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and g.stride() == w.stride(), (layout, k)
            assert torch.equal(_bits(g), _bits(w)), f"{expr} {dtype} {layout}: result {k} differs"
    # The accumulating kernel itself on the NVRTC route: the broadcast bias's gradient, as
    # eager sums it.
    _, a, b, c = _layouts(dtype)[3]
    got = _run(ops["nvrtc"], scalars, a, b, c)[2]
    want = _run(ops["nvcc"], scalars, a, b, c)[2]
    torch.testing.assert_close(got, want, rtol=1e-2 if dtype.itemsize == 2 else 1e-4, atol=1e-3)


def _script(body: str) -> str:
    return textwrap.dedent("""
        import json, torch, fusegen
        from fusegen.build import builder
        op = fusegen.fuse("a*b + tanh(c)", name="rtc_lazy", inputs=["a", "b", "c"])
    """) + textwrap.dedent(body) + "\nprint(json.dumps(builder.rtc_events()))\n"


def _process(cache: Path, body: str) -> tuple[list[str], str]:
    env = dict(os.environ, FUSEGEN_CACHE_DIR=str(cache), FUSEGEN_CUDA_COMPILER="nvrtc",
               PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _script(body)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


FP32_FORWARD = """
    x = torch.randn(1 << 20, device="cuda")
    op(x, x, x); torch.cuda.synchronize()
"""


def test_fp32_forward_compiles_one_kernel_and_a_later_process_none(tmp_path):
    events, _ = _process(tmp_path / "cache", FP32_FORWARD)
    assert events == ["compiled fusegen::contiguous_kernel<float, 4, fusegen::op_rtc_lazy::Forward<float>>"]
    events, stderr = _process(tmp_path / "cache", FP32_FORWARD)
    assert events == ["loaded fusegen::contiguous_kernel<float, 4, fusegen::op_rtc_lazy::Forward<float>>"]
    assert "building" not in stderr  # the op's library too came from the cache
    # bf16 forward and backward: their kernels, compiled now; the fp32 one is not asked for.
    events, _ = _process(tmp_path / "cache", """
        x = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        op(x, x, x).sum().backward(); torch.cuda.synchronize()
    """)
    assert events and all(e.startswith("compiled ") and "BFloat16" in e for e in events), events
    assert any("Backward<float>" in e for e in events) and not any("<float, 4" in e for e in events)


def test_a_forward_that_records_its_backward_compiles_the_backward_kernel_beside_it(tmp_path):
    """A new op's first forward with inputs that require grad starts the backward kernels
    its loop suggests (the same kind and dtype for a dout laid out as the inputs, the vector
    kernel for a broadcast one) on threads of their own: their cubins land while the
    forward's result is awaited, and the backward of a sum uses the vector kernel's,
    compiling nothing more; a later process loads both kernels it uses."""
    body = """
        import os, time
        from pathlib import Path
        cubins = lambda: sorted(Path(os.environ["FUSEGEN_CACHE_DIR"]).glob("*/cubin/*.cubin"))
        a, b, c = (torch.randn(1 << 20, device="cuda", requires_grad=True) for _ in range(3))
        out = op(a, b, c); torch.cuda.synchronize()
        deadline = time.time() + 120
        while len(cubins()) < 3 and time.time() < deadline:
            time.sleep(0.01)
        assert len(cubins()) == 3, cubins()
        out.sum().backward(); torch.cuda.synchronize()
        assert len(cubins()) == 3, cubins()
    """
    forward = "fusegen::contiguous_kernel<float, 4, fusegen::op_rtc_lazy::Forward<float>>"
    backward = "fusegen::vector_kernel<float, 4, false, fusegen::op_rtc_lazy::Backward<float>>"
    events, _ = _process(tmp_path / "cache", body)
    assert events == [f"compiled {forward}", f"compiled {backward}"]
    events, _ = _process(tmp_path / "cache", body)
    assert events == [f"loaded {forward}", f"loaded {backward}"]


def test_a_damaged_cubin_is_compiled_again(tmp_path):
    cache = tmp_path / "cache"
    _process(cache, FP32_FORWARD)
    cubins = list(cache.glob("*/cubin/*.cubin"))
    assert len(cubins) == 1
    data = bytearray(cubins[0].read_bytes())
    data[-100] ^= 0xFF
    cubins[0].write_bytes(bytes(data))
    events, _ = _process(cache, FP32_FORWARD)
    assert events == ["compiled fusegen::contiguous_kernel<float, 4, fusegen::op_rtc_lazy::Forward<float>>"]
    assert cubins[0].read_bytes() != bytes(data)  # replaced by the new one


def test_step_op_through_nvrtc_matches_nvcc(monkeypatch):
    """A step op (in-place AdamW-like update over a list) on both routes: the same bits."""
    program = "m = 0.9*m + 0.1*g; p = p - lr*m/(sqrt(m*m) + 1e-8)"
    results = {}
    for route in ("nvcc", "nvrtc"):
        monkeypatch.setenv("FUSEGEN_CUDA_COMPILER", route)
        op = fusegen.fuse(program, name=f"rtc_step_{route}", inputs="p,g,m", scalars="lr")
        g = torch.Generator(device="cuda").manual_seed(1)
        ps, gs, ms = ([torch.randn(n, device="cuda", generator=g) for n in (1000, 70000, 3)] for _ in range(3))
        op.foreach(ps, gs, ms, lr=1e-2)
        torch.cuda.synchronize()
        results[route] = ps + ms
    for a, b in zip(results["nvcc"], results["nvrtc"]):
        assert torch.equal(_bits(a), _bits(b))

"""`fusegen bench` and `fusegen bench ffn` on the CPU at tiny sizes: every field of the
JSON, the tables, the plot, the peers that need CUDA reported as skipped; the sizes
syntax, the ideal byte counts, and the jiterator/CuPy sources (compiled with nvcc where it
is installed). Timing values are not checked: only that they are there."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess

import pytest

from fusegen.bench import core as bench
from fusegen.bench.command import main as bench_main

from fusegen.bench import report as bench_report
from fusegen.api import Request, generate
from fusegen.bench.peers import cupy_body, jiterator_source, nvrtc_preamble


def spec_of(text: str):
    return generate(Request(text, name="bench_probe")).spec


def test_sizes_lists_powers_and_ranges():
    assert bench.parse_sizes("4096,2^20") == [4096, 1 << 20]
    assert bench.parse_sizes("2^12..2^16") == [1 << 12, 1 << 14, 1 << 16]
    assert bench.parse_sizes("2^12..2^28:16") == [1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 28]
    assert bench.parse_sizes(bench.DEFAULT_SIZES["cuda"]) == [1 << e for e in range(12, 29, 2)]
    assert bench.parse_sizes(bench.QUICK_SIZES) == [1 << e for e in range(12, 29, 4)]
    for bad in ("2^x", "0", "2^12..2^16:1", ""):
        with pytest.raises(Exception, match="size|step|positive"):
            bench.parse_sizes(bad)


@pytest.mark.parametrize("text, tensors", [
    ("a*b+c", {"fwd": 4, "fwd+bwd": 9}),           # backward reads g, a, b; writes ga, gb; gc is g
    ("(x+y)*w", {"fwd": 4, "fwd+bwd": 10}),        # gx == gy: written once
    ("relu(x+y)", {"fwd": 3, "fwd+bwd": 7}),
    ("x*sigmoid(x)", {"fwd": 2, "fwd+bwd": 5}),
    ("a+b", {"fwd": 3, "fwd+bwd": 3}),             # both gradients are g itself: no backward bytes
])
def test_moved_tensors_count_an_ideal_fused_op(text, tensors):
    assert bench.moved_tensors(spec_of(text)) == tensors


def test_bad_arguments_are_one_line(capsys):
    from fusegen.tools.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--sizes", "2^x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("fusegen: error:") and "2^x" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):
        main(["bench", "--impls", "fusegen,numba"])
    assert "unknown implementation numba" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys, tmp_path):
    """Measuring goes on without the plot (GPU time is what costs); a report has nothing else to do."""
    monkeypatch.setattr(bench_report, "pyplot", lambda: None)
    out, png = tmp_path / "b.json", tmp_path / "p.png"
    assert bench_main(["a*b+c", "--device", "cpu", "--sizes", "2^10", "--impls", "fusegen", "--no-host",
                       "--budget", "0.001", "--json", str(out), "--plot", str(png)]) == 0
    assert "pip install 'fusegen[bench]'" in capsys.readouterr().err
    assert out.is_file() and not png.exists()
    assert bench_main(["--report", str(out), "--plot", str(png)]) == 2
    assert "pip install 'fusegen[bench]'" in capsys.readouterr().err


def test_bench_on_the_cpu_writes_every_field(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    plot = ["--plot", str(png)] if bench_report.pyplot() is not None else []
    code = bench_main(["a*b+c", "relu(x+y)", "--device", "cpu", "--sizes", "2^10,2^12", "--dtypes", "fp32,bf16",
                       "--impls", "fusegen,eager,jiterator,cupy", "--budget", "0.001", "--json", str(out), *plot])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["fusegen_bench"] == 1 and result["device"]["kind"] == "cpu"
    assert result["settings"]["sizes"] == [1 << 10, 1 << 12] and result["settings"]["compile"] == "dynamic"
    assert [(e["label"], e["tensors"]) for e in result["exprs"]] == [
        ("fma", {"fwd": 4, "fwd+bwd": 9}), ("relu_add", {"fwd": 3, "fwd+bwd": 7})]

    keys = {(r["expr"], r["dtype"], r["n"], r["direction"], r["impl"]) for r in result["rows"]}
    assert keys == {(e, d, n, k, i) for e in ("fma", "relu_add") for d in ("float32", "bfloat16")
                    for n in (1 << 10, 1 << 12) for k in ("fwd", "fwd+bwd") for i in ("fusegen", "eager")}
    for r in result["rows"]:
        assert r["ms"] > 0 and r["gbs"] > 0 and r["pct_copy"] > 0 and r["samples"] >= 5
        assert r["calls_per_sample"] == 1  # no rotation on the CPU
    assert {(s["expr"], s["dtype"], s["impl"], s["reason"]) for s in result["skipped"]} == {
        (e, d, i, "needs CUDA") for e in ("fma", "relu_add") for d in ("float32", "bfloat16")
        for i in ("jiterator", "cupy")}
    assert {c["bytes"] for c in result["copy"]} == {t * n * es for t in (3, 4, 7, 9) for n in (1 << 10, 1 << 12)
                                                    for es in (2, 4)}

    summary = {(s["expr"], s["dtype"], s["n"], s["direction"]): s for s in result["summary"]}
    assert set(summary) == {k[:4] for k in keys}
    for s in summary.values():
        assert s["best_peer"] == "eager" and s["vs_best"] == pytest.approx(s["fusegen_ms"] / s["best_peer_ms"])
        assert s["speedup"]["eager"] == pytest.approx(1 / s["vs_best"])

    host = result["host"]
    assert host["n"] == bench.HOST_N and host["target"] == bench.HOST_TARGET
    assert host["floor"]["fwd"]["us"] > 0 and host["floor"]["fwd+bwd"]["us"] > 0
    assert {(r["expr"], r["impl"], r["direction"]) for r in host["rows"]} == {
        (e, i, k) for e in ("fma", "relu_add") for i in ("fusegen", "fusegen.op", "eager") for k in ("fwd", "fwd+bwd")}
    for r in host["rows"]:  # paired batches: the ratio is the median of the pairs', the floor the median of all
        assert r["dtype"] == "float32" and len(r["samples_us"]) == len(r["floor_samples_us"]) == host["pairs"]
        assert r["us"] == statistics.median(r["samples_us"]) and r["floor_us"] == statistics.median(r["floor_samples_us"])
        assert r["vs_floor"] == pytest.approx(statistics.median(a / b for a, b in zip(r["samples_us"], r["floor_samples_us"])))
    for d in ("fwd", "fwd+bwd"):
        pooled = [us for r in host["rows"] if r["direction"] == d for us in r["floor_samples_us"]]
        assert host["floor"][d]["us"] == statistics.median(pooled)

    shown = capsys.readouterr()
    assert "| expr | fusegen | eager | fusegen / best peer |" in shown.out
    assert "host µs per call" in shown.out and "skipped  jiterator (fma float32): needs CUDA" in shown.out
    assert "bench 48/48 (100 %)" in shown.err  # the counter, stderr not being a terminal
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the tables again from the JSON alone, measuring nothing
    assert bench_main(["--report", str(out)]) == 0
    assert "| expr | fusegen | eager | fusegen / best peer |" in capsys.readouterr().out


def test_ffn_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "ffn.json"
    assert bench_main(["ffn", "--device", "cpu", "--tokens", "16", "--dim", "8", "--hidden", "16", "--dtypes", "fp32",
                       "--impls", "fusegen,eager,functional,liger", "--directions", "fwd,fwd+bwd", "--reps", "2",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    keys = {(r["case"], r.get("layout"), r["direction"], r["impl"]) for r in result["rows"]}
    impls = ("fusegen", "eager", "functional")
    assert keys == ({(f"block {b}", None, "fwd+bwd", i) for b in ("gelu", "swiglu") for i in impls}
                    | {(f"{a} alone", layout, k, i) for a in ("swiglu", "geglu") for layout in ("separate", "chunk")
                       for k in ("fwd", "fwd+bwd") for i in impls})
    assert all(r["ms"] > 0 and r["dtype"] == "float32" for r in result["rows"])
    assert {(s["case"], s["impl"], s["reason"]) for s in result["skipped"]} == {
        (c, "liger", "needs CUDA") for c in ("block swiglu", "swiglu alone", "geglu alone")}
    assert "| case | layout | dtype | direction | fusegen | eager | functional |" in capsys.readouterr().out


NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_peer_sources_compile(tmp_path):
    """The jiterator entry function and the CuPy body, with fusegen's helpers as their
    preamble, compile warning-free (nvcc here; NVRTC on the GPU machine), instantiated for
    float storage as a kernel calls them."""
    sources = []
    for i, text in enumerate(bench.SEEDS.values()):
        spec = generate(Request(text, name=f"bench_probe{i}")).spec
        k = len(spec.inputs)
        reads = ", ".join(f"in{j}[0]" for j in range(k))
        params = ", ".join(f"const float* in{j}" for j in range(k))
        # jiterator compiles with NVRTC's -default-device: its unannotated entry is device code
        entry = jiterator_source(spec).replace("template <typename T> T", "template <typename T> __device__ T")
        sources.append(f"{entry}\n__global__ void jit{i}({params}, float* out) "
                       f"{{ out[0] = fusegen_bench_{spec.name}<float>({reads}); }}\n")
        names, lines = cupy_body(spec)
        loads = " ".join(f"const float {name} = in{j}[0];" for j, name in enumerate(names))
        body = "\n  ".join(lines)
        sources.append(f"{nvrtc_preamble()}\n__global__ void cupy{i}({params}, float* result) "
                       f"{{\n  {loads}\n  float out;\n  {body}\n  result[0] = out;\n}}\n")
    # one translation unit (the helpers' include guard, as in a bundle of ops): one nvcc run
    cu = tmp_path / "peers.cu"
    cu.write_text("\n".join(sources))
    run = subprocess.run([NVCC, "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-Werror", "all-warnings",
                          "-c", str(cu), "-o", str(tmp_path / "peers.o")], capture_output=True, text=True)
    assert run.returncode == 0 and not run.stderr.strip(), f"{cu.read_text()}\n{run.stderr}"


def test_a_failing_peer_is_reported_once_and_the_run_goes_on(monkeypatch, tmp_path):
    """A peer that raises (a compile error on the GPU machine, say) is skipped with its
    reason, once per direction, not retried at every size; the others are measured."""
    from fusegen.bench import peers as bench_peers
    def with_a_broken_peer(op, text, dtype, device, wanted, static):
        impls, skipped = bench_peers.build_impls(op, text, dtype, device, [w for w in wanted if w != "compile"],
                                                 static)

        def broken(*args):
            raise RuntimeError("inductor exploded\nmore lines")

        impls["compile"] = bench_peers.Impl("compile", broken)
        return impls, skipped

    monkeypatch.setattr(bench, "build_impls", with_a_broken_peer)
    out = tmp_path / "b.json"
    assert bench_main(["a*b+c", "--device", "cpu", "--sizes", "2^10,2^11,2^12", "--dtypes", "fp32",
                       "--impls", "fusegen,compile", "--no-host", "--budget", "0.001", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(s["impl"], s["direction"], s["n"], s["reason"]) for s in result["skipped"]] == [
        ("compile", "fwd", 1 << 12, "RuntimeError: inductor exploded"),
        ("compile", "fwd+bwd", 1 << 12, "RuntimeError: inductor exploded")]
    assert {(r["impl"], r["n"]) for r in result["rows"]} == {("fusegen", n) for n in (1 << 10, 1 << 11, 1 << 12)}
    assert result["summary"] == []  # no peer measured: no ratio

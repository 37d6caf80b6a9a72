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
import torch

from fusegen.bench import core as bench
from fusegen.bench.command import main as bench_command
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
    assert bench.parse_sizes(bench.QUICK_SIZES["cuda"]) == [1 << e for e in range(12, 29, 4)]
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


@pytest.mark.slow  # builds its two ops
def test_bench_cpu_has_fp16_bf16_rows_against_eager(tmp_path, capsys):
    """`fusegen bench cpu` in fp16/bf16: x*sigmoid(x) (against F.silu) and a*b+c, each size
    and thread count, forward and forward+backward, fusegen's and eager's medians and the
    ratio, in the JSON and the table."""
    out = tmp_path / "cpu.json"
    bench_command(["cpu", "--dtypes", "float16,bfloat16", "--sizes", "2^10,2^11", "--threads", "1,2", "--reps", "2",
                "--json", str(out)])
    rows = json.loads(out.read_text())["half_rows"]
    assert [(r["expr"], r["dtype"], r["n"], r["threads"]) for r in rows] == [
        (e, d, n, t) for d in ("float16", "bfloat16") for e in ("x*sigmoid(x)", "a*b+c")
        for n in (1 << 10, 1 << 11) for t in (1, 2)]
    keys = [f"{i} {k}" for i in ("fusegen", "eager", "ratio") for k in ("fwd", "fwd+bwd")]
    assert all(r[k] > 0 for r in rows for k in keys)
    text = capsys.readouterr().out
    assert "fwd+bwd / eager" in text and "| a*b+c | bfloat16 | 2^11 | 2 |" in text


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
        assert r["ms"] > 0 and r["gbs"] > 0 and r["pct_copy"] > 0 and r["samples"] >= 5 and r["spread_pct"] >= 0
        assert r["calls_per_sample"] == 1  # no rotation on the CPU
    assert {(s["expr"], s["dtype"], s["impl"], s["reason"]) for s in result["skipped"]} == {
        (e, d, i, "needs CUDA") for e in ("fma", "relu_add") for d in ("float32", "bfloat16")
        for i in ("jiterator", "cupy")}
    assert all(c["spread_pct"] >= 0 for c in result["copy"])
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
    assert "median ms ±spread (% of copy rate)" in shown.out and " ±" in shown.out
    assert "issue" not in shown.out.lower()
    assert "host µs per call" in shown.out and "skipped  jiterator (fma float32): needs CUDA" in shown.out
    assert "bench 48/48 (100 %)" in shown.err  # the counter, stderr not being a terminal
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the tables again from the JSON alone, measuring nothing
    assert bench_main(["--report", str(out)]) == 0
    assert "| expr | fusegen | eager | fusegen / best peer |" in capsys.readouterr().out


def test_quick_stays_small_on_the_cpu():
    """--quick on a CPU: 2^12, 2^16, 2^20 in fp32 (2^28, 1 GiB tensors, took over half an
    hour on 2 cores); on CUDA every 16x up to 2^28 in every dtype; --sizes/--dtypes win."""
    parse = bench._parser(()).parse_args
    assert bench.plan(parse(["--quick"]), "cpu") == ([1 << 12, 1 << 16, 1 << 20], ["fp32"], bench.QUICK_BUDGET["cpu"])
    sizes, dtypes, budget = bench.plan(parse(["--quick"]), "cuda")
    assert sizes == [1 << e for e in range(12, 29, 4)] and dtypes == ["fp32", "bf16", "fp16"] and budget == 0.04
    assert bench.plan(parse(["--quick", "--dtypes", "bf16", "--sizes", "2^10"]), "cpu")[:2] == ([1 << 10], ["bf16"])
    assert bench.plan(parse(["--quick", "--budget", "0.5"]), "cpu")[2] == 0.5
    assert bench.plan(parse([]), "cpu") == ([1 << e for e in range(12, 21, 2)], ["fp32", "bf16", "fp16"], 0.1)
    assert max(bench.quick_plan("cpu")["sizes"]) <= 1 << 20


def test_spread_is_half_the_interquartile_range():
    assert bench.spread_pct([2.0] * 5) == 0
    assert bench.spread_pct([1, 2, 3, 4, 5]) == pytest.approx(100 * (4 - 2) / 2 / 3)
    assert bench.spread_pct([1, 1, 1, 1, 100]) == 0  # one slow sample does not count
    assert bench.spread_pct([3.0]) == 0
    assert bench_report.with_spread(0.12345, 4.4) == "0.1235 ±4%"
    assert bench_report.with_spread(12.0, 0.2) == "12 ±0%"
    assert bench_report.with_spread(0.5, None) == "0.5"  # a JSON written before spreads were kept


def _result(rows, copy=(), summary=()):
    return {"fusegen_bench": 1, "date": "2026-01-01T00:00:00Z", "fusegen": "0",
            "device": {"kind": "cpu", "name": "test", "torch": torch.__version__, "cuda": None},
            "settings": {"dtypes": ["float32"], "compile": "dynamic", "directions": ["fwd"]},
            "exprs": [{"label": "fma", "expr": "a*b+c", "tensors": {"fwd": 4}}],
            "rows": list(rows), "copy": list(copy), "summary": list(summary), "skipped": [], "host": None}


def _row(impl, ms, pct=90.0, spread=3.0):
    return {"expr": "fma", "dtype": "float32", "n": 4096, "direction": "fwd", "impl": impl, "ms": ms,
            "gbs": 1.0, "pct_copy": pct, "samples": 5, "spread_pct": spread, "calls_per_sample": 1}


def test_implausible_figures_are_warned(capsys):
    """A loaded machine once printed 3718 % of the copy rate and ratios of 0.00 silently."""
    good = _result([_row("fusegen", 0.010), _row("eager", 0.020)], copy=[{"bytes": 65536, "ms": 0.009, "spread_pct": 2}],
                   summary=bench.summarize([_row("fusegen", 0.010), _row("eager", 0.020)]))
    assert bench_report.implausible(good) == []
    bench_report.print_report(good)
    out = capsys.readouterr().out
    assert "warning" not in out and "| fma | 0.01 ±3% (90%) | 0.02 ±3% (90%) | 0.50 (eager) |" in out

    rows = [_row("fusegen", 0.010, pct=3718), _row("eager", 0.0), _row("compile", 40.0, spread=60)]
    bad = _result(rows, copy=[{"bytes": 65536, "ms": 0.37, "spread_pct": 80}], summary=bench.summarize(rows))
    lines = bench_report.implausible(bad)
    assert any("fma float32 n=2^12 fwd fusegen: 3718% of the copy rate" in w for w in lines)
    assert any("eager: 0 ms per call is too fast to be real" in w for w in lines)
    assert any("compile: samples spread ±60% over 5 samples" in w for w in lines)
    assert any("copy of 65536 bytes" in w and "±80%" in w for w in lines)
    assert any("fusegen / best peer" in w and "implausible" in w for w in lines)  # 0.010 / 0.0
    bench_report.print_report(bad)
    out = capsys.readouterr().out
    assert f"warnings: {len(lines)} figure(s) look implausible" in out
    assert out.count("  warning  ") == len(lines)


def test_many_warnings_are_counted_not_listed(capsys):
    bench_report.print_warnings([f"w{i}" for i in range(bench_report.SHOWN_WARNINGS + 5)])
    out = capsys.readouterr().out
    assert out.count("  warning  ") == bench_report.SHOWN_WARNINGS and "... and 5 more" in out


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


def test_dropout_on_the_cpu(tmp_path, capsys):
    """`fusegen bench dropout`: every implementation and both references time a step in
    each dtype, with ratios against eager and torch.compile."""
    out = tmp_path / "dropout.json"
    assert bench_main(["dropout", "--device", "cpu", "--shapes", "64x128", "--dtypes", "fp32,bf16",
                       "--reps", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    from fusegen.bench.dropout import IMPLS
    assert [(r["shape"], r["dtype"]) for r in result["rows"]] == [
        ("64x128", "float32"), ("64x128", "bfloat16")]
    for row in result["rows"]:
        assert all(row[k]["ms"] > 0 and row[k]["copy_pct"] > 0 for k in IMPLS)
        assert row["fusegen/eager"] == row["fusegen"]["ms"] / row["eager"]["ms"]
    assert "fusegen, no draws" in capsys.readouterr().out


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


def test_interleaved_ms_reverses_the_turns_and_repeats_short_calls_more():
    """`bench cpu`'s timing: neighbours stay neighbours with neither always first, a short
    call gets up to 10x the repeats asked for, a long one just those, and the garbage
    collector is back on afterwards."""
    import gc
    import time

    from fusegen.bench.layouts import interleaved_ms

    seen = []
    fns = {"a": lambda: seen.append("a"), "b": lambda: seen.append("b")}
    ms = interleaved_ms(fns, reps=3, warm=0, sample_s=1e-9, min_total_s=1.0)
    calibration = 2 * 11  # one call, then ten more (a short call), each function
    assert seen[calibration:calibration + 6] == ["a", "b", "b", "a", "a", "b"]
    assert len(ms["a"]) == len(ms["b"]) == 30 and all(t > 0 for t in ms["a"] + ms["b"])
    assert gc.isenabled()
    slow = interleaved_ms({"s": lambda: time.sleep(2e-3)}, reps=3, warm=0, sample_s=1e-9, min_total_s=1e-3)
    assert len(slow["s"]) == 3 and min(slow["s"]) >= 2.0

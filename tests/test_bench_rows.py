"""`fusegen bench rows` on the CPU: a --quick run measures every op with every
implementation that runs here, says why each other one did not (Liger Kernel needs CUDA),
and each peer computes what fusegen computes."""

from __future__ import annotations

import json

from fusegen.bench import rows as bench_rows
from fusegen.bench.command import SUBCOMMANDS


def test_a_quick_run_measures_every_op_and_impl(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench_rows.main(["--quick", "--device", "cpu", "--reps", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"]["kind"] == "cpu"
    assert result["settings"]["shapes"] == [list(bench_rows.QUICK_SHAPE["cpu"])]
    measured = {(r["op"], r["impl"]) for r in result["rows"]}
    skipped = {(s["op"], s["impl"]): s["reason"] for s in result["skipped"]}
    for op in bench_rows.OPS:
        for impl in bench_rows.IMPLS:
            assert (op, impl) in measured or skipped.get((op, impl)), f"{op} {impl}: not run, not skipped"
        assert {"fusegen", "eager", "compile"} <= {i for o, i in measured if o == op}, skipped
        assert "CUDA" in skipped[(op, "liger")]
    rows_, hidden = bench_rows.QUICK_SHAPE["cpu"]
    for r in result["rows"]:
        assert r["ms"] > 0 and r["min"] <= r["ms"] <= r["max"] and r["samples"] == 2
        assert r["bytes"] == result["passes"][r["op"]] * rows_ * hidden * 4 and r["pct_copy"] > 0
        assert r["error"] < 1e-4, r  # fp32 against float64 eager
    assert {s["op"] for s in result["summary"]} == set(bench_rows.OPS)
    assert all(set(s["fusegen_over"]) == {"eager", "compile"} for s in result["summary"])
    table = capsys.readouterr().out
    assert "| op | dtype | rows x hidden | fusegen | eager | compile |" in table
    assert "skipped  liger" in table


def test_rows_is_a_subcommand():
    assert "rows" in SUBCOMMANDS

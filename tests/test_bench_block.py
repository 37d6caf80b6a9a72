"""`fusegen bench block` on the CPU: the tiny float32 decoder takes its training steps with
every variant that runs here, each from the same weights to eager's losses, and each other
variant is listed with the reason it did not run (Liger Kernel needs CUDA). The torch.compile
variants compile a whole training step, most of a minute on two cores: the default run
leaves them out with --no-compile, the slow run measures them."""

from __future__ import annotations

import json
import math

import pytest

from fusegen.bench import block
from fusegen.bench.command import SUBCOMMANDS


def _run(tmp_path, *extra) -> dict:
    out = tmp_path / "block.json"
    assert block.main(["--device", "cpu", "--steps", "2", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def _check(result: dict, measured: set[str]):
    rows = {r["variant"]: r for r in result["rows"]}
    skipped = {s["variant"]: s["reason"] for s in result["skipped"]}
    for variant in block.VARIANTS:
        assert variant in rows or skipped.get(variant), f"{variant}: neither measured nor skipped"
    assert set(rows) == measured, skipped
    assert result["dtype"] == "float32" and result["config"] == block.asdict(block.CPU_CONFIG)
    eager = rows["eager"]["losses"]
    assert len(eager) == result["check_steps"] == 20 and eager[-1] < eager[0]  # it learns the batch
    for r in rows.values():
        assert 0 < r["min"] <= r["ms"] <= r["max"] and r["samples"] == 2 and r["tokens_per_s"] > 0
        assert all(math.isfinite(x) for x in r["losses"]), r
        assert r["loss_max_rel_diff"] < 1e-4 and r["loss_ok"], r  # fp32: rounding only
        assert r["speedup"] > 0
    return skipped


def test_every_variant_is_measured_or_skipped_with_its_reason(tmp_path, capsys):
    skipped = _check(_run(tmp_path, "--no-compile"), {"eager", "fusegen"})
    assert "CUDA" in skipped["liger"]
    assert "--no-compile" in skipped["compile"] and "--no-compile" in skipped["fusegen+compile"]
    out = capsys.readouterr().out
    assert "| variant | ms per step | min..max | tokens/s | speed-up over eager |" in out
    assert "skipped  liger" in out


@pytest.mark.slow
def test_the_compiled_models_train_as_eager(tmp_path):
    skipped = _check(_run(tmp_path, "--variants", "compile,fusegen+compile"),
                     {"eager", "compile", "fusegen+compile"})
    assert skipped["fusegen"] == "not in --variants"


def test_a_loss_curve_off_eager_fails_the_check():
    rows = [{"variant": "eager", "ms": 2.0, "losses": [5.0, 4.0]},
            {"variant": "fusegen", "ms": 1.0, "losses": [5.0, 4.1]},
            {"variant": "liger", "ms": 1.0, "losses": [5.0, float("nan")]}]
    result = {"rows": rows, "rtol": 1e-4}
    block._check(result)
    assert rows[0]["loss_ok"] and rows[0]["speedup"] == 1.0
    assert not rows[1]["loss_ok"] and rows[1]["loss_max_rel_diff"] == pytest.approx(0.025)
    assert not rows[2]["loss_ok"] and rows[1]["speedup"] == 2.0


def test_block_is_a_subcommand():
    assert "block" in SUBCOMMANDS

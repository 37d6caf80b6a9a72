"""`fusegen bench block` on the CPU: the tiny float32 decoder takes its training steps with
every variant that runs here, each from the same weights to eager's losses, and to
gradients and a loss curve as close to float64's as eager's; each other variant is listed
with the reason it did not run (Liger Kernel needs CUDA). The torch.compile variants compile
a whole training step, most of a minute on two cores: the default run leaves them out with
--no-compile, the slow run measures them."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.profiler import profile

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
    assert len(result["float64_losses"]) == 20
    for r in rows.values():
        assert 0 < r["min"] <= r["ms"] <= r["max"] and r["samples"] == 2 and r["tokens_per_s"] > 0
        assert all(math.isfinite(x) for x in r["losses"]), r
        assert r["loss_max_rel_diff"] < 1e-4, r  # fp32: rounding only
        assert r["grad_ok"] and r["grad_worst"]["error"] < 1e-4, r
        assert r["loss_ok"] and r["loss_vs_float64"] < 1e-4, r
        assert set(r["grad_errors"]) == set(rows["eager"]["grad_errors"]) > {"loss", "head.weight", "norm"}
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


def test_a_gradient_or_loss_curve_further_from_float64_than_eager_fails_the_check():
    def row(variant, ms, errors, losses):
        return {"variant": variant, "ms": ms, "losses": list(losses), "grad_errors": errors}

    rows = [row("eager", 2.0, {"loss": 1e-3, "w": 1e-2, "n": 0.0}, (5.0, 4.2)),
            row("fusegen", 1.0, {"loss": 1e-3, "w": 1.9e-2, "n": 5e-4}, (5.0, 4.4)),  # within 2x + floor
            row("liger", 1.0, {"loss": 1e-3, "w": 1e-2, "n": 2e-3}, (5.0, 4.2)),      # n: past the floor
            row("compile", 1.0, {"loss": float("nan"), "w": 1e-2, "n": 0.0}, (5.0, 4.2)),
            row("fusegen+compile", 1.0, {"loss": 1e-3, "w": 1e-2, "n": 0.0}, (5.0, 4.8))]  # the curve
    result = {"rows": rows, "grad_multiplier": 2.0, "grad_floor": 1e-3, "loss_floor": 1e-2,
              "float64_losses": [5.0, 4.0]}
    block._check(result)
    assert [r["grad_ok"] for r in rows] == [True, True, False, False, True]
    assert [r["loss_ok"] for r in rows] == [True, True, True, True, False]
    assert rows[1]["loss_vs_float64"] == pytest.approx(0.1) and rows[0]["loss_vs_float64"] == pytest.approx(0.05)
    assert rows[1]["loss_max_rel_diff"] == pytest.approx(0.2 / 4.2) and rows[1]["speedup"] == 2.0
    assert rows[2]["grad_worst"] == {"name": "n", "error": 2e-3, "eager_error": 0.0}
    assert rows[3]["grad_worst"]["name"] == "loss"


def test_the_timed_steps_take_turns_and_a_failing_peer_leaves_the_rounds():
    """Each round runs every variant in turn, the order rotating, an untimed step before each
    variant's share of the steps: no variant is timed only at the run's end, after the GPU's
    clocks have drifted. A variant whose step fails is reported and the others go on."""
    calls, failures = [], []

    def running(name, fails=False):
        def step():
            if fails and len(calls) > 4:
                raise RuntimeError("out of memory")
            calls.append(name)
        return block._Running(name, None, None, step, {"variant": name, "times": []})

    variants = [running("eager"), running("compile"), running("liger", fails=True)]
    args = type("Args", (), {"rounds": 2, "steps": 3})()
    block.time_variants(variants, args, "cpu", lambda name, err: failures.append((name, str(err))))
    # round 1: an untimed step and two timed ones each, from eager (liger's first step fails);
    # round 2: an untimed step and one timed, from the second variant
    assert calls == ["eager"] * 3 + ["compile"] * 3 + ["compile"] * 2 + ["eager"] * 2
    assert [v.name for v in variants] == ["eager", "compile"]
    assert [len(v.row["times"]) for v in variants] == [3, 3]
    assert failures == [("liger", "out of memory")]


def _nodes(fn) -> list:
    """Every node of the autograd graph from `fn`."""
    seen, todo = [], [fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.append(node)
            todo.extend(n for n, _ in node.next_functions)
    return seen


def test_the_fusegen_rope_gets_its_halves_gradient_without_a_split_or_a_copy():
    """The fusegen variant rotates q and k before their transpose for the attention: the op's
    backward writes its halves' gradients into one tensor of q's shape, in the projection's
    own layout. Rotated after the transpose, q's gradient was copied back to that layout."""
    cfg = block.CPU_CONFIG
    model = block.Decoder(cfg, block.fusegen_kernels())
    model.load_state_dict(block.initial_weights(cfg, torch.float32, "cpu"))
    loss = model(*block.batch(cfg, "cpu"))
    ropes = [n for n in _nodes(loss.grad_fn) if "block_rope" in n.name()]
    assert len(ropes) == 2 * cfg.layers  # q and k in every layer
    for node in ropes:  # its edge goes past the split to q (or k) itself
        names = [n.name() for n, _ in node.next_functions if n is not None]
        assert names and not any(name.startswith("Split") for name in names), names
    with profile(record_shapes=True) as prof:
        loss.backward()
    events = prof.events()
    assert not [e for e in events if e.name == "aten::cat"]
    # (a copy of two dimensions is the cross-entropy's backward casting its (tokens, 1) labels)
    copies = [(e.name, e.input_shapes) for e in events
              if e.name in ("aten::clone", "aten::copy_") and any(len(s) > 2 for s in e.input_shapes)]
    assert not copies, copies


def test_block_is_a_subcommand():
    assert "block" in SUBCOMMANDS

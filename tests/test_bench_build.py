"""`fusegen bench build`'s report: the four figures against their targets."""

from __future__ import annotations

from fusegen.bench import build as bench_build


def _s(*values):
    return bench_build.summary([{"wall_s": v} for v in values])


def test_summary_is_median_and_spread():
    s = _s(3.0, 1.0, 2.0)
    assert (s["median_s"], s["min_s"], s["max_s"], s["runs"]) == (2.0, 1.0, 3.0, 3)


def test_targets_on_the_cpu_follow_torch_compile():
    results = {"new": _s(1.2, 1.4, 1.3) | {"fuse_median_s": 1.0, "first_forward_median_s": 1.2},
               "first": _s(12.0), "load": _s(0.015, 0.018, 0.03) | {"import_median_s": 0.01, "fuse_median_s": 0.008},
               "compile": _s(10.0, 9.0, 11.0)}
    rows = {figure: (target, words) for figure, _, words, target in bench_build.targets(results, "cpu")}
    assert rows["new op -> first fwd+bwd result"][0] == 0.15 * 10.0
    assert rows["first op ever (runtime built too)"][0] == 10.0
    assert rows["cached load (new process)"][0] == 0.020
    lines = bench_build.report(results, "cpu", (4.0, 0, 0), (5.0, 0, 0))
    met = {line.split("  ")[0]: line.split()[-1] for line in lines[2:6]}
    assert met == {"new op -> first fwd+bwd result": "yes", "first op ever (runtime built too)": "NO",
                   "cached load (new process)": "yes", "torch.compile first fwd+bwd call": "-"}
    assert "load average 4.0 before, 5.0 after" in lines[0]


def test_on_a_gpu_a_new_op_has_one_second():
    results = {"new": _s(1.5) | {"fuse_median_s": 1.0, "first_forward_median_s": 1.4}}
    (figure, _, words, target), = [t for t in bench_build.targets(results, "cuda") if t[1] is not None]
    assert target == 1.0 and "1.00 s" in words
    assert bench_build.report(results, "cuda", (0, 0, 0), (0, 0, 0))[2].endswith("NO")

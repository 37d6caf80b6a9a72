"""What `fusegen bench` shows of its result dict (bench.py): the progress over the runs,
the terminal tables (markdown, to paste as they are), each median with its spread, the
targets, warnings about figures that cannot be right, and the plot.
"""

from __future__ import annotations

import math
import sys
import time

import torch

from fusegen.bench.peers import IMPLS, optional_module

# The run-time targets, checked on the largest size measured:
# (direction, dtype, peers fusegen must not be slower than on any expression, geomean
#  speedup over torch.compile it must reach, or None).
TARGETS = (
    ("fwd", "float32", ("jiterator", "compile"), 1.10),
    ("fwd", "bfloat16", ("jiterator", "compile"), 1.10),
    ("fwd+bwd", "float32", ("compile", "eager"), 1.15),
    ("fwd+bwd", "bfloat16", ("compile", "eager"), 1.40),
)


# When a figure cannot be right (bench.py's timing on a loaded machine, or a broken timer):
MAX_PCT_COPY = 150       # faster than a device copy of the same bytes by more than 1.5x
MIN_MS = 5e-4            # under half a microsecond per call: nothing real is that fast
MAX_SPREAD_PCT = 25      # samples scattered by more than ±25 % of their median
RATIO_RANGE = (0.05, 20)  # fusegen / best peer outside this: one of the two times is off
SHOWN_WARNINGS = 12      # warnings printed in full; the rest are counted


def with_spread(ms: float, spread: float | None) -> str:
    """A median and its spread, `0.4898 ±1%` (the median alone when the JSON has no spread)."""
    if spread is None:
        return f"{ms:.4g}"
    return f"{ms:.4g} ±{spread:.0f}%" if math.isfinite(spread) else f"{ms:.4g} ±inf%"


def implausible(result: dict) -> list[str]:
    """One line per figure of the result that cannot be right: a time near zero, a time
    faster than the copy of the same bytes by more than MAX_PCT_COPY %, samples spread wider
    than MAX_SPREAD_PCT %, a copy baseline spread as wide, a fusegen / best peer ratio
    outside RATIO_RANGE. Empty when every figure is plausible."""
    lines = []
    for r in result.get("rows", []):
        where = f"{r['expr']} {r['dtype']} n={size_label(r['n'])} {r['direction']} {r['impl']}"
        if r["ms"] < MIN_MS:
            lines.append(f"{where}: {r['ms']:.3g} ms per call is too fast to be real (timer or sync problem)")
        elif r.get("pct_copy") and r["pct_copy"] > MAX_PCT_COPY:
            lines.append(f"{where}: {r['pct_copy']:.0f}% of the copy rate, faster than copying its bytes: "
                         "the copy baseline or this time is off (a loaded machine?)")
        if r.get("spread_pct") is not None and r["spread_pct"] > MAX_SPREAD_PCT:
            lines.append(f"{where}: samples spread ±{r['spread_pct']:.0f}% over {r.get('samples', '?')} "
                         "samples (a loaded machine?)")
    for c in result.get("copy", []):
        if c.get("spread_pct") is not None and c["spread_pct"] > MAX_SPREAD_PCT:
            lines.append(f"copy of {c['bytes']} bytes (the % of copy baseline): samples spread "
                         f"±{c['spread_pct']:.0f}% (a loaded machine?)")
        if c["ms"] < MIN_MS:
            lines.append(f"copy of {c['bytes']} bytes (the % of copy baseline): {c['ms']:.3g} ms is too fast "
                         "to be real")
    low, high = RATIO_RANGE
    for s in result.get("summary", []):
        if not low <= s["vs_best"] <= high:
            lines.append(f"{s['expr']} {s['dtype']} n={size_label(s['n'])} {s['direction']}: fusegen / best peer "
                         f"{s['vs_best']:.3g} ({s['fusegen_ms']:.3g} ms against {s['best_peer']}'s "
                         f"{s['best_peer_ms']:.3g} ms) is implausible: one of the two times is off")
    return lines


def print_warnings(lines, stream=None):
    stream = stream or sys.stdout
    if not lines:
        return
    print(f"\nwarnings: {len(lines)} figure(s) look implausible; rerun on an idle machine "
          "(or with a larger --budget)", file=stream)
    for line in lines[:SHOWN_WARNINGS]:
        print(f"  warning  {line}", file=stream)
    if len(lines) > SHOWN_WARNINGS:
        print(f"  ... and {len(lines) - SHOWN_WARNINGS} more", file=stream)


class Progress:
    """A bar over the planned measurements on stderr when it is a terminal (redrawn in
    place); elsewhere a counter line every 10 %, so a log stays short."""

    WIDTH = 30

    def __init__(self, total: int, stream=None):
        self.total, self.done = max(total, 1), 0
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.start = time.monotonic()
        self.shown = -1  # the last 10 % step printed (not live)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.live:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def advance(self, label: str, count: int = 1):
        self.done = min(self.total, self.done + count)
        elapsed = time.monotonic() - self.start
        if self.live:
            filled = self.WIDTH * self.done // self.total
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            self.stream.write(f"\r\033[K[{bar}] {self.done}/{self.total} {elapsed:4.0f} s  {label}")
            self.stream.flush()
        elif 10 * self.done // self.total > self.shown:
            self.shown = 10 * self.done // self.total
            self.stream.write(f"bench {self.done}/{self.total} ({100 * self.done // self.total} %), "
                              f"{elapsed:.0f} s: {label}\n")
            self.stream.flush()


def pyplot():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is absent."""
    matplotlib = optional_module("matplotlib")
    if matplotlib is None:
        return None
    matplotlib.use("Agg")
    return optional_module("matplotlib.pyplot")


def size_label(n: int) -> str:
    exponent = math.log2(n)
    return f"2^{int(exponent)}" if exponent.is_integer() else str(n)


def _geomean(values) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def table(title: str, columns, rows):
    print(f"\n{title}\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _impls(rows):
    present = {r["impl"] for r in rows}
    return [i for i in IMPLS if i in present]


def print_report(result: dict):
    """The tables: per dtype and direction, every implementation at the largest size (ms
    ± spread and % of copy) and fusegen's time over the best peer's at every size; host
    overhead; the targets; the skipped peers; warnings about implausible figures."""
    device = result["device"]
    print(f"\n{device['name']} ({device['kind']}), torch {device['torch']}, CUDA {device['cuda']}, "
          f"fusegen {result['fusegen']}, {result['date']}; torch.compile: {result['settings']['compile']} shapes")
    rows, summary = result["rows"], result.get("summary", [])
    if not rows:
        print("no measurements")
    exprs = [e["label"] for e in result["exprs"]]
    keys = sorted({(r["dtype"], r["direction"]) for r in rows},
                  key=lambda k: (result["settings"]["dtypes"].index(k[0]), k[1]))
    for dtype, direction in keys:
        mine = [r for r in rows if (r["dtype"], r["direction"]) == (dtype, direction)]
        big = max(r["n"] for r in mine)
        impls = _impls(mine)
        cell = {(r["expr"], r["impl"]): r for r in mine if r["n"] == big}
        ratio = {(s["expr"], s["n"]): s for s in summary if (s["dtype"], s["direction"]) == (dtype, direction)}

        def shown(expr, impl):
            r = cell.get((expr, impl))
            if r is None:
                return "-"
            pct = f" ({r['pct_copy']:.0f}%)" if r.get("pct_copy") else ""
            return with_spread(r["ms"], r.get("spread_pct")) + pct

        spread = " ±spread" if any(r.get("spread_pct") is not None for r in mine) else ""
        table(f"{direction}, {dtype}, n = {size_label(big)}: median ms{spread} (% of copy rate)",
               ["expr"] + impls + ["fusegen / best peer"],
               [[e] + [shown(e, i) for i in impls]
                + [f"{ratio[(e, big)]['vs_best']:.2f} ({ratio[(e, big)]['best_peer']})" if (e, big) in ratio else "-"]
                for e in exprs if any((e, i) in cell for i in impls)])
        sizes = sorted({r["n"] for r in mine})
        table(f"{direction}, {dtype}: fusegen's time / the best peer's, by size",
               ["expr"] + [size_label(n) for n in sizes],
               [[e] + [f"{ratio[(e, n)]['vs_best']:.2f}" if (e, n) in ratio else "-" for n in sizes]
                for e in exprs if any((e, n) in ratio for n in sizes)])
    _print_host(result.get("host"), exprs)
    _print_targets(summary, result.get("host"))
    for s in result.get("skipped", []):
        where = " ".join(str(s[k]) for k in ("expr", "dtype", "n", "direction") if k in s)
        print(f"skipped  {s['impl']} ({where}): {s['reason']}")
    print_warnings(implausible(result))


def _print_host(host, exprs):
    if not host or not host["rows"]:
        return
    floor = host["floor"]
    print(f"\nhost µs per call at n = {host['n']}: floor {floor['fwd']['us']:.1f} ({floor['fwd']['what']}), "
          f"{floor['fwd+bwd']['us']:.1f} ({floor['fwd+bwd']['what']}); target fusegen <= {host['target']}x floor")
    names = [i for i in ("fusegen", "fusegen.op") + IMPLS[1:] if any(r["impl"] == i for r in host["rows"])]
    columns = [(i, d) for i in names for d in ("fwd", "fwd+bwd")
               if any((r["impl"], r["direction"]) == (i, d) for r in host["rows"])]
    cell = {(r["expr"], r["impl"], r["direction"]): r for r in host["rows"]}

    def shown(e, i, d):
        r = cell.get((e, i, d))
        if r is None:
            return "-"
        return f"{r['us']:.1f} ({r['vs_floor']:.2f}x)" if i.startswith("fusegen") else f"{r['us']:.1f}"

    table(f"host µs per call ({host['rows'][0]['dtype']}; fusegen: x floor)", ["expr"] + [f"{i} {d}" for i, d in columns],
           [[e] + [shown(e, i, d) for i, d in columns] for e in exprs if any((e, i, d) in cell for i, d in columns)])


def _print_targets(summary, host):
    """The run-time targets (TARGETS, HOST_TARGET) on the largest size measured per dtype
    and direction."""
    lines = []
    for direction, dtype, peers, geomean_min in TARGETS:
        mine = [s for s in summary if (s["dtype"], s["direction"]) == (dtype, direction)]
        if not mine:
            continue
        big = max(s["n"] for s in mine)
        mine = [s for s in mine if s["n"] == big]
        slower = [f"{s['expr']} ({p} {s['speedup'][p]:.2f}x)" for s in mine for p in peers
                  if s["speedup"].get(p, math.inf) < 1]
        present = [p for p in peers if any(p in s["speedup"] for s in mine)]
        gm = _geomean(s["speedup"].get("compile") for s in mine)
        if set(present) != set(peers) or gm is None:
            absent = [p for p in peers if p not in present]
            lines.append(f"{direction:7s} {dtype:8s} not judged: {', '.join(absent or ['compile'])} not measured")
            continue
        verdict = "met" if not slower and gm >= geomean_min else "NOT met"
        lines.append(f"{direction:7s} {dtype:8s} n = {size_label(big)}: no slower than {', '.join(present) or '-'}: "
                     f"{'yes' if not slower else 'no: ' + ', '.join(slower)}; geomean speedup over compile "
                     f"{gm:.2f}x (target {geomean_min}x): {verdict}")
    if host and host["rows"]:
        over = [f"{r['expr']} {r['direction']} {r['vs_floor']:.2f}x" for r in host["rows"]
                if r["impl"] == "fusegen" and r["vs_floor"] > host["target"]]
        lines.append(f"host    fusegen <= {host['target']}x floor: {'met' if not over else 'NOT met: ' + ', '.join(over)}")
    if lines:
        print("\ntargets (largest size: no slower than the peers named, geomean speedup over torch.compile; "
              "host time against the floor)")
        for line in lines:
            print(f"  {line}")


def plot(result: dict, path: str, metric: str):
    """One panel per expression (rows) and dtype x direction (columns), one line per
    implementation: GB/s (the ideal fused bytes over the time; the copy of the same bytes
    dashed) or ms, against the size."""
    from fusegen.files import write_bytes

    plt = pyplot()
    rows = result["rows"]
    exprs = [e["label"] for e in result["exprs"]]
    columns = [(d, k) for d in result["settings"]["dtypes"] for k in result["settings"]["directions"]
               if any((r["dtype"], r["direction"]) == (d, k) for r in rows)]
    figure, axes = plt.subplots(len(exprs), max(len(columns), 1), squeeze=False,
                                figsize=(3.6 * max(len(columns), 1), 2.8 * len(exprs)))
    copy_ms = {c["bytes"]: c["ms"] for c in result["copy"]}
    tensors = {e["label"]: e["tensors"] for e in result["exprs"]}
    for i, expr in enumerate(exprs):
        for j, (dtype, direction) in enumerate(columns):
            ax = axes[i][j]
            mine = [r for r in rows if (r["expr"], r["dtype"], r["direction"]) == (expr, dtype, direction)]
            for impl in _impls(mine):
                points = sorted((r["n"], r["gbs"] if metric == "bandwidth" else r["ms"]) for r in mine
                                if r["impl"] == impl and (metric == "time" or r["gbs"]))
                if points:
                    ax.plot(*zip(*points), marker=".", label=impl)
            if metric == "bandwidth" and mine:
                es = torch.empty((), dtype=getattr(torch, dtype)).element_size()
                ref = sorted((n, tensors[expr][direction] * n * es / copy_ms[tensors[expr][direction] * n * es] / 1e6)
                             for n in {r["n"] for r in mine} if tensors[expr][direction] * n * es in copy_ms)
                if ref:
                    ax.plot(*zip(*ref), linestyle="--", color="gray", label="copy")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")  # small sizes are launch-bound: orders of magnitude below the large ones
            ax.set_title(f"{expr} {dtype} {direction}", fontsize=9)
            ax.set_xlabel("elements", fontsize=8)
            ax.set_ylabel("GB/s" if metric == "bandwidth" else "ms", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    device = result["device"]
    figure.suptitle(f"fusegen bench: {device['name']}, torch {device['torch']}, {result['date']}", fontsize=10)
    figure.tight_layout(rect=(0, 0, 1, 0.98))  # room for the title
    import io
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    write_bytes(path, buffer.getvalue())

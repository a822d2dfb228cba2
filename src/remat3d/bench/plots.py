"""Bench plots (matplotlib, PNG, each written to a temp file and renamed).

- ``overhead-curves.png``: per sweep case, verified peak → recomputed FLOPs for every
  method (remat3d's optimal over its budgets and torch.compile over its memory budgets as
  curves, the fixed methods as points);
- ``peak-by-size.png``: per point model and precision, the peak of each headline method
  at each input size.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from remat3d.bench.records import Record
from remat3d.plotting import save_figure
from remat3d.units import format_shape

__all__ = ["headline_methods", "write_plots"]

GIB = 2**30
_MARKERS = {"none": "s", "torch-blocks": "D", "checkpoint-sequential": "v",
            "remat3d:blocks": "^", "remat3d:sqrt": "<", "remat3d:selective": ">",
            "remat3d:recursive": "p", "remat3d:uniform": "h", "remat3d:balanced": "H"}




def _ok(records: list[Record]) -> list[Record]:
    return [r for r in records if r.status == "ok" and r.peak_bytes is not None]


def _case_key(r: Record) -> tuple[str, str, str, str]:
    return r.model, format_shape(r.input_shape[2:]), r.amp, r.tier


def headline_methods(records: list[Record]) -> list[tuple[str, Record]]:
    """(label, record) for the headline comparison of one case: unplanned, blocks (torch
    and remat3d), torch.compile's lowest peak, remat3d's smallest feasible (± offload)."""
    ok = _ok(records)
    out: list[tuple[str, Record]] = []
    for method, label in (("none", "no checkpointing"), ("torch-blocks", "torch: every block"),
                          ("remat3d:blocks", "remat3d: every block")):
        out += [(label, r) for r in ok if r.method == method][:1]
    compiled = [r for r in ok if r.method == "compile"]
    if compiled:
        best = min(compiled, key=lambda r: (r.peak_bytes or 0, r.recompute_flops or 0))
        out.append((f"torch.compile, best ({best.setting})", best))
    for method, label in (("remat3d:optimal", "remat3d optimal, smallest budget"),
                          ("remat3d:optimal+offload", "remat3d optimal + offload, smallest"),
                          ("remat3d:graph", "remat3d graph plan, smallest")):
        out += [(label, r) for r in ok
                if r.method == method and r.setting == "smallest feasible"][:1]
    return out


def _overhead_curves(records: list[Record], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps: dict[tuple, list[Record]] = defaultdict(list)
    for r in _ok(records):
        if r.tier == "meta":
            sweeps[_case_key(r)].append(r)
    sweeps = {k: v for k, v in sweeps.items()
              if sum(r.method == "remat3d:optimal" for r in v) >= 3}
    if not sweeps:
        return None
    cols = min(2, len(sweeps))
    rows = math.ceil(len(sweeps) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.6 * rows), squeeze=False)
    for ax, (key, recs) in zip(axes.flat, sorted(sweeps.items())):
        for method, style in (("remat3d:optimal", "o-"), ("remat3d:optimal+offload", "o--"),
                              ("compile", "x:")):
            pts = sorted((r.peak_bytes / GIB, 100 * (r.recompute_ratio or 0))  # type: ignore[operator]
                         for r in recs if r.method == method)
            if pts:
                if method != "compile":  # the least overhead at each peak: a frontier
                    frontier, best = [], math.inf
                    for x, y in pts:
                        if y < best:
                            frontier.append((x, y))
                            best = y
                    pts = frontier
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style, label=method + (" (memory_budget)" if method ==
                                                       "compile" else ""))
        for r in recs:
            if r.method == "compile":  # which memory_budget gave which point
                ax.annotate(r.setting.split("=")[-1],
                            (r.peak_bytes / GIB, 100 * (r.recompute_ratio or 0)),  # type: ignore[operator]
                            textcoords="offset points", xytext=(4, 4), fontsize=7,
                            color="green")
            if r.method in _MARKERS:
                ax.plot([r.peak_bytes / GIB], [100 * (r.recompute_ratio or 0)],  # type: ignore[operator]
                        _MARKERS[r.method], markersize=9,
                        label=f"{r.method} {r.setting}".strip())
        ax.set_title(f"{key[0]} {key[1]} amp={key[2]}")
        ax.set_xlabel("measured peak of one step (GiB)")
        ax.set_ylabel("recomputed FLOPs (% of the step)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(sweeps):]:
        ax.set_visible(False)
    fig.suptitle("memory -> recompute overhead (lower left is better)")
    fig.tight_layout()
    return save_figure(fig, path)


def _peak_by_size(records: list[Record], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str], dict[str, list[Record]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.tier == "meta":
            groups[(r.model, r.amp)][format_shape(r.input_shape[2:])].append(r)
    groups = {k: v for k, v in groups.items() if len(v) >= 2}
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(8 * len(groups), 5), squeeze=False)
    for ax, ((model, amp), by_size) in zip(axes.flat, sorted(groups.items())):
        sizes = sorted(by_size, key=lambda s: int(s.split("x")[0]))
        table = {s: dict(headline_methods(by_size[s])) for s in sizes}
        labels: list[str] = []
        for s in sizes:
            labels += [lab for lab in table[s] if lab not in labels]
        width = 0.8 / max(1, len(labels))
        if not labels:
            ax.set_visible(False)
            continue
        for j, label in enumerate(labels):
            xs = [i + j * width for i, s in enumerate(sizes) if label in table[s]]
            ys = [table[s][label].peak_bytes / GIB for s in sizes  # type: ignore[operator]
                  if label in table[s]]
            ax.bar(xs, ys, width, label=label.split(" (")[0])
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], sizes)
        ax.set_yscale("log")
        ax.set_ylabel("measured peak of one step (GiB, log)")
        ax.set_title(f"{model} amp={amp}: peak per method")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def write_plots(records: list[Record], out: Path) -> list[Path]:
    files = [_overhead_curves(records, out / "overhead-curves.png"),
             _peak_by_size(records, out / "peak-by-size.png")]
    return [f for f in files if f is not None]

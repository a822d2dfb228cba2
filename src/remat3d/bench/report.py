"""The bench's markdown report (``report.md``), made from the records alone."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from remat3d.bench.plots import headline_methods
from remat3d.bench.records import Record, machine_info, now, versions_info
from remat3d.graph import atomic_write_text
from remat3d.units import format_bytes, format_shape

__all__ = ["equal_peak_rows", "per_block_rows", "render_report", "write_report"]


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def _bytes(n: int | None) -> str:
    return "—" if n is None else format_bytes(n)


def _cases(records: list[Record], tier: str) -> dict[tuple, list[Record]]:
    out: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        if r.tier == tier:
            out[(r.model, tuple(r.input_shape), r.amp)].append(r)
    return out


def _title(key: tuple) -> str:
    model, shape, amp = key
    return f"{model} {format_shape(shape[2:])} (batch {shape[0]}, amp={amp})"


def equal_peak_rows(recs: list[Record]) -> list[dict]:
    """For each baseline of a sweep: its peak and overhead, and remat3d optimal's at a
    budget equal to that peak (``ratio``: remat3d's recompute over the baseline's), and a
    graph plan's where the bench made one (``graph``, ``graph_ratio``)."""
    by_setting = {r.setting: r for r in recs if r.method == "remat3d:optimal"}
    graphs = {r.setting: r for r in recs if r.method == "remat3d:graph"}
    flops = {r.setting: r for r in recs if r.method == "remat3d:graph:flops"}
    rows = []
    for r in recs:
        if r.method in ("none", "remat3d:optimal", "remat3d:optimal+offload",
                        "remat3d:graph", "remat3d:graph:flops") or \
                r.status != "ok":
            continue
        ours = by_setting.get(f"peak of {r.method} {r.setting}".strip())
        if ours is None:
            continue
        graph, graph_flops = graphs.get(ours.setting), flops.get(ours.setting)
        rows.append({"baseline": r, "remat3d": ours, "ratio": _ratio(ours, r),
                     "graph": graph, "graph_ratio": None if graph is None else
                     _ratio(graph, r), "graph_flops": graph_flops,
                     "graph_flops_ratio": None if graph_flops is None else
                     _ratio(graph_flops, r)})
    return rows


def _ratio(ours: Record, baseline: Record) -> float | None:
    if ours.status == "ok" and (baseline.recompute_flops or 0) > 0 and \
            ours.recompute_flops is not None:
        return ours.recompute_flops / baseline.recompute_flops  # type: ignore[operator]
    return None


def render_report(records: list[Record], *, suite: str, command: str, seconds: float,
                  plots: list[Path]) -> str:
    """The markdown report: header, headline peaks, equal-peak comparisons, CPU steps,
    notes and plots."""
    meta = _cases(records, "meta")
    lines = _header(suite, command, seconds)
    lines += _headline(meta)
    lines += _per_block(meta)
    lines += _equal_peak(meta)
    lines += _cpu_steps(_cases(records, "cpu"))
    lines += _notes(records)
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(lines)


def _header(suite: str, command: str, seconds: float) -> list[str]:
    machine, versions = machine_info(), versions_info()
    return [
        f"# remat3d bench: suite `{suite}`",
        "",
        f"Generated {now()} by `{command or 'remat3d bench'}` in {seconds / 60:.1f} min on "
        f"{machine['system']} {machine['arch']}, {machine['cpu_count']} CPU cores, "
        f"GPU: {machine['cuda'] or 'none'}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        ("Every peak is remat3d's tracker (live tensor bytes of one training step, batch 1, "
        "loss = mean of the output) on the meta device unless the tier says cpu. "
        "*Recompute* is the step's FLOPs minus the unplanned step's, over the unplanned "
        "step's; FLOPs count convolutions and matmuls (PyTorch's flop counter), so "
        "recomputed norms and activations cost time (see the CPU step times) but no FLOPs. "
        "torch.compile runs with the `aot_eager` backend: its partitioned graphs run "
        "unfused, and its peak is that execution's. Full records: `results.json`."),
        "",
    ]


def _headline(meta: dict[Any, list[Record]]) -> list[str]:
    lines: list[str] = []
    if any(headline_methods(recs) for recs in meta.values()):
        lines += ["## Headline: peak per method", ""]
    for key, recs in meta.items():
        rows = headline_methods(recs)
        if not rows:
            continue
        base = next((r for r in recs if r.method == "none" and r.status == "ok"), None)
        lines += [f"### {_title(key)}", "",
                  "| method | peak | vs unplanned | recompute | plan / compile s |",
                  "|---|---:|---:|---:|---:|"]
        for label, r in rows:
            rel = (r.peak_bytes or 0) / (base.peak_bytes or 1) if base else None
            plan_s = "—" if r.plan_seconds is None else f"{r.plan_seconds:.1f}"
            lines.append(f"| {label} | {_bytes(r.peak_bytes)} | "
                         f"{'—' if rel is None else f'{rel:.2f}x'} | "
                         f"{_pct(r.recompute_ratio)} | {plan_s} |")
        lines.append("")
    return lines


def _equal_cells(o: Record, ratio: float | None) -> str:
    """Peak, recompute and ratio cells of one planned row at a baseline's peak."""
    cells = (f"{_bytes(o.peak_bytes)} | {_pct(o.recompute_ratio)}"
             if o.status == "ok" else f"{o.status} | —")
    text = "—" if ratio is None else f"{ratio:.2f}"
    if ratio is None and o.status == "ok":
        text = ("— (neither recomputes FLOPs)" if not o.recompute_flops
                else "— (baseline recomputes no FLOPs)")
    return f"{cells} | {text}"


def per_block_rows(meta: dict[Any, list[Record]]) -> list[dict]:
    """Per case: checkpointing every block, and remat3d ``optimal`` at its peak (by itself:
    ``optimal``; module plans only: ``modules``, where the bench made one), each with its
    recompute over per-block checkpointing's."""
    rows = []
    for key, recs in meta.items():
        block = next((r for r in recs if r.method == "torch-blocks" and r.status == "ok"),
                     None)
        if block is None:
            continue
        setting = f"peak of {block.method} {block.setting}".strip()
        found = {r.method: r for r in recs if r.setting == setting
                 and r.method in ("remat3d:optimal", "remat3d:modules")}
        if "remat3d:optimal" not in found:
            continue
        rows.append({"key": key, "blocks": block, **{
            name: (found.get(f"remat3d:{name}"),
                   None if f"remat3d:{name}" not in found
                   else _ratio(found[f"remat3d:{name}"], block))
            for name in ("optimal", "modules")}})
    return rows


def _per_block(meta: dict[Any, list[Record]]) -> list[str]:
    rows = per_block_rows(meta)
    if not rows:
        return []
    lines = ["## At per-block checkpointing's peak", "",
             ("Checkpointing every block (MONAI's and HF's practice) against remat3d "
              "`optimal` planned with the budget set to the peak that reaches; *ratio* is "
              "remat3d's recomputed FLOPs over per-block checkpointing's. *plan* says what "
              "optimal chose (a graph plan or module regions); *modules only* is "
              "`graph=False`."), "",
             ("| model | blocks peak | blocks recompute | optimal peak | optimal recompute "
              "| ratio | plan | modules only: peak | recompute | ratio |"),
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for row in rows:
        b = row["blocks"]
        ours, ratio = row["optimal"]
        kind = "graph" if ours.note.startswith("graph plan") else "modules"
        module, module_ratio = row["modules"]
        modules = "— | — | —" if module is None else _equal_cells(module, module_ratio)
        lines.append(f"| {_title(row['key'])} | {_bytes(b.peak_bytes)} | "
                     f"{_pct(b.recompute_ratio)} | {_equal_cells(ours, ratio)} | "
                     f"{kind if ours.status == 'ok' else '—'} | {modules} |")
    return lines + [""]


def _equal_peak(meta: dict[Any, list[Record]]) -> list[str]:
    lines: list[str] = []
    sweeps = {k: v for k, v in meta.items() if equal_peak_rows(v)}
    if sweeps:
        lines += ["## Equal peak: remat3d optimal against each baseline", "",
                  ("remat3d is planned with the budget set to the peak the baseline "
                  "reaches; *ratio* is remat3d's recomputed FLOPs over the baseline's "
                  "(below 1: remat3d recomputes less for the same memory). At "
                  "torch.compile's peaks a graph plan (the op-level planner against the "
                  "op-level one) is given too, planned for time (its default objective: "
                  "recomputed norms and activations cost their memory traffic) and for "
                  "FLOPs (`objective=\"flops\"`, what torch.compile's partitioner "
                  "minimises)."), ""]
        for key, recs in sweeps.items():
            lines += [f"### {_title(key)}", "",
                      ("| baseline | its peak | its recompute | remat3d peak | "
                      "remat3d recompute | ratio | graph plan peak | graph recompute | "
                      "graph ratio | graph (flops) peak | graph (flops) recompute | "
                      "graph (flops) ratio |"),
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for row in equal_peak_rows(recs):
                b = row["baseline"]
                ours = _equal_cells(row["remat3d"], row["ratio"])
                graphs = " | ".join(
                    "— | — | —" if row[name] is None else
                    _equal_cells(row[name], row[f"{name}_ratio"])
                    for name in ("graph", "graph_flops"))
                lines.append(f"| {b.method} {b.setting} | {_bytes(b.peak_bytes)} | "
                             f"{_pct(b.recompute_ratio)} | {ours} | {graphs} |")
            curve = sorted((r for r in recs if r.method.startswith("remat3d:optimal")
                            and r.setting.startswith(("budget=", "smallest"))),
                           key=lambda r: (r.method, r.budget_bytes or 0))
            if curve:
                lines += ["", "Budget sweep:", "",
                          "| method | budget | setting | peak | recompute | plan s |",
                          "|---|---:|---|---:|---:|---:|"]
                for r in curve:
                    plan_s = "—" if r.plan_seconds is None else f"{r.plan_seconds:.1f}"
                    lines.append(f"| {r.method} | {_bytes(r.budget_bytes)} | {r.setting} | "
                                 f"{_bytes(r.peak_bytes) if r.status == 'ok' else r.status}"
                                 f" | {_pct(r.recompute_ratio)} | {plan_s} |")
            lines.append("")
    return lines


def _cpu_steps(cpu: dict[Any, list[Record]]) -> list[str]:
    lines: list[str] = []
    if cpu:
        lines += ["## Real CPU steps: time and exactness", "",
                  ("fp32; step time is the median over interleaved rounds of the method's "
                  "time over the unplanned step's; gradients and buffers are compared "
                  "bitwise with the unplanned step's."), ""]
        for key, recs in cpu.items():
            lines += [f"### {_title(key)}", "",
                      ("| method | setting | peak | recompute | step time | grads equal | "
                      "buffers equal |"), "|---|---|---:|---:|---:|---|---|"]
            for r in recs:
                if r.status != "ok":
                    lines.append(f"| {r.method} | {r.setting} | {r.status} | | | | |")
                    continue
                ratio = "—" if r.step_time_ratio is None else f"{r.step_time_ratio:.2f}x"
                lines.append(f"| {r.method} | {r.setting} | {_bytes(r.peak_bytes)} | "
                             f"{_pct(r.recompute_ratio)} | {ratio} | {r.grads_equal} | "
                             f"{r.buffers_equal} |")
            lines.append("")
    return lines


def _notes(records: list[Record]) -> list[str]:
    lines: list[str] = []
    notes = [r for r in records
             if r.status != "ok" or (r.method == "compile" and r.note != "aot_eager")]
    if notes:
        lines += ["## Notes", ""]
        seen = set()
        for r in notes:
            text = f"{r.model} {r.method} {r.setting}: {r.status}: {r.note}"
            if text not in seen:
                seen.add(text)
                lines.append(f"- {text}")
        lines.append("")
    return lines


def write_report(records: list[Record], out: Path, *, suite: str, command: str,
                 seconds: float, plots: list[Path]) -> Path:
    path = out / "report.md"
    atomic_write_text(path, render_report(records, suite=suite, command=command,
                                          seconds=seconds, plots=plots))
    return path

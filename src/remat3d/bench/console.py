"""The terminal side of ``remat3d bench``: a progress bar and the headline tables (rich)."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from remat3d.bench.plots import headline_methods
from remat3d.bench.runner import run_suite
from remat3d.bench.suites import Case, suite_from_options
from remat3d.units import format_bytes, format_shape

__all__ = ["run_with_progress"]


def run_with_progress(console: Console, suite_name: str, models: str | None,
                      sizes: str | None, budgets: str | None, out: str,
                      command: str) -> None:
    suite = suite_from_options(suite_name, models, sizes, budgets)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total} cases"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task(f"bench {suite.name}", total=len(suite.cases()))

        def on_case(i: int, n: int, case: Case) -> None:
            progress.update(task, completed=i, description=f"{case.kind} {case.model} "
                            f"{case.size}³ amp={case.amp}")

        result = run_suite(suite, out, command=command, on_case=on_case)
    cases = defaultdict(list)
    for r in result.records:
        if r.tier == "meta":
            cases[(r.model, format_shape(r.input_shape[2:]), r.amp)].append(r)
    for (model, shape, amp), recs in cases.items():
        table = Table(title=f"{model} {shape} amp={amp}", title_justify="left")
        table.add_column("method")
        table.add_column("peak", justify="right")
        table.add_column("recompute", justify="right")
        for label, r in headline_methods(recs):
            table.add_row(label, format_bytes(r.peak_bytes or 0),
                          f"{100 * (r.recompute_ratio or 0):+.1f}%")
        console.print(table)
    console.print(f"{len(result.records)} records in {result.seconds / 60:.1f} min; written: "
                  + escape(", ".join(os.fspath(Path(f)) for f in result.files)), highlight=False,
                  soft_wrap=True)

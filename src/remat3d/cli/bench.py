"""``remat3d bench``: the benchmark suites, with a progress display."""

from __future__ import annotations

import sys

import typer

from remat3d.cli.common import console

__all__ = ["bench_command"]


def bench_command(
    suite: str = typer.Option("quick", "--suite",
                              help="quick (under 10 min on 2 cores), full (under 60 min), "
                                   "or tiny (seconds)."),
    models: str = typer.Option(None, "--models",
                               help="Comma-separated presets replacing the suite's models."),
    sizes: str = typer.Option(None, "--sizes",
                              help="Comma-separated spatial edges of the peak-per-size "
                                   "cases, e.g. 128,256,512."),
    budgets: str = typer.Option(None, "--budgets",
                                help="Comma-separated sweep budgets: 0.8x, 3GiB, ..."),
    out: str = typer.Option(..., "--out", "-o",
                            help="Directory for results.json, report.md and the plots."),
) -> None:
    """Benchmark remat3d against no checkpointing, per-block checkpointing,
    checkpoint_sequential and torch.compile's memory budget, on the same steps."""
    from remat3d.bench.console import run_with_progress

    run_with_progress(console, suite, models, sizes, budgets, out,
                      "remat3d " + " ".join(sys.argv[1:]))

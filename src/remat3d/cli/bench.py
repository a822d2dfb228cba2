"""``remat3d bench``: the benchmark suites, and the reports behind the docs' numbers.

``remat3d bench --suite quick --out DIR`` runs a suite with a progress display. The
subcommands regenerate the figures of one document each; their options are their own
(``remat3d bench tiling --help``):

- ``tiling``: docs/tiling.md (exactness per preset, 512³ memory, the planner's layouts)
- ``reversible``: docs/reversible.md (inversion error, memory and time of RevUNet)
- ``tracker``: docs/tracker-validation.md (tracker vs allocator vs FlopCounterMode)
- ``gpu``: plans run on a CUDA device (docs/gpu.md)
"""

from __future__ import annotations

import importlib
import sys

import typer

from remat3d.cli.common import console, user_errors
from remat3d.errors import Remat3dError

__all__ = ["bench_app"]

bench_app = typer.Typer(
    help="Benchmark remat3d against no checkpointing, per-block checkpointing, "
         "checkpoint_sequential and torch.compile's memory budget, on the same steps; "
         "or regenerate one document's numbers (subcommands).",
    add_completion=False, pretty_exceptions_enable=False)


@bench_app.callback(invoke_without_command=True)
@user_errors
def bench_command(
    ctx: typer.Context,
    suite: str = typer.Option("quick", "--suite",
                              help="quick (under 10 min on 2 cores), full (under 60 min), "
                                   "blocks (optimal at per-block checkpointing's peak on "
                                   "every preset), cpu (real CPU steps only: per-block "
                                   "checkpointing's time, torch's against remat3d's) or "
                                   "tiny (seconds)."),
    models: str = typer.Option(None, "--models",
                               help="Comma-separated presets replacing the suite's models."),
    sizes: str = typer.Option(None, "--sizes",
                              help="Comma-separated spatial edges of the peak-per-size "
                                   "cases, e.g. 128,256,512."),
    budgets: str = typer.Option(None, "--budgets",
                                help="Comma-separated sweep budgets: 0.8x, 3GiB, ..."),
    out: str = typer.Option(None, "--out", "-o",
                            help="Directory for results.json, report.md and the plots "
                                 "(required to run a suite)."),
) -> None:
    """Benchmark remat3d against no checkpointing, per-block checkpointing,
    checkpoint_sequential and torch.compile's memory budget, on the same steps."""
    if ctx.invoked_subcommand is not None:
        return
    if out is None:
        raise Remat3dError("remat3d bench needs --out DIR for the suite's results "
                           "(e.g. remat3d bench --suite quick --out bench-results), or a "
                           "report subcommand: tiling, reversible, tracker, gpu.")
    from remat3d.bench.console import run_with_progress

    run_with_progress(console, suite, models, sizes, budgets, out,
                      "remat3d " + " ".join(sys.argv[1:]))


_REPORTS = {  # subcommand: (module with main(argv), help)
    "tiling": ("remat3d.bench.tiling_report", "Regenerate docs/tiling.md's numbers."),
    "reversible": ("remat3d.bench.reversible_report",
                   "Regenerate docs/reversible.md's numbers."),
    "tracker": ("remat3d.bench.tracker_report",
                ("Validate the tracker against the allocator and FlopCounterMode "
                 "(docs/tracker-validation.md).")),
    "predict": ("remat3d.bench.predict_report",
                ("Plan whole-volume prediction at full size on meta; --cpu-time: a tiled "
                 "prediction's time on this CPU (docs/predict.md).")),
    "graph-tiles": ("remat3d.bench.graph_tiles_report",
                    ("Tiled graph plans at full size on meta, each tiling mode's peak and "
                     "FLOPs, a tiled step's time on this CPU (docs/graph-tiles.md).")),
    "gpu": ("remat3d.bench.cuda_check",
            ("Run plans on a CUDA device: allocator peak against the verified peak, step "
             "times, bitwise exactness (docs/gpu.md).")),
}


def _report(module: str) -> typer.models.CommandFunctionType:
    """A subcommand handing its arguments to ``module.main`` (argparse: ``--help`` too)."""
    def command(ctx: typer.Context) -> None:
        importlib.import_module(module).main(list(ctx.args))

    return command


for _name, (_module, _help) in _REPORTS.items():
    bench_app.command(_name, help=_help, add_help_option=False,
                      context_settings={"allow_extra_args": True,
                                        "ignore_unknown_options": True})(
        user_errors(_report(_module)))

"""The ``remat3d`` command line.

Heavy modules (torch, MONAI) are imported inside commands so ``--help`` answers at once.
Every error a user can cause is a ``Remat3dError``: printed as one line, no traceback,
exit status 2.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from remat3d.errors import Remat3dError

__all__ = ["app", "main"]

app = typer.Typer(
    name="remat3d",
    help="Measure and plan gradient checkpointing so 3D networks train on whole volumes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


def _user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a Remat3dError into one red line and exit status 2."""

    @wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except Remat3dError as exc:
            # one logical line: the terminal wraps it, so file paths stay whole for copying
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


@app.callback()
def _root() -> None:
    """remat3d: whole-volume training of 3D networks within a memory budget."""


@app.command("profile")
@_user_errors
def profile_command(
    model: str = typer.Argument(
        ..., help="A zoo preset (nnunet, unet, ...), package.module:Class, or a .py file "
        "defining build_model()."),
    input: str = typer.Option(
        None, "--input", "-i",
        help="Input shape BxCxDxHxW, e.g. 1x1x256x256x256. Default: 1xCx128x128x128."),
    amp: str = typer.Option("none", "--amp", help="none, bf16 or fp16 (autocast)."),
    device: str = typer.Option(
        "meta", "--device", help="meta (no memory used, any size), cpu or cuda."),
    model_kwargs: str = typer.Option(
        None, "--model-kwargs", help="Constructor keyword arguments: JSON/YAML text or a file."),
    json_out: str = typer.Option(
        None, "--json", help="Write the Profile as JSON to this file ('-' for stdout)."),
    top: int = typer.Option(12, "--top", help="Rows in the table of modules."),
) -> None:
    """Measure one training step: peak memory, what is saved for backward, FLOPs."""
    from remat3d.profiling import profile

    net, shape = _build(model, input, model_kwargs)
    with console.status(f"profiling {model} at {'x'.join(map(str, shape))} on {device}",
                        spinner="dots") if json_out != "-" else contextlib.nullcontext():
        prof = profile(net, shape, device=device, amp=None if amp == "none" else amp)
    if json_out == "-":
        sys.stdout.write(json.dumps(prof.to_dict()) + "\n")
        return
    if json_out:
        prof.save(json_out)
    _print_profile(prof, model, top)
    if json_out:
        console.print(f"profile written to [bold]{json_out}[/]")


def _build(model: str, input: str | None, model_kwargs: str | None) -> tuple[Any, tuple]:
    from remat3d import zoo
    from remat3d.units import parse_shape

    kwargs = zoo.parse_model_kwargs(model_kwargs)
    preset = zoo.PRESETS.get(model)
    if input is None:
        channels = int(kwargs.get("in_channels", preset.in_channels if preset else 1))
        shape: tuple[int, ...] = (1, channels, 128, 128, 128)
    else:
        shape = parse_shape(input)
    if preset is not None:
        zoo.check_input_shape(preset, shape, kwargs)
    if len(shape) < 3:
        raise Remat3dError(f"Input shape {input!r} needs batch, channels and spatial sizes.")
    net = zoo.build_model(model, kwargs, spatial_size=tuple(shape[2:]), device="meta")
    return net, shape


@app.command("plan")
@_user_errors
def plan_command(
    model: str = typer.Argument(
        ..., help="A zoo preset, package.module:Class, or a .py file defining build_model()."),
    input: str = typer.Option(None, "--input", "-i",
                              help="Input shape BxCxDxHxW. Default: 1xCx128x128x128."),
    budget: str = typer.Option(..., "--budget", "-b",
                               help="12GiB, 500MB, 0.25x (of the unplanned peak), or auto."),
    strategy: str = typer.Option("optimal", "--strategy", "-s",
                                 help="optimal (default), none, blocks, selective, uniform, "
                                      "sqrt, balanced or recursive."),
    offload: bool = typer.Option(False, "--offload", help=(
        "Allow host memory: offloaded saved tensors, and tiled outputs kept on the host.")),
    host_budget: str = typer.Option(
        None, "--host-budget", help="With --offload: the most host memory the plan may use "
        "(32GiB); default: no limit."),
    tile: bool = typer.Option(True, "--tile/--no-tile",
                              help="Let optimal tile full-resolution stages when no "
                                   "recompute plan fits (exact; costs extra passes)."),
    amp: str = typer.Option("none", "--amp", help="none, bf16 or fp16 (autocast)."),
    model_kwargs: str = typer.Option(None, "--model-kwargs",
                                     help="Constructor keyword arguments (JSON/YAML/file)."),
    out: str = typer.Option(None, "--out", "-o", help="Write the plan (JSON) here."),
    plot: str = typer.Option(None, "--plot", help="Write a PNG: overhead curve and timelines."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON only."),
) -> None:
    """Plan checkpointing so one training step fits a memory budget, verified on meta."""
    from remat3d.planning import plan as make_plan
    from remat3d.profiling import profile
    from remat3d.units import format_bytes

    net, shape = _build(model, input, model_kwargs)
    amp_ = None if amp == "none" else amp
    status = console.status(f"planning {model} at {'x'.join(map(str, shape))}",
                            spinner="dots") if not json_out else contextlib.nullcontext()
    with status:
        base = profile(net, shape, amp=amp_)
        result = make_plan(net, shape, budget=budget, strategy=strategy, offload=offload,
                           amp=amp_, tile=tile, host_budget=host_budget)
    if out:
        result.save(out)
    if json_out:
        sys.stdout.write(json.dumps(result.to_dict()) + "\n")
        return
    table = Table(title=f"{model} {'x'.join(map(str, shape))} amp={amp}: "
                        f"{len(result.regions)} regions ({strategy})", title_justify="left")
    table.add_column("module", overflow="fold", min_width=24)
    table.add_column("decision")
    table.add_column("policy / tile")
    for region in result.regions:
        detail = str(region.policy or "")
        if region.tile:
            detail = "x".join(map(str, region.tile)) + (" fused" if region.fuse else "") \
                + (" output on host" if region.host else "")
        table.add_row(region.label, region.decision, detail)
    console.print(table)
    predicted = ("" if result.predicted_peak_bytes is None else
                 f" | predicted {format_bytes(result.predicted_peak_bytes)}")
    console.print(
        f"budget {format_bytes(result.budget_bytes or 0)} | unplanned peak "
        f"{format_bytes(base.peak_bytes)}{predicted}"
        f" | verified [bold]{format_bytes(result.verified_peak_bytes or 0)}[/] | "
        + (f"extra +{100 * _overhead(result, base):.1f}% FLOPs (recompute, tile passes, "
           "halos)" if result.tiled else f"recompute +{100 * _overhead(result, base):.1f}% FLOPs"),
        highlight=False)
    if result.verified_host_bytes:
        console.print(f"host memory for tiled outputs kept there: "
                      f"{format_bytes(result.verified_host_bytes)}", highlight=False)
    if result.offloads and not result.prefetch:
        console.print("offloaded tensors are copied back when backward needs them, not "
                      "prefetched (the prefetch's overlap does not fit this budget)",
                      highlight=False)
    if out:
        console.print(f"plan written to [bold]{out}[/]")
    if plot:
        _plot(plot, net, shape, result, base, amp_, offload, model, tile)
        console.print(f"plot written to [bold]{plot}[/]")


def _overhead(plan: Any, base: Any) -> float:
    """A plan's extra FLOPs as a fraction of the unplanned step's (tiled plans: every extra
    pass and halo; otherwise the recomputation)."""
    extra = plan.extra_flops if plan.tiled and plan.extra_flops is not None else plan.recompute_flops
    return (extra or 0) / max(1, base.flops)


def _plot(path: str, net: Any, shape: tuple, result: Any, base: Any, amp: str | None,
          offload: bool, model: str, tile: bool = True) -> None:
    from remat3d.instrument.step import meta_copy
    from remat3d.plotting import plot_plan
    from remat3d.profiling import profile
    from remat3d.runtime.apply import apply

    planned = meta_copy(net)
    apply(planned, result)
    timeline = profile(planned, shape, amp=amp).timeline
    curve = []
    if result.strategy == "optimal":
        from remat3d.planning import plan as make_plan

        low = result.verified_peak_bytes or base.peak_bytes
        for k in range(6):
            budget = int(low + (base.peak_bytes - low) * k / 5)
            try:
                p = make_plan(net, shape, budget=budget, offload=offload, amp=amp, tile=tile)
            except Remat3dError:
                continue
            curve.append((p.verified_peak_bytes or 0, _overhead(p, base)))
    plot_plan(path, title=f"{model} {'x'.join(map(str, shape))} amp={amp or 'none'}",
              curve=curve,
              chosen=(result.verified_peak_bytes or 0, _overhead(result, base)),
              budget=result.budget_bytes or 0,
              unplanned=[e["live_after"] for e in base.timeline],
              planned=[e["live_after"] for e in timeline])


def _print_profile(prof: Any, model: str, top: int) -> None:
    from remat3d.tables import level_table, module_table
    from remat3d.units import format_bytes

    g = prof.graph
    console.print(prof.summary().replace(g.model, model, 1), highlight=False)
    split = Table(title="Peak memory by category", title_justify="left")
    split.add_column("category")
    split.add_column("bytes", justify="right")
    split.add_column("share", justify="right")
    for name, nbytes in prof.breakdown.items():
        if nbytes:
            split.add_row(name, format_bytes(nbytes), f"{100 * nbytes / prof.peak_bytes:.1f}%")
    console.print(split)

    modules = Table(title=f"Top {top} modules by bytes saved for backward",
                    title_justify="left")
    modules.add_column("module", overflow="fold", min_width=24)
    modules.add_column("type")
    modules.add_column("output", no_wrap=True)
    modules.add_column("saved", justify="right", no_wrap=True)
    modules.add_column("fwd GFLOP", justify="right", no_wrap=True)
    for row in module_table(g, top):
        modules.add_row(row["label"], row["type"], row["output"],
                        format_bytes(row["saved_bytes"]), f"{row['fwd_flops'] / 1e9:,.1f}")
    console.print(modules)

    levels = Table(title="Saved bytes per resolution level", title_justify="left")
    levels.add_column("spatial size")
    levels.add_column("modules", justify="right")
    levels.add_column("saved", justify="right")
    levels.add_column("share", justify="right")
    for row in level_table(g):
        levels.add_row(row["level"], str(row["modules"]), format_bytes(row["saved_bytes"]),
                       f"{100 * row['saved_bytes'] / max(1, g.saved_bytes):.1f}%")
    console.print(levels)


@app.command("bench")
@_user_errors
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


# `train` and `demo` live in their own file; importing it registers them on `app`.
from remat3d import cli_train as _cli_train  # noqa: F401


def main() -> None:
    app()


if __name__ == "__main__":
    # run as `python -m remat3d.cli`: use the imported module, on whose app the commands
    # of cli_train registered themselves
    from remat3d.cli import main as _main

    _main()

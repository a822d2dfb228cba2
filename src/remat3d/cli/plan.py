"""``remat3d plan``: a plan under a budget, verified on meta; table, JSON, plot."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from remat3d.cli.common import build, console, progress, quiet_native_stdout
from remat3d.errors import Remat3dError
from remat3d.units import format_shape, parse_amp

__all__ = ["plan_command"]


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
    graph: bool = typer.Option(None, "--graph/--no-graph", show_default=False, help=(
        "--graph: plan the step's aten graph, not its modules (any op may be recomputed, "
        "a parent's own cat or add included; recompute only, no --offload). --no-graph: "
        "module plans only. Default: optimal plans the graph where a graph plan fits.")),
    compiled: bool = typer.Option(False, "--compiled", help=(
        "The model will run compiled: a graph plan whose graphs remat3d compiles with "
        "inductor when it is applied, or (--no-graph, or where no graph plan fits) "
        "recompute regions for torch.compile, verified without rebuilt saved tensors, "
        "which compiled graphs do not have. No tiling or offload: each breaks the graph.")),
    objective: str = typer.Option("time", "--objective", help=(
        "What the plan minimises: time (recomputed convolutions in FLOPs, recomputed "
        "norms and activations by their memory traffic) or flops (FLOPs only, as "
        "torch.compile's partitioner counts them).")),
    model_kwargs: str = typer.Option(None, "--model-kwargs",
                                     help="Constructor keyword arguments (JSON/YAML/file)."),
    out: str = typer.Option(None, "--out", "-o", help="Write the plan (JSON) here."),
    plot: str = typer.Option(None, "--plot", help="Write a PNG: overhead curve and timelines."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON only."),
) -> None:
    """Plan checkpointing so one training step fits a memory budget, verified on meta."""
    from remat3d.planning import check_objective
    from remat3d.planning import plan as make_plan
    from remat3d.profiling import profile
    from remat3d.units import format_bytes

    check_objective(objective)  # before the model is built and measured

    if graph and plot:
        raise Remat3dError("--plot draws the overhead curve of module plans; it does not "
                           "take --graph yet. Leave out one of them.")
    if plot:
        graph = False  # the curve and timelines are of module plans
    net, shape = build(model, input, model_kwargs)
    amp_ = parse_amp(amp)
    # stdout is the JSON alone with --json; otherwise a spinner writes there
    status = progress(f"planning {model} at {format_shape(shape)}") if not json_out \
        else quiet_native_stdout()
    with status:
        base = profile(net, shape, amp=amp_)
        result = make_plan(net, shape, budget=budget, strategy=strategy, offload=offload,
                           amp=amp_, tile=tile, host_budget=host_budget, graph=graph,
                           compiled=compiled, objective=objective)
    if out:
        result.save(out)
    if json_out:
        sys.stdout.write(json.dumps(result.to_dict()) + "\n")
        return
    if result.graph_recompute is not None:
        console.print(f"{model} {format_shape(shape)}: {result.notes[0]}", highlight=False)
    table = Table(title=f"{model} {format_shape(shape)} amp={amp}: "
                        f"{len(result.regions)} regions ({strategy})", title_justify="left")
    table.add_column("module", overflow="fold", min_width=24)
    table.add_column("decision")
    table.add_column("policy / tile")
    for region in result.regions:
        detail = str(region.policy or "")
        if region.tile:
            detail = format_shape(region.tile) + (" fused" if region.fuse else "") \
                + (" output on host" if region.host else "") \
                + (" output rebuilt" if region.rebuild else "") \
                + (" (rebuilt inputs in tiles)" if region.rebuild_in_tiles else "") \
                + (" (inputs handed on)" if region.hand_inputs else "") \
                + (f" stash on {region.stash}" if region.stash else "") \
                + (" (norms " + ",".join(map(str, region.stash_norms)) + ")"
                   if region.stash_norms is not None else "")
        table.add_row(region.label, region.decision, detail)
    if result.graph_recompute is None:
        console.print(table)
    elif result.graph_recompute:  # what the graph plan recomputes, by module
        where = Table(title=f"{model} {format_shape(shape)} amp={amp}: recomputed in "
                            f"backward ({strategy}, a graph plan)", title_justify="left")
        where.add_column("module", overflow="fold", min_width=24)
        where.add_column("ops recomputed", overflow="fold")
        for module, ops in result.recomputed_where():
            where.add_row(module, ops)
        console.print(where)
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
        console.print(f"plan written to [bold]{escape(str(out))}[/]", soft_wrap=True)
    if plot:
        _plot(plot, net, shape, result, base, amp_, offload, model, tile, objective,
              compiled)
        console.print(f"plot written to [bold]{escape(str(plot))}[/]", soft_wrap=True)


def _overhead(plan: Any, base: Any) -> float:
    """A plan's extra FLOPs as a fraction of the unplanned step's (tiled plans: every extra
    pass and halo; otherwise the recomputation)."""
    tiled = plan.tiled and plan.extra_flops is not None
    extra = plan.extra_flops if tiled else plan.recompute_flops
    return (extra or 0) / max(1, base.flops)


def _plot(path: str, net: Any, shape: tuple, result: Any, base: Any, amp: str | None,
          offload: bool, model: str, tile: bool = True, objective: str = "time",
          compiled: bool = False) -> None:
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
                p = make_plan(net, shape, budget=budget, offload=offload, amp=amp, tile=tile,
                              graph=False, objective=objective, compiled=compiled)
            except Remat3dError:
                continue
            curve.append((p.verified_peak_bytes or 0, _overhead(p, base)))
    plot_plan(path, title=f"{model} {format_shape(shape)} amp={amp or 'none'}",
              curve=curve,
              chosen=(result.verified_peak_bytes or 0, _overhead(result, base)),
              budget=result.budget_bytes or 0,
              unplanned=[e["live_after"] for e in base.timeline],
              planned=[e["live_after"] for e in timeline])

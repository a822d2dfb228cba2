"""``remat3d profile``: one training step measured, as tables or JSON."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from remat3d.cli.common import build, console
from remat3d.units import format_shape, parse_amp

__all__ = ["profile_command"]


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

    net, shape = build(model, input, model_kwargs)
    with console.status(f"profiling {model} at {format_shape(shape)} on {device}",
                        spinner="dots") if json_out != "-" else contextlib.nullcontext():
        prof = profile(net, shape, device=device, amp=parse_amp(amp))
    if json_out == "-":
        sys.stdout.write(json.dumps(prof.to_dict()) + "\n")
        return
    if json_out:
        prof.save(json_out)
    print_profile(prof, model, top)
    if json_out:
        console.print(f"profile written to [bold]{escape(str(json_out))}[/]", soft_wrap=True)


def print_profile(prof: Any, model: str, top: int) -> None:
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

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
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
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
    from remat3d import zoo
    from remat3d.profiling import profile
    from remat3d.units import parse_shape

    kwargs = zoo.parse_model_kwargs(model_kwargs)
    preset = zoo.PRESETS.get(model)
    if input is None:
        channels = int(kwargs.get("in_channels", preset.in_channels if preset else 1))
        shape = (1, channels, 128, 128, 128)
    else:
        shape = parse_shape(input)
    if preset is not None:
        zoo.check_input_shape(preset, shape, kwargs)
    if len(shape) < 3:
        raise Remat3dError(f"Input shape {input!r} needs batch, channels and spatial sizes.")
    net = zoo.build_model(model, kwargs, spatial_size=tuple(shape[2:]), device="meta")
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()

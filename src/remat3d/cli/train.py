"""``remat3d train``: fine-tune on whole volumes within a memory budget."""

from __future__ import annotations

import os
import shlex
import time

import typer
from rich.markup import escape
from rich.table import Table

from remat3d.cli.common import console, err_console
from remat3d.units import format_shape

__all__ = ["train_command"]


def train_command(
    ctx: typer.Context,
    config: str = typer.Argument(..., help="Settings file (YAML). See docs/training.md."),
    resume: bool = typer.Option(False, "--resume",
                                help="Continue the run in output_dir from its last state file."),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="Start afresh in an output_dir that holds a run, "
                                        "replacing its weights, state and log."),
) -> None:
    """Fine-tune a network on whole volumes within a memory budget.

    Any setting can be overridden after the file: --epochs=3 --memory_budget=12GiB
    --model_kwargs.out_channels=4. Unknown settings are refused.
    """
    from remat3d.train import load_settings, train
    from remat3d.units import format_bytes

    overrides = list(ctx.args)
    stray = [a for a in overrides if "=" not in a]
    if stray:
        raise typer.BadParameter(f"expected --key=value after the settings file, got "
                                 f"{' '.join(stray)}")
    settings = load_settings(config, overrides)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 talks
        console.quiet = True
    # paths are printed whole (soft_wrap: no line breaks inside them) and escaped, so they
    # can be copied from the terminal as they are
    console.print(f"[bold]remat3d train[/] {escape(str(settings.model))} on "
                  f"{escape(str(settings.data))} -> {escape(str(settings.output_dir))}",
                  highlight=False, soft_wrap=True)
    started = time.perf_counter()
    try:
        result = train(settings, resume=resume, overwrite=overwrite,
                       say=lambda m: console.print(m, highlight=False))
    except KeyboardInterrupt:
        again = shlex.join(["remat3d", "train", config, *overrides, "--resume"])
        err_console.print(f"[bold yellow]interrupted.[/] Continue from the last saved state "
                          f"with: {escape(again)}", highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    table = Table(title=f"{result.epochs} epochs, {result.steps} optimizer steps in "
                        f"{time.perf_counter() - started:.0f} s", title_justify="left")
    table.add_column("input shape")
    table.add_column("measured step peak", justify="right")
    table.add_column("verified step peak", justify="right")
    for shape, peak in sorted(result.peaks.items()):
        verified = result.verified_peaks.get(shape)
        table.add_row(format_shape(shape), format_bytes(peak),
                      format_bytes(verified) if verified is not None else "no plan")
    console.print(table)
    if result.validation:
        last = result.validation[-1]
        console.print(f"validation Dice (epoch {last['epoch']}): [bold]{last['dice']:.4f}[/]")
    console.print(f"weights: {escape(str(result.output_dir / 'model.pt'))}; log: "
                  f"{escape(str(result.output_dir / 'log.jsonl'))}", highlight=False,
                  soft_wrap=True)

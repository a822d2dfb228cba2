"""``remat3d train`` and ``remat3d demo``: the commands that train (registered on the app
of :mod:`remat3d.cli`; kept apart so each file holds one concern)."""

from __future__ import annotations

import os
import time

import typer
from rich.table import Table

from remat3d.cli import _user_errors, app, console, err_console

__all__ = ["demo_command", "train_command"]


@app.command("train", context_settings={"allow_extra_args": True,
                                        "ignore_unknown_options": True})
@_user_errors
def train_command(
    ctx: typer.Context,
    config: str = typer.Argument(..., help="Settings file (YAML). See docs/training.md."),
    resume: bool = typer.Option(False, "--resume",
                                help="Continue the run in output_dir from its last state file."),
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
    console.print(f"[bold]remat3d train[/] {settings.model} on {settings.data} -> "
                  f"{settings.output_dir}", highlight=False)
    started = time.perf_counter()
    try:
        result = train(settings, resume=resume, say=lambda m: console.print(m, highlight=False))
    except KeyboardInterrupt:
        err_console.print(f"[bold yellow]interrupted.[/] Continue from the last saved state "
                          f"with: remat3d train {config} --resume", highlight=False)
        raise typer.Exit(130) from None
    table = Table(title=f"{result.epochs} epochs, {result.steps} optimizer steps in "
                        f"{time.perf_counter() - started:.0f} s", title_justify="left")
    table.add_column("input shape")
    table.add_column("measured step peak", justify="right")
    table.add_column("plan verified peak", justify="right")
    for shape, peak in sorted(result.peaks.items()):
        plan = result.plans.get(shape)
        table.add_row("x".join(map(str, shape)), format_bytes(peak),
                      format_bytes(plan.verified_peak_bytes or 0) if plan else "no plan")
    console.print(table)
    if result.validation:
        last = result.validation[-1]
        console.print(f"validation Dice (epoch {last['epoch']}): [bold]{last['dice']:.4f}[/]")
    console.print(f"weights: {result.output_dir / 'model.pt'}; log: "
                  f"{result.output_dir / 'log.jsonl'}", highlight=False)


@app.command("demo")
@_user_errors
def demo_command(
    out: str = typer.Option("remat3d-demo", "--out", "-o", help="Folder for data, runs and "
                            "the figure."),
    budget: str = typer.Option("0.65x", "--budget", help="Memory budget of the fine-tuning "
                               "step (a fraction of its unplanned peak, or a size)."),
    epochs: int = typer.Option(24, "--epochs", help="Fine-tuning epochs (one volume each)."),
) -> None:
    """Pretrain on CT phantoms, fine-tune on a real MRI volume under a memory budget.

    Offline, on CPU, a few minutes: shows the plan, the measured peak with and without it,
    the bitwise gradient check, Dice before and after, and writes demo.png.
    """
    from remat3d.train.demo import run_demo
    from remat3d.units import format_bytes

    result = run_demo(out, budget=budget, finetune_epochs=epochs,
                      say=lambda m: console.print(m, highlight=False))
    console.print(result.plan_summary, highlight=False)
    table = Table(title="one real CPU training step of the fine-tuning model (whole volume)",
                  title_justify="left")
    table.add_column("")
    table.add_column("measured peak", justify="right")
    table.add_row("no checkpointing", format_bytes(result.peak_unplanned))
    table.add_row("remat3d plan", f"[bold]{format_bytes(result.peak_planned)}[/]")
    console.print(table)
    ok = "[bold green]" if result.gradients_equal else "[bold red]"
    console.print(f"{ok}{result.gradient_check}[/]", highlight=False)
    console.print(f"validation Dice: {result.dice_before:.4f} before fine-tuning -> "
                  f"[bold]{result.dice_after:.4f}[/] after", highlight=False)
    console.print(f"figure: {result.figure}; finished in {result.seconds:.0f} s",
                  highlight=False)
    if not result.gradients_equal:
        raise typer.Exit(1)

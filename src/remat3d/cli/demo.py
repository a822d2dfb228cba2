"""``remat3d demo``: pretrain on phantoms, fine-tune on a real MRI under a budget."""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from remat3d.cli.common import console

__all__ = ["demo_command"]


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
    console.print(f"figure: {escape(str(result.figure))}; finished in {result.seconds:.0f} s",
                  highlight=False, soft_wrap=True)
    if not result.gradients_equal:
        raise typer.Exit(1)

"""``remat3d nnunet train``: nnU-Net v2's own training, on whole volumes under a budget.

``nnUNetv2_train`` only finds trainers inside nnU-Net's package, so this command does what
it does in one process with remat3d's trainer (``remat3d.train.nnunet``): the same
arguments, nnU-Net's folders from its environment variables, its usual outputs.
"""

from __future__ import annotations

import importlib.util

import typer
from rich.markup import escape

from remat3d.cli.common import console, user_errors
from remat3d.errors import Remat3dError

__all__ = ["nnunet_app"]

nnunet_app = typer.Typer(help="nnU-Net v2's own training on whole volumes under a memory "
                              "budget (pip install 'remat3d[nnunet]').",
                         no_args_is_help=True)


def train_command(
    dataset: str = typer.Argument(..., help="Dataset name or ID, as for nnUNetv2_train."),
    configuration: str = typer.Argument(..., help="Configuration, e.g. 3d_fullres."),
    fold: str = typer.Argument(..., help="Fold: 0-4, or all."),
    budget: str = typer.Option("auto", "--budget", "-b", help=(
        "The training step's memory: 24GiB, 0.5x (of the unplanned step), or auto (the "
        "device's free memory; on CPU, no limit).")),
    offload: bool = typer.Option(False, "--offload", help="Allow host memory in the plan."),
    plans: str = typer.Option("nnUNetPlans", "--plans", "-p", help="Plans identifier."),
    device: str = typer.Option("auto", "--device", help="cuda, cpu, or auto."),
    epochs: int = typer.Option(None, "--epochs", help="Epochs (default: nnU-Net's 1000)."),
    iterations: int = typer.Option(None, "--iterations-per-epoch",
                                   help="Training iterations per epoch (default: nnU-Net's "
                                        "250; validation gets a fifth)."),
    continue_training: bool = typer.Option(
        False, "--c", help="Continue from the last checkpoint, as nnUNetv2_train --c."),
    pretrained: str = typer.Option(None, "--pretrained_weights",
                                   help="Initial weights (.pth), as nnUNetv2_train's."),
) -> None:
    """Train an nnU-Net v2 configuration with nnU-Net's trainer on whole volumes, planned by
    remat3d under --budget; outputs go where nnUNetv2_train puts them
    (nnUNetTrainerRemat3d__PLANS__CONFIGURATION/fold_F)."""
    if importlib.util.find_spec("nnunetv2") is None:
        raise Remat3dError("remat3d nnunet needs nnU-Net v2, which is not installed. Install "
                           "it with: pip install 'remat3d[nnunet]'")
    from remat3d.train.nnunet import NnUNetRun, train_nnunet

    if fold != "all" and not fold.isdigit():
        raise Remat3dError(f"Fold must be 0-4 or all, got {fold!r}.")
    run = NnUNetRun(budget=budget, offload=offload, epochs=epochs,
                    iterations_per_epoch=iterations)
    out = train_nnunet(dataset, configuration, fold, run, plans_identifier=plans,
                       device=device, continue_training=continue_training,
                       pretrained=pretrained)
    console.print(f"nnU-Net outputs: {escape(str(out))}", soft_wrap=True)


nnunet_app.command("train")(user_errors(train_command))

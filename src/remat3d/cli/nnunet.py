"""``remat3d nnunet train`` and ``predict``: nnU-Net v2's own training and prediction, on
whole volumes under a budget.

``nnUNetv2_train`` only finds trainers inside nnU-Net's package, so this command does what
it does in one process with remat3d's trainer (``remat3d.train.nnunet``): the same
arguments, nnU-Net's folders from its environment variables, its usual outputs.
``predict`` is ``nnUNetv2_predict`` with one window per case, the whole volume
(``remat3d.infer.nnunet``), in one process: nnUNetv2_predict's main arguments and outputs.
"""

from __future__ import annotations

import importlib.util

import typer
from rich.markup import escape

from remat3d.cli.common import console, user_errors
from remat3d.errors import Remat3dError
from remat3d.units import format_shape

__all__ = ["nnunet_app"]

nnunet_app = typer.Typer(help="nnU-Net v2's own training and prediction on whole volumes "
                              "under a memory budget (pip install 'remat3d[nnunet]').",
                         no_args_is_help=True)


def _require_nnunet() -> None:
    if importlib.util.find_spec("nnunetv2") is None:
        raise Remat3dError("remat3d nnunet needs nnU-Net v2, which is not installed. Install "
                           "it with: pip install 'remat3d[nnunet]'")


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
    _require_nnunet()
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


# a list option's default, built once (ruff B008)
_FOLDS = typer.Option(None, "-f", help=(
    "Folds: -f 0 1 2 3 4, or all (default: every fold_N with the checkpoint, else fold_all); "
    "several are averaged, as nnU-Net does."))


def predict_command(
    ctx: typer.Context,
    input_folder: str = typer.Option(..., "-i", help=(
        "Input folder: images named CASE_0000.nii.gz, CASE_0001.nii.gz... (one file per "
        "channel, the training data's file ending).")),
    output_folder: str = typer.Option(..., "-o", help=(
        "Output folder (made if missing); CASE.nii.gz per case, as nnUNetv2_predict.")),
    dataset: str = typer.Option(..., "-d", help="Dataset name or ID."),
    configuration: str = typer.Option(..., "-c", help="Configuration, e.g. 3d_fullres."),
    folds: list[str] | None = _FOLDS,
    trainer: str = typer.Option(None, "-tr", help=(
        "Trainer (default: nnUNetTrainerRemat3d where remat3d nnunet train made that "
        "model, else nnUNetTrainer, nnUNetv2_predict's default).")),
    plans: str = typer.Option("nnUNetPlans", "-p", help="Plans identifier."),
    checkpoint: str = typer.Option("checkpoint_final.pth", "-chk", help="Checkpoint name."),
    save_probabilities: bool = typer.Option(False, "--save_probabilities", help=(
        "Also write CASE.npz (probabilities) and CASE.pkl, as nnUNetv2_predict.")),
    disable_tta: bool = typer.Option(False, "--disable_tta", help=(
        "No test-time mirroring (one forward per case and fold instead of up to 8).")),
    continue_prediction: bool = typer.Option(False, "--continue_prediction", help=(
        "Skip cases already written (default: overwrite them, as nnUNetv2_predict).")),
    budget: str = typer.Option("auto", "--budget", "-b", help=(
        "The forward's device memory: 8GiB, 0.5x (of the untiled forward), or auto (the "
        "device's free memory; on CPU, the untiled forward).")),
    amp: str = typer.Option("auto", "--amp", help=(
        "bf16, fp16, none, or auto (fp16 on CUDA, as nnU-Net's predictor; none on CPU).")),
    device: str = typer.Option("auto", "--device", help="cuda, cpu, or auto."),
) -> None:
    """Predict with a trained nnU-Net v2 model as nnUNetv2_predict does (its preprocessing,
    mirroring, fold ensemble and export), the network run once on each whole case under
    --budget instead of in sliding windows."""
    _require_nnunet()
    from remat3d.cli.common import progress
    from remat3d.infer.nnunet import predict_nnunet

    folds = [*(folds or []), *ctx.args]  # -f 0 1 2: the values after the first
    if ctx.args and len(folds) == len(ctx.args):
        raise Remat3dError(f"Unexpected arguments {' '.join(ctx.args)}: folds follow -f "
                           "(-f 0 1 2).")
    with progress("nnU-Net prediction on whole volumes"):
        result = predict_nnunet(
            input_folder, output_folder, dataset, configuration, folds=folds or None,
            trainer=trainer, plans=plans, checkpoint=checkpoint,
            save_probabilities=save_probabilities, use_mirroring=not disable_tta,
            budget=budget, amp=None if amp == "none" else amp, device=device,
            continue_prediction=continue_prediction)
    console.print(f"model: {escape(str(result.model_folder))} (folds "
                  f"{', '.join(result.folds)})", soft_wrap=True)
    shown: set[str] = set()
    for case in result.cases:
        console.print(f"{escape(case.case)}: {format_shape(case.shape[1:])} as "
                      f"{format_shape(case.padded_shape[1:])}, {case.tiled_steps} tiled steps",
                      soft_wrap=True, highlight=False)
        if case.plan_summary not in shown:
            shown.add(case.plan_summary)
            console.print(f"  {escape(case.plan_summary)}", soft_wrap=True, highlight=False)
    if result.skipped:
        console.print(f"already predicted (--continue_prediction): "
                      f"{escape(', '.join(result.skipped))}", soft_wrap=True)
    console.print(f"nnU-Net outputs: {escape(str(result.output_folder))}", soft_wrap=True)


nnunet_app.command("predict", context_settings={"allow_extra_args": True})(
    user_errors(predict_command))

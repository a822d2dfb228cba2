"""``remat3d demo``: the main job end to end, offline, on CPU, in a few minutes.

1. Pretrain a small 3D U-Net on synthetic CT-like phantoms (no real CT ships offline).
2. Save its weights the way a DDP run does (every key prefixed ``module.``).
3. Fine-tune it on a real MRI volume, the MNI ICBM152 T1 template that nilearn ships, with
   grey/white-matter labels from the template's tissue maps, as a whole volume (resampled to
   ``spacing`` mm), with a new 3-class head, under a memory budget tight enough that the plan
   must recompute.
4. Report the plan, the measured peak of a real step with and without it, the bitwise
   gradient check against the unplanned step, Dice before and after, and write a PNG.

Everything goes through the same code as ``remat3d train``: the datasets are written as
NIfTI files with an MSD ``dataset.json`` and read back by the loaders.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from remat3d.train.settings import TrainSettings

__all__ = ["DemoResult", "run_demo"]

logger = logging.getLogger(__name__)

_UNET = {"channels": [8, 16, 32, 64, 128], "strides": [2, 2, 2, 2], "num_res_units": 1}


@dataclass
class DemoResult:
    output_dir: Path
    plan_summary: str
    budget_bytes: int
    peak_unplanned: int
    peak_planned: int
    gradients_equal: bool
    gradient_check: str
    dice_before: float
    dice_after: float
    figure: Path
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)


def run_demo(output_dir: str | Path = "remat3d-demo", *, budget: str = "0.65x",
             pretrain_epochs: int = 3, finetune_epochs: int = 24, spacing: float = 3.0,
             say: Callable[[str], None] = logger.info, progress: bool = True) -> DemoResult:
    """Run the demo; files go to ``output_dir`` (datasets, runs, ``demo.png``)."""
    from remat3d.data.examples import write_mni_dataset, write_phantom_dataset
    from remat3d.train.trainer import Trainer, deterministic
    from remat3d.train.weights import read_state_dict

    started = time.perf_counter()
    timings: dict[str, float] = {}
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)

    # 1. pretraining on CT phantoms
    say("[1/4] pretraining a small 3D U-Net on synthetic CT phantoms")
    phantoms = write_phantom_dataset(out / "data" / "phantoms", cases=6, shape=(48, 48, 32))
    pre = TrainSettings(
        model="unet", model_kwargs={**_UNET, "out_channels": 2}, data=str(phantoms),
        intensity="ct", ct_window=[-200.0, 300.0], val_fraction=0.0, epochs=pretrain_epochs,
        lr=3e-3, output_dir=str(out / "runs" / "pretrain"), progress=progress, seed=0)
    with deterministic(pre):
        pretrainer = Trainer(pre, say=say)
        pretrainer.fit()
    timings["pretrain"] = time.perf_counter() - started

    # 2. the checkpoint as a DDP run leaves it: keys prefixed "module."
    weights = out / "runs" / "pretrain" / "pretrained_ddp.pt"
    state = read_state_dict(out / "runs" / "pretrain" / "model.pt")
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, weights)

    # 3. fine-tuning on the MNI152 T1 volume, whole, under a tight budget
    say("[2/4] fine-tuning on a real MRI volume (MNI152 T1, nilearn) under a memory budget")
    mni = write_mni_dataset(out / "data" / "mni152")
    fine = TrainSettings(
        model="unet", model_kwargs={**_UNET, "out_channels": 3}, pretrained=str(weights),
        data=str(mni), intensity="mr", spacing=[spacing] * 3, epochs=finetune_epochs,
        lr=3e-3, memory_budget=budget, output_dir=str(out / "runs" / "finetune"),
        progress=progress, seed=0, val_every=finetune_epochs)
    with deterministic(fine):
        trainer = Trainer(fine, say=say)
        plans = trainer.make_plans()
        shape, plan = next(iter(plans.items()))
        assert plan is not None
        dice_before = trainer.validate()["dice"]
        say(f"validation Dice before fine-tuning: {dice_before:.4f}")

        say("[3/4] one real step with and without the plan: measured peak and gradients")
        check = _measure(trainer, plan)
        timings["measure"] = time.perf_counter() - started
        trainer.fit()
        dice_after = trainer.validate()["dice"]
    timings["finetune"] = time.perf_counter() - started

    say("[4/4] writing the figure")
    figure = out / "demo.png"
    _figure(figure, trainer, check)
    extra = trainer.extra_bytes(shape)
    return DemoResult(
        output_dir=out, plan_summary=plan.summary(),
        budget_bytes=(plan.budget_bytes or 0) + extra,
        peak_unplanned=check["gradients"].peaks["unplanned"],
        peak_planned=check["gradients"].peaks["planned"],
        gradients_equal=check["gradients"].equal, gradient_check=str(check["gradients"]),
        dice_before=dice_before, dice_after=dice_after, figure=figure,
        seconds=time.perf_counter() - started, timings=timings)


def _measure(trainer: Any, plan: Any) -> dict[str, Any]:
    """One real step of the fine-tuning model on the real volume without and with the plan,
    under the tracker and with the training loss: peaks, timelines, bitwise gradient check."""
    from remat3d.train.gradcheck import check_plan_gradients

    sample = trainer.load_batch([0], 0)
    loss = lambda output: trainer.loss_fn(output.float(), sample.label)
    trainer.use_plan(None)
    check = check_plan_gradients(trainer.model, plan, sample.image, loss,
                                 autocast=trainer.autocast, measure=True)
    return {"gradients": check, "sample": sample}


def _figure(path: Path, trainer: Any, check: dict[str, Any]) -> None:
    """Memory timeline (unplanned vs planned real step) and a slice with the prediction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sample = check["sample"]
    prediction = trainer.predict(sample).numpy()
    image = sample.image[0, 0, : sample.shape[0], : sample.shape[1], : sample.shape[2]].numpy()
    truth = sample.label[0, 0, : sample.shape[0], : sample.shape[1], : sample.shape[2]].numpy()
    z = int(np.argmax((truth > 0).sum(axis=(0, 1))))
    mib = 2**20
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    timeline = axes[0]
    measured = check["gradients"]
    for key, label in (("unplanned", "no checkpointing"), ("planned", "remat3d plan")):
        live = [b / mib for b in measured.timelines[key]]
        timeline.plot(live, label=f"{label} (peak {measured.peaks[key] / mib:.0f} MiB)")
    budget = next(iter(trainer.plans.values()))
    if budget is not None and budget.budget_bytes is not None:
        timeline.axhline(budget.budget_bytes / mib, color="grey", linestyle="--",
                         label="budget for the step")
    timeline.set_xlabel("op (forward, then backward)")
    timeline.set_ylabel("live memory (MiB)")
    timeline.set_title("one real CPU training step, whole volume")
    timeline.legend(fontsize=8)
    colours = matplotlib.colors.ListedColormap([(0, 0, 0, 0), (1, 0.3, 0.2, 0.45),
                                                (0.2, 0.6, 1, 0.45)])
    for ax, labels, title in ((axes[1], truth, "labels (from the MNI tissue maps)"),
                              (axes[2], prediction, "fine-tuned prediction")):
        ax.imshow(image[:, :, z].T, cmap="gray", origin="lower")
        ax.imshow(labels[:, :, z].T, cmap=colours, vmin=0, vmax=2, origin="lower",
                  interpolation="nearest")
        ax.set_title(f"{title}, axial slice {z}")
        ax.axis("off")
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)

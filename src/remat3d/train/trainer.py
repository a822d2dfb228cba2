"""The training loop: whole volumes, a plan fitted to the memory budget, exact resume.

Reads top to bottom: :class:`Trainer` sets up (model, weights, data, plans) in ``__init__``,
then :meth:`Trainer.fit` runs the epochs. Every step is one whole (padded) volume, or
``batch_size`` volumes of one shape; volumes of different shapes each get their own plan,
made once per shape and swapped in when the shape changes.

Loss: Dice + cross-entropy (MONAI ``DiceCELoss``) on softmax outputs, in fp32. Validation:
mean Dice over the foreground classes (MONAI ``compute_dice``) on the unpadded volume.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from remat3d.data.datalist import read_datalist, split_validation
from remat3d.data.dataset import VolumeDataset
from remat3d.data.padding import Geometry, probe_geometry
from remat3d.errors import DataError, SettingsError
from remat3d.instrument.amp import amp_dtype
from remat3d.planspec import Plan
from remat3d.train.distributed import join, leave, wrap_model
from remat3d.train.fit import Fitting, Interrupted, TrainResult
from remat3d.train.plans import StepPlans
from remat3d.train.settings import TrainSettings
from remat3d.train.step import Steps
from remat3d.train.validation import Validation
from remat3d.train.weights import LoadReport, apply_freeze, load_pretrained
from remat3d.units import format_shape

__all__ = ["Interrupted", "TrainResult", "Trainer", "deterministic", "model_geometry",
           "resolve_device", "seed_everything", "train"]

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]

def train(settings: TrainSettings, *, resume: bool = False, overwrite: bool = False,
          say: Callable[[str], None] = logger.info,
          interrupt_after: int | None = None) -> TrainResult:
    """Run ``settings`` to the end (or continue an interrupted run with ``resume=True``).

    A new run refuses an ``output_dir`` that already holds one (its weights, state file or
    log) unless ``overwrite=True``."""
    with deterministic(settings):
        trainer = Trainer(settings, say=say)
        world = trainer.world
        try:
            return trainer.fit(resume=resume, overwrite=overwrite,
                               interrupt_after=interrupt_after)
        finally:
            # (a finished fit() ends with a barrier: every rank is past its last
            # collective before the group is destroyed; after an error, no barrier: the
            # other ranks may be gone). The model goes first, then its process group:
            # NOTE [ Distributed training ] rule 6 in distributed.py.
            del trainer
            leave(world)


@contextlib.contextmanager
def deterministic(settings: TrainSettings) -> Iterator[None]:
    """Deterministic algorithms for the run, restored afterwards (a library call must not
    leave global switches changed)."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark)
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if settings.deterministic and workspace is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS's deterministic mode
    if settings.deterministic:
        # CUDA lacks deterministic kernels for a few backward ops (e.g. trilinear upsampling):
        # there it warns instead of failing; on CPU every op used here is deterministic.
        torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())
        torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def model_geometry(spec: str, model_kwargs: dict[str, Any], model: nn.Module,
                   divisible_by: int | None = None) -> Geometry:
    """What a segmentation network built from ``spec`` needs of its input: a preset's own
    divisibility rule where its geometry is the default one, else probed on meta."""
    from remat3d import zoo

    if spec.strip().lower() in zoo.preset_names():
        preset = zoo.get_preset(spec)
        if preset.task != "segmentation":
            raise SettingsError(
                f"Preset {preset.name!r} is a {preset.task} network; remat3d trains and "
                "predicts with segmentation networks (nnunet, unet, basicunet, segresnet, "
                "swinunetr, unetr)."
            )
        in_channels = int(model_kwargs.get("in_channels", preset.in_channels))
        if set(model_kwargs) - zoo.SIZE_NEUTRAL_KWARGS:  # strides, depth: ask it
            return probe_geometry(model, in_channels, divisible_by)
        divisor = divisible_by or preset.divisor
        probed = probe_geometry(model, in_channels, divisible_by=divisor)
        return Geometry(in_channels, probed.out_channels, divisor, preset.min_size,
                        reason=preset.min_size_rule)
    return probe_geometry(model, model_kwargs.get("in_channels"), divisible_by)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SettingsError(f"Setting device={name!r}, but there is no CUDA device here. "
                            "Use device: cpu (or auto).")
    return device


class Trainer(StepPlans, Steps, Validation, Fitting):
    """A configured run: model (with pretrained weights and freezing), data, loss, plans.

    ``__init__`` sets up (this file); the step's plans and budget (``plans.py``), the
    steps (``step.py``), validation (``validation.py``) and the run with its state files
    (``fit.py``) are the mixins it is made of, one concept per file. The mixins read the
    attributes ``__init__`` sets (``settings``, ``model``, ``engine``, ``world``, ``device``,
    ``plans``, ...) and are not used alone."""

    def __init__(self, settings: TrainSettings, *, say: Callable[[str], None] = logger.info,
                 model: nn.Module | None = None) -> None:
        settings.validate()
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.world = join(settings.distributed, self.device.type)
        try:
            self._set_up(settings, say, model)
        except BaseException:
            # a set-up that fails (bad data, settings, weights, an infeasible budget) leaves
            # no process group behind: NOTE [ Distributed training ] rule 6
            leave(self.world)
            raise

    def _set_up(self, settings: TrainSettings, say: Callable[[str], None],
                model: nn.Module | None) -> None:
        from monai.losses import DiceCELoss

        if self.world.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.world.local_rank)
            torch.cuda.set_device(self.device)
        self.say = say if self.world.main else (lambda message: None)
        self.amp = amp_dtype(settings.amp)
        self.output_dir = Path(settings.output_dir)
        seed_everything(settings.seed)
        self.model, self.load_report = self._build_model(model)
        self.engine: nn.Module = self.model  # what a training step calls (DDP/FSDP wrap it)
        self.geometry = self._geometry()
        self.train_set, self.val_set = self._datasets()
        self.loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
        self.plans: dict[Shape, Plan | None] = {}
        self.peaks: dict[Shape, int] = {}
        self._applied: Shape | None = None
        self._peak_final: set[Shape] = set()
        self.step_shapes = self.train_set.check()
        self.val_shapes = self.val_set.check() if self.val_set else []
        if settings.batch_size > 1 and len(set(self.step_shapes)) > 1:
            raise DataError(
                f"batch_size={settings.batch_size} needs volumes of one shape, but the padded "
                f"volumes have {len(set(self.step_shapes))} shapes "
                f"({', '.join(format_shape(s) for s in sorted(set(self.step_shapes))[:4])}"
                "). Use batch_size: 1 with accumulate: N for the same effective batch."
            )
        if self.world.enabled:
            if self.world.mode == "fsdp" and self.amp is torch.float16:
                raise SettingsError("distributed: fsdp with amp: fp16 is not supported (it "
                                    "needs a sharded gradient scaler); use amp: bf16.")
            # plans first (made on rank 0, broadcast), then wrap: FSDP2 shards in place
            self.make_plans()
            self.engine = wrap_model(self.model, self.world, self.device)
            if self.world.mode == "fsdp":
                # FSDP2 renames the classes it shards (UNet -> FSDPUNet); the module tree and
                # parameters the plans were verified on are unchanged: re-stamp copies
                from remat3d.runtime.fingerprint import model_fingerprint

                stamp = model_fingerprint(self.model)
                for key, plan in self.plans.items():
                    if plan is not None:
                        self.plans[key] = Plan.from_dict({**plan.to_dict(),
                                                          "model_fingerprint": stamp})
        # after wrapping: under FSDP2 the optimizer must hold the sharded parameters
        self.optimizer = self._optimizer()
        self.scaler = (torch.amp.GradScaler(self.device.type) if self.amp is torch.float16
                       else None)

    # ------------------------------------------------------------------ set-up

    def _build_model(self, model: nn.Module | None) -> tuple[nn.Module, LoadReport | None]:
        from remat3d import zoo

        s = self.settings
        if model is None:
            model = zoo.build_model(s.model, s.model_kwargs)
        report = None
        if s.pretrained:
            report = load_pretrained(model, s.pretrained)
            self.say(str(report))
        frozen = apply_freeze(model, s.freeze, s.unfreeze)
        if frozen:
            self.say(f"frozen: {len(frozen)} parameter tensors ({', '.join(frozen[:4])}"
                     f"{' …' if len(frozen) > 4 else ''})")
        return model.to(self.device), report

    def _geometry(self) -> Geometry:
        s = self.settings
        return model_geometry(s.model, s.model_kwargs, self.model, s.divisible_by)

    def _datasets(self) -> tuple[VolumeDataset, VolumeDataset | None]:
        s = self.settings
        datalist = read_datalist(s.data)
        training, validation = datalist.training, datalist.validation
        if not validation:
            training, validation = split_validation(training, s.val_fraction, s.seed)
        prep = s.preprocessing()
        patch = tuple(s.patch_size) if s.patch_size else None
        train_set = VolumeDataset(training, prep, self.geometry, cache=s.cache,
                                  patch_size=patch, seed=s.seed)  # type: ignore[arg-type]
        val_set = (VolumeDataset(validation, prep, self.geometry, cache=s.cache)
                   if validation else None)
        self.say(f"data: {len(training)} training and {len(validation)} validation volume(s) "
                 f"from {datalist.source}")
        return train_set, val_set

    def _optimizer(self) -> torch.optim.Optimizer:
        s = self.settings
        loaded = set(self.load_report.loaded) if self.load_report else set()
        pretrained: list[nn.Parameter] = []
        new: list[nn.Parameter] = []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (pretrained if name in loaded else new).append(p)
        if not pretrained and not new:
            raise SettingsError("Every parameter is frozen: nothing to train. Loosen "
                                "'freeze' or add 'unfreeze' patterns.")
        groups = [g for g in (
            {"params": new, "lr": s.lr},
            {"params": pretrained, "lr": s.lr if s.pretrained_lr is None else s.pretrained_lr},
        ) if g["params"]]
        if s.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=s.lr, momentum=0.99, nesterov=True,
                                   weight_decay=s.weight_decay)
        return torch.optim.AdamW(groups, lr=s.lr, weight_decay=s.weight_decay)

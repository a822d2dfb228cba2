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
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from remat3d.data.datalist import read_datalist, split_validation
from remat3d.data.dataset import Sample, VolumeDataset
from remat3d.data.padding import Geometry, crop_back, probe_geometry
from remat3d.data.volumes import Preprocessing
from remat3d.errors import BudgetError, DataError, Remat3dError, SettingsError
from remat3d.graph import atomic_write_text
from remat3d.instrument.amp import amp_dtype
from remat3d.planspec import Plan
from remat3d.train.distributed import barrier, broadcast_object, join, wrap_model
from remat3d.train.settings import TrainSettings
from remat3d.train.state import (
    check_resumable,
    load_state,
    rng_state,
    save_state,
    set_rng_state,
)
from remat3d.train.weights import LoadReport, apply_freeze, load_pretrained
from remat3d.units import format_bytes, format_shape, parse_amp

__all__ = ["Interrupted", "TrainResult", "Trainer", "train"]

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]


class Interrupted(Exception):
    """Raised by ``interrupt_after``: stands in for a killed process in tests."""


@dataclass
class TrainResult:
    output_dir: Path
    epochs: int
    steps: int                                   # optimizer steps
    losses: list[float] = field(default_factory=list)           # per micro-batch
    validation: list[dict[str, Any]] = field(default_factory=list)
    peaks: dict[Shape, int] = field(default_factory=dict)       # measured, per input shape
    plans: dict[Shape, Plan] = field(default_factory=dict)


def train(settings: TrainSettings, *, resume: bool = False,
          say: Callable[[str], None] = logger.info,
          interrupt_after: int | None = None) -> TrainResult:
    """Run ``settings`` to the end (or continue an interrupted run with ``resume=True``)."""
    with _deterministic(settings):
        trainer = Trainer(settings, say=say)
        try:
            return trainer.fit(resume=resume, interrupt_after=interrupt_after)
        finally:
            if trainer.world.enabled:
                import torch.distributed as dist

                dist.destroy_process_group()


@contextlib.contextmanager
def _deterministic(settings: TrainSettings) -> Iterator[None]:
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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SettingsError(f"Setting device={name!r}, but there is no CUDA device here. "
                            "Use device: cpu (or auto).")
    return device


class Trainer:
    """A configured run: model (with pretrained weights and freezing), data, loss, plans."""

    def __init__(self, settings: TrainSettings, *, say: Callable[[str], None] = logger.info,
                 model: nn.Module | None = None) -> None:
        from monai.losses import DiceCELoss

        settings.validate()
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.world = join(settings.distributed, self.device.type)
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
                from remat3d.runtime.apply import model_fingerprint

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
        from remat3d import zoo

        s = self.settings
        if s.model.strip().lower() in zoo.preset_names():
            preset = zoo.get_preset(s.model)
            if preset.task != "segmentation":
                raise SettingsError(
                    f"Preset {preset.name!r} is a {preset.task} network; remat3d train "
                    "fine-tunes segmentation networks (nnunet, unet, basicunet, segresnet, "
                    "swinunetr, unetr)."
                )
            in_channels = int(s.model_kwargs.get("in_channels", preset.in_channels))
            divisor = s.divisible_by or preset.divisor
            probed = probe_geometry(self.model, in_channels, divisible_by=divisor)
            return Geometry(in_channels, probed.out_channels, divisor, preset.min_size,
                            reason=preset.min_size_rule)
        return probe_geometry(self.model, s.model_kwargs.get("in_channels"), s.divisible_by)

    def _datasets(self) -> tuple[VolumeDataset, VolumeDataset | None]:
        s = self.settings
        datalist = read_datalist(s.data)
        training, validation = datalist.training, datalist.validation
        if not validation:
            training, validation = split_validation(training, s.val_fraction, s.seed)
        prep = Preprocessing(
            orientation=s.orientation,
            spacing=tuple(s.spacing) if s.spacing else None,  # type: ignore[arg-type]
            intensity=s.intensity, ct_window=tuple(s.ct_window),  # type: ignore[arg-type]
        )
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

    # ------------------------------------------------------------------ plans

    def input_shape(self, spatial: Shape, batch: int | None = None) -> Shape:
        return (batch or self.settings.batch_size, self.geometry.in_channels, *spatial)

    def planning_loss(self, shape: Shape) -> Callable[[Any], torch.Tensor]:
        """The training loss against a meta label, so the plan counts what the loss keeps."""
        label = torch.zeros((shape[0], 1, *shape[2:]), dtype=torch.long, device="meta")
        scale = 1.0 / self.settings.accumulate  # as in forward_backward, to the byte
        return lambda output: self.loss_fn(output.float(), label) * scale

    def extra_bytes(self, shape: Shape) -> int:
        """Bytes a training step holds beyond what ``remat3d.plan`` measures (negative: fewer).

        - The optimizer state (AdamW: two moments and a step count per trainable weight;
          SGD: one momentum buffer), alive through every step after the first.
        - DDP: its gradient buckets, allocated once and alive through the whole step.
        - FSDP2: parameters, gradients and optimizer state divided by the world size, plus
          the largest unit's unsharded parameters and gradients in flight; the plan measured
          them whole, so the difference is given back to the step.
        (The label is in the planned step already: the planning loss reads a meta label of
        the same shape and dtype.)
        """
        weights = [p for p in self.model.parameters() if p.requires_grad]
        trainable = sum(p.numel() * p.element_size() for p in weights)
        if self.settings.optimizer == "adamw":
            optimizer = 2 * trainable + 4 * len(weights)
        else:
            optimizer = trainable
        if self.world.mode == "ddp":
            return optimizer + trainable
        if self.world.mode == "fsdp":
            size = self.world.size
            everything = sum(p.numel() * p.element_size() for p in self.model.parameters())
            units = [sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1)
                         for p in child.parameters()) for child in self.model.children()]
            sharded = (everything + trainable) * (size - 1) // size
            return optimizer // size - max(0, sharded - max(units, default=0))
        return optimizer

    def make_plans(self) -> dict[Shape, Plan | None]:
        """One verified plan per distinct input shape; distributed: made on rank 0 and
        broadcast as plain data, so every rank applies the same plan."""
        if not self.world.enabled:
            return self._plan_shapes()
        made: dict[str, Any] = {}
        if self.world.main:
            try:
                made = {"plans": [(k, v.to_dict() if v else None)
                                  for k, v in self._plan_shapes().items()]}
            except Remat3dError as exc:
                made = {"error": str(exc)}
                broadcast_object(made, self.world)
                raise
        made = broadcast_object(made, self.world)
        if "error" in made:
            raise Remat3dError(f"rank 0 could not plan: {made['error']}")
        self.plans = {tuple(k): (Plan.from_dict(v) if v else None) for k, v in made["plans"]}
        return self.plans

    def _plan_shapes(self) -> dict[Shape, Plan | None]:
        """One verified plan per distinct input shape (none if memory_budget is 'none').

        The budget is for the whole step: the planner gets it less :meth:`extra_bytes`, and
        a fraction like ``"0.5x"`` is of the unplanned step including those bytes.
        """
        import remat3d
        from remat3d.planning import resolve_budget

        s = self.settings
        amp = parse_amp(s.amp)
        for spatial in sorted(set(self.step_shapes)):
            shape = self.input_shape(spatial)
            if shape in self.plans:
                continue
            if s.memory_budget.strip().lower() == "none":
                self.plans[shape] = None
                continue
            started = time.perf_counter()
            loss_fn = self.planning_loss(shape)
            extra = self.extra_bytes(shape)
            unplanned = remat3d.profile(self.model, shape, amp=amp, loss_fn=loss_fn).peak_bytes
            budget = resolve_budget(s.memory_budget, unplanned + extra)
            if budget <= extra:
                raise BudgetError(
                    f"memory_budget {s.memory_budget!r} ({format_bytes(budget)}) does not even "
                    f"hold the optimizer state ({format_bytes(extra)}) of a "
                    f"{format_shape(shape)} step; the unplanned step needs "
                    f"{format_bytes(unplanned + extra)}. Raise the budget."
                )
            try:
                plan = remat3d.plan(self.model, shape, budget=budget - extra,
                                    strategy=s.strategy, offload=s.offload, amp=amp,
                                    loss_fn=loss_fn)
            except BudgetError as exc:
                raise BudgetError(
                    f"memory_budget {s.memory_budget!r} = {format_bytes(budget)} for the "
                    f"whole step, of which {format_bytes(extra)} is optimizer state; "
                    f"for the rest: {exc}"
                ) from None
            self.plans[shape] = plan
            self.say(f"plan for {format_shape(shape)} ({s.strategy}): budget "
                     f"{format_bytes(budget)} = {format_bytes(extra)} optimizer state"
                     f" + {format_bytes(budget - extra)} for the step; {len(plan.regions)} "
                     f"regions; verified peak {format_bytes((plan.verified_peak_bytes or 0) + extra)}"
                     f" (unplanned {format_bytes(unplanned + extra)}); recompute "
                     f"{(plan.recompute_flops or 0) / 1e9:.2f} GFLOP; planned in "
                     f"{time.perf_counter() - started:.1f} s")
        return self.plans

    def use_plan(self, shape: Shape | None) -> None:
        """Install the plan for ``shape`` (``None``: no plan) if another one is in place."""
        import remat3d
        from remat3d.runtime.apply import applied_state

        plan = self.plans.get(shape) if shape is not None else None
        if self._applied == shape and (plan is None) == (applied_state(self.model) is None):
            return
        if applied_state(self.model) is not None:
            remat3d.remove(self.model)
        if plan is not None:
            remat3d.apply(self.model, plan)
        self._applied = shape

    # ------------------------------------------------------------------ steps

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp)

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of the epoch. The order is a function of (seed, epoch) only;
        each global batch holds ``world_size × batch_size`` volumes, rank r takes the r-th
        slice (NOTE [ Distributed training ] in distributed.py); the last global batch is
        filled up from the start of the order, as DistributedSampler does."""
        generator = torch.Generator().manual_seed(self.settings.seed * 7919 + epoch)
        order = torch.randperm(len(self.train_set), generator=generator).tolist()
        size, world = self.settings.batch_size, self.world.size
        step = size * world
        if len(order) % step:
            order += (order * step)[: step - len(order) % step]
        rank = self.world.rank
        return [order[i + rank * size:i + (rank + 1) * size] for i in range(0, len(order), step)]

    def load_batch(self, indices: list[int], epoch: int) -> Sample:
        samples = [self.train_set.sample(i, epoch) for i in indices]
        image = torch.cat([s.image for s in samples]).to(self.device)
        label = torch.cat([s.label for s in samples]).to(self.device)
        return Sample(",".join(s.name for s in samples), image, label, samples[0].shape)

    def forward_backward(self, sample: Sample, scale: float = 1.0, sync: bool = True) -> float:
        """One micro-batch: forward (autocast), Dice+CE in fp32, backward. Returns the loss.

        The first step of each input shape runs under the memory tracker (on CUDA: the
        allocator's peak every step) so the log shows the measured peak.
        """
        shape = tuple(sample.image.shape)
        state = [t for st in self.optimizer.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor)]
        # measured once per shape, on a step where the optimizer state already exists
        track = self.device.type != "cuda" and (shape not in self.peaks
                                                or shape not in self._peak_final)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        tracker = None
        if track:
            from remat3d.instrument.tracker import MemoryTracker

            tracker = MemoryTracker(self.device)
            tracker.register_model(self.model)
            tracker.register([sample.image, sample.label], "input")
            tracker.register(state, "optimizer")
        with tracker if tracker is not None else contextlib.nullcontext():
            # DDP all-reduces gradients in backward; between accumulated micro-batches it must
            # not (no_sync), only at the last one
            no_sync = getattr(self.engine, "no_sync", None)
            with no_sync() if (no_sync is not None and not sync) else contextlib.nullcontext():
                loss, scaled = self._loss(sample, scale)
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
                del scaled
        if tracker is not None:
            self.peaks[shape] = tracker.peak_bytes
            if state:
                self._peak_final.add(shape)
            tracker.close()
        elif self.device.type == "cuda":
            self.peaks[shape] = torch.cuda.max_memory_allocated(self.device)
        return float(loss.detach())

    def _loss(self, sample: Sample, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        # The output is not held past the loss, as in the step the plan was verified on:
        # a live reference would keep it through backward, beyond the budget.
        with self.autocast():
            output = self.engine(sample.image)
        loss = self.loss_fn(output.float(), sample.label)
        return loss.detach(), loss * scale

    def optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def predict(self, sample: Sample) -> torch.Tensor:
        """Class index per voxel ``(D, H, W)`` of the unpadded volume."""
        self.use_plan(None)  # no graph is kept under no_grad: a plan has nothing to save
        was_training = self.model.training
        self.model.eval()
        try:
            with self.autocast():
                output = self.model(sample.image.to(self.device))
        finally:
            self.model.train(was_training)
        return crop_back(output.float().argmax(1)[0], sample.shape).cpu()

    def sync_buffers(self) -> None:
        """DDP: every rank takes rank 0's buffers (BatchNorm running statistics), as DDP
        does before each forward, so validation and saved state agree across ranks."""
        if self.world.mode != "ddp":
            return
        import torch.distributed as dist

        for buffer in self.model.buffers():
            dist.broadcast(buffer, src=0)

    def validate(self) -> dict[str, Any]:
        """Mean foreground Dice over the validation volumes (and per class)."""
        self.sync_buffers()
        from monai.metrics import compute_dice
        from monai.networks.utils import one_hot

        if self.val_set is None:
            return {}
        classes = self.geometry.out_channels
        scores = []
        for i in range(len(self.val_set)):
            sample = self.val_set.sample(i)
            prediction = self.predict(sample)
            truth = crop_back(sample.label[0, 0], sample.shape)
            scores.append(compute_dice(
                one_hot(prediction[None, None], classes), one_hot(truth[None, None], classes),
                include_background=False, ignore_empty=True)[0])
        per_class = torch.nanmean(torch.stack(scores), dim=0)
        return {"dice": float(torch.nanmean(per_class)),
                "dice_per_class": [float(v) for v in per_class]}

    # ------------------------------------------------------------------ the run

    def _world_mean(self, value: float) -> float:
        if not self.world.enabled:
            return value
        import torch.distributed as dist

        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total) / self.world.size

    def _states(self, optimizer: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Full (unsharded) model and optimizer state dicts; under FSDP2 a collective that
        every rank must enter (rank 0 receives the full tensors, on the CPU)."""
        if self.world.mode != "fsdp":
            return (self.model.state_dict(),
                    self.optimizer.state_dict() if optimizer else None)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.model, options=options)
        optimizer_state = (get_optimizer_state_dict(self.model, self.optimizer, options=options)
                           if optimizer else None)
        return model_state, optimizer_state

    def _load_states(self, state: dict[str, Any]) -> None:
        # a state saved under FSDP2 names optimizer entries by parameter (strings), a plain
        # one by position: each is loaded by the API that wrote it
        by_name = any(isinstance(k, str) for k in state["optimizer"].get("state", {}))
        if self.world.mode == "fsdp" or by_name:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, state["model"], options=options)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                     options=options)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def fit(self, *, resume: bool = False, interrupt_after: int | None = None) -> TrainResult:
        s = self.settings
        self.model.train()
        log = _Log(self.output_dir / "log.jsonl", writes=self.world.main)
        epoch, position, step = 0, 0, 0
        per_step = s.batch_size * self.world.size  # volumes per global batch
        self.make_plans()  # before anything is written: an infeasible budget leaves no files
        if resume:
            state = load_state(self.output_dir)
            check_resumable(state["settings"], s.to_dict())
            self._load_states(state)
            set_rng_state(state["rng"])
            epoch, step = state["epoch"], state["step"]
            # volumes consumed in the epoch: a resume may use another world size
            position = state.get("volumes", state["position"]) // per_step
            log.truncate(state["log_lines"])
            self.say(f"resuming {self.output_dir} at epoch {epoch + 1}, step {step}")
        else:
            if self.world.main:
                self.output_dir.mkdir(parents=True, exist_ok=True)
                import yaml

                atomic_write_text(self.output_dir / "settings.yaml",
                                  yaml.safe_dump(s.to_dict(), sort_keys=False))
            log.truncate(0)
        result = TrainResult(self.output_dir, epoch, step,
                             plans={k: v for k, v in self.plans.items() if v is not None})
        for record in log.records():  # a resumed run reports the validations it kept
            if record.get("event") == "validation":
                result.validation.append({k: v for k, v in record.items()
                                          if k not in ("event", "step")})

        def save(epoch_: int, position_: int) -> None:
            self.sync_buffers()
            model_state, optimizer_state = self._states()  # collective under FSDP
            if self.world.main:
                save_state(self.output_dir, {
                    "settings": s.to_dict(), "epoch": epoch_, "position": position_,
                    "volumes": position_ * per_step, "world_size": self.world.size,
                    "step": step, "model": model_state, "optimizer": optimizer_state,
                    "scaler": self.scaler.state_dict() if self.scaler else None,
                    "rng": rng_state(), "log_lines": log.lines,
                })
            barrier(self.world)

        while epoch < s.epochs:
            batches = self.batches(epoch)
            bar = _progress(len(batches), f"epoch {epoch + 1}/{s.epochs}",
                            s.progress and self.world.main, initial=position)
            pending = 0  # micro-batches accumulated since the last optimizer step
            for index in range(position, len(batches)):
                sample = self.load_batch(batches[index], epoch)
                shape = tuple(sample.image.shape)
                self.use_plan(shape)
                started = time.perf_counter()
                last = index == len(batches) - 1
                loss = self.forward_backward(sample, scale=1.0 / s.accumulate,
                                             sync=pending + 1 == s.accumulate or last)
                loss = self._world_mean(loss)  # what the step averaged over
                pending += 1
                result.losses.append(loss)
                if pending == s.accumulate or last:
                    self.optimizer_step()
                    pending = 0
                    step += 1
                log.write({"event": "step", "epoch": epoch + 1, "batch": index + 1,
                           "step": step, "loss": loss, "volume": sample.name,
                           "shape": list(shape), "peak_bytes": self.peaks.get(shape),
                           "seconds": round(time.perf_counter() - started, 4)})
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}",
                                peak=format_bytes(self.peaks[shape]) if shape in self.peaks
                                else "?")
                if pending == 0 and not last and step % s.save_every == 0:
                    save(epoch, index + 1)
                if pending == 0 and interrupt_after is not None and step >= interrupt_after:
                    bar.close()
                    raise Interrupted(f"interrupted after optimizer step {step}")
            bar.close()
            epoch, position = epoch + 1, 0
            if self.val_set is not None and (epoch % s.val_every == 0 or epoch == s.epochs):
                metrics = self.validate()
                log.write({"event": "validation", "epoch": epoch, "step": step, **metrics})
                result.validation.append({"epoch": epoch, **metrics})
                self.say(f"epoch {epoch}: validation Dice {metrics['dice']:.4f}")
            save(epoch, 0)
        self.use_plan(None)
        self.sync_buffers()
        model_state, _ = self._states(optimizer=False)
        if self.world.main:
            _save_weights(self.output_dir / "model.pt", model_state)
        barrier(self.world)
        result.epochs, result.steps = epoch, step
        result.peaks = dict(self.peaks)
        return result


# --------------------------------------------------------------------------- helpers


class _Log:
    """The JSON-lines log; on resume it is cut back to the lines the state file knew.
    Only rank 0 writes (``writes=False`` elsewhere), every rank counts lines."""

    def __init__(self, path: Path, writes: bool = True) -> None:
        self.path = path
        self.lines = 0
        self.writes = writes

    def truncate(self, lines: int) -> None:
        kept = self.path.read_text().splitlines()[:lines] if self.path.exists() else []
        if self.writes:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        self.lines = len(kept)

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines()]

    def write(self, record: dict[str, Any]) -> None:
        if self.writes:
            with self.path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
        self.lines += 1


def _progress(total: int, desc: str, enabled: bool, initial: int = 0) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, initial=initial, leave=False,
                dynamic_ncols=True)


def _save_weights(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)

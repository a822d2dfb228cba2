"""Validation: whole-volume prediction and Dice over the foreground classes."""

from __future__ import annotations

import logging
from typing import Any

import torch

from remat3d.data.dataset import Sample
from remat3d.data.padding import crop_back

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]

__all__ = ["Validation"]


class Validation:
    """Trainer mixin: prediction without a plan, Dice, DDP buffer sync."""

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

"""One training step: batches, forward and backward under autocast, the optimizer step."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from remat3d.data.dataset import Sample

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]

__all__ = ["Steps"]


class Steps:
    """Trainer mixin: the batches of an epoch and one (micro-)step."""

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
        # measured per shape until a step that holds all a step can hold has been: the
        # optimizer state exists, and (accumulating) the gradients summed so far; the
        # largest measured peak is reported
        track = self.device.type != "cuda" and shape not in self._peak_final
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        tracker, summed = None, False
        if track:
            from remat3d.instrument.tracker import MemoryTracker

            summed = any(p.grad is not None for p in self.model.parameters())
            tracker = MemoryTracker(self.device)
            tracker.register_model(self.model)
            tracker.register([sample.image, sample.label], "input")
            tracker.register(state, "optimizer")  # (and register_model: gradients so far)
        with tracker if tracker is not None else contextlib.nullcontext():
            # DDP all-reduces gradients in backward; between accumulated micro-batches it must
            # not (no_sync), only at the last one
            no_sync = getattr(self.engine, "no_sync", None)
            with no_sync() if (no_sync is not None and not sync) else contextlib.nullcontext():
                output, loss, scaled = self._loss(sample, scale)
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
                del output, scaled
        if tracker is not None:
            self.peaks[shape] = max(self.peaks.get(shape, 0), tracker.peak_bytes)
            if state and (summed or self.settings.accumulate == 1):
                self._peak_final.add(shape)
            tracker.close()
        elif self.device.type == "cuda":
            self.peaks[shape] = max(self.peaks.get(shape, 0),
                                    torch.cuda.max_memory_allocated(self.device))
        return float(loss.detach())

    def _loss(self, sample: Sample, scale: float) -> tuple[Any, torch.Tensor, torch.Tensor]:
        # The output is held through backward, as in the step the plan was verified on
        # (instrument/step.py, NOTE [ What a step holds ]): the step that runs is that one.
        with self.autocast():
            output = self.engine(sample.image)
        loss = self.loss_fn(output.float(), sample.label)
        return output, loss.detach(), loss * scale

    def optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

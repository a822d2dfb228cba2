"""Training on several processes with torch.distributed (launched by ``torchrun``).

NOTE [ Distributed training ]
  1. ``torchrun`` sets ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``; with ``WORLD_SIZE > 1`` the
     trainer joins the process group (``nccl`` on CUDA, ``gloo`` on CPU). Nothing of our own
     replaces torch.distributed: DDP and FSDP2 (``fully_shard``) do the communication.
  2. The plan is made once, on rank 0, and broadcast as plain data; every rank applies the
     same plan to its own model before wrapping it.
  3. Each optimizer step consumes ``world_size × batch_size × accumulate`` volumes: rank r
     takes every world-size-th volume of the epoch's order (a function of (seed, epoch)).
     With DDP's gradient averaging, a step equals one process accumulating the same volumes
     (exactly, on CPU, for a world size that is a power of two: halving is exact).
  4. Only rank 0 writes the log and state files; the state stores how many volumes of the
     epoch were consumed, so a resume may use another world size.
  5. DDP broadcasts buffers from rank 0 each forward: BatchNorm running statistics are rank
     0's, as in any DDP run. Use SyncBatchNorm or InstanceNorm for rank-independent ones.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remat3d.errors import SettingsError

__all__ = ["World", "broadcast_object", "join", "wrap_model"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    """Where this process stands: ``size == 1`` is an ordinary single-process run."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    mode: str = "none"   # none | ddp | fsdp

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.size > 1


def join(mode: str, device_type: str) -> World:
    """Join the process group torchrun describes in the environment (if any)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if mode not in ("ddp", "fsdp"):
        raise SettingsError(f"Launched with WORLD_SIZE={size} but distributed={mode!r}; use "
                            "ddp or fsdp.")
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return World(rank, size, local, mode)


def broadcast_object(value: Any, world: World) -> Any:
    """Rank 0's ``value`` on every rank (plain data: pickled by torch.distributed)."""
    if not world.enabled:
        return value
    box = [value if world.main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def wrap_model(model: nn.Module, world: World, device: torch.device) -> nn.Module:
    """The module the training step calls: the model itself, DDP around it, or the model
    sharded in place by FSDP2 (each top-level child that holds parameters is a unit)."""
    if not world.enabled:
        return model
    if world.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # gradient_as_bucket_view: gradients live in DDP's buckets, not in a second copy,
        # so the step's memory is what the plan measured
        return DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True)
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child)
    fully_shard(model)
    return model


def barrier(world: World) -> None:
    if world.enabled:
        dist.barrier()

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
  6. A run leaves the group with ``leave()``: every rank is past its last collective (a
     finished fit() ends with a barrier), the model is released, and the group is destroyed
     so that its threads end there, not during interpreter shutdown. A run that fails
     (its set-up included: data, settings, weights, an infeasible budget) leaves it too,
     so no process group outlives ``train()``. FSDP2's DTensors leave
     their device mesh, and with it the group, in DTensor's process-wide caches (sharding
     propagation, redistribute planners, mesh topologies). Measured, torch 2.13: after
     ``destroy_process_group()`` and ``gc.collect()`` gloo's threads (``gloo_tcp_loop``,
     two ``pt_gloo_runloop``) ran on until exit, and a rank once died at exit with
     "terminate called without an active exception" (SIGABRT) after a finished run.
     Emptying those caches first lets the group, and its threads, go. MONAI is imported
     before the group is made: where pytorch-ignite is installed MONAI imports it, and
     ignite imported while a group exists keeps a handle on that group (its threads then
     outlive ``destroy_process_group()``), found by the same thread test.
"""

from __future__ import annotations

import datetime
import gc
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
        import monai  # noqa: F401  - before the group exists (NOTE rule 6)

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


def leave(world: World) -> None:
    """Destroy the process group (NOTE rule 6); the caller has dropped its model first."""
    if not world.enabled or not dist.is_initialized():
        return
    if world.mode == "fsdp":
        _forget_dtensor_caches()
    gc.collect()  # the model's reference cycles, so the group's last owner goes now
    dist.destroy_process_group()


def _forget_dtensor_caches() -> None:
    """Empty DTensor's process-wide caches, which hold FSDP2's device mesh and with it the
    process group: sharding propagation (Python and C++), redistribute planners and their
    transform plans, mesh topologies. All are private to torch and rebuilt on demand; one a
    torch lacks is skipped (tests/train's thread test names any that still holds a group)."""
    try:
        from torch.distributed.tensor import _collective_utils, _redistribute
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # a torch without them: the group's threads end at exit
        logger.debug("DTensor's caches not found; the process group ends at exit")
        return
    _clear_sharding_prop_cache()
    topology = getattr(_collective_utils, "MeshTopoInfo", None)
    for clear in (getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(getattr(_redistribute, "_gen_transform_infos", None),
                          "cache_clear", None),
                  getattr(getattr(topology, "build_from_mesh", None), "cache_clear", None)):
        if clear is not None:
            clear()


def barrier(world: World) -> None:
    if world.enabled:
        dist.barrier()

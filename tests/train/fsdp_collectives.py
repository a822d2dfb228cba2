"""Run under torchrun: count FSDP2's all-gathers in one training step without and with a
recompute plan (the plan must not add any). Prints one JSON line on rank 0."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from remat3d.train import load_settings
from remat3d.train.distributed import World, leave
from remat3d.train.trainer import Trainer, deterministic


class CountCollectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.all_gathers = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_gather" in func.__name__ or "allgather" in func.__name__:
            self.all_gathers += 1
        return func(*args, **(kwargs or {}))


def count(config: str, budget: str) -> tuple[int, int, World]:
    settings = load_settings(config, [f"--memory_budget={budget}", "--distributed=fsdp",
                                      "--output_dir=/tmp/unused"])
    with deterministic(settings):
        trainer = Trainer(settings)
        sample = trainer.load_batch(trainer.batches(0)[0], 0)
        shape = tuple(sample.image.shape)
        trainer.use_plan(shape)
        regions = len(trainer.plans[shape].regions) if trainer.plans.get(shape) else 0
        with CountCollectives() as counter:
            trainer.forward_backward(sample)
        return counter.all_gathers, regions, trainer.world


if __name__ == "__main__":
    plain, _, _ = count(sys.argv[1], "none")
    planned, regions, world = count(sys.argv[1], "0.8x")
    if dist.get_rank() == 0:
        print(json.dumps({"plain": plain, "planned": planned, "regions": regions}))
    # every rank done with every collective before the group goes, then the group goes
    # as train() leaves it (NOTE [ Distributed training ] rule 6): with DTensor's caches
    # still holding FSDP2's mesh, gloo's threads ran on to the interpreter's exit, and a
    # rank sometimes aborted there ("terminate called without an active exception")
    dist.barrier()
    leave(world)

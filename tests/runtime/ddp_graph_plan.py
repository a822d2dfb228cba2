"""Run under torchrun: a graph plan made for compilation (its graphs compiled by inductor),
the model then compiled and wrapped in DDP as nnU-Net v2's trainer does it, one step on
each rank's volume; with one process, no DDP, both volumes accumulated. Rank 0 saves the
gradients and the plan's choices to ``argv[1]``."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import remat3d
from tests.runtime.test_inductor import X, _net


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    plan = remat3d.plan(_net(), X, budget="0.7x", compiled=True)
    model = torch.compile(remat3d.apply(_net(), plan))  # nnU-Net compiles, then wraps
    torch.manual_seed(1)
    volumes = torch.randn(2, *X)
    if world == 1:
        for x in volumes:
            model(x).float().square().mean().backward()
        grads = {n: p.grad / 2 for n, p in model.named_parameters()}
    else:
        ddp = DistributedDataParallel(model)
        ddp(volumes[rank]).float().square().mean().backward()  # DDP averages the two
        grads = {n: p.grad for n, p in model.named_parameters()}
    choices = [None] * world
    dist.all_gather_object(choices, (plan.graph_backend, plan.graph_recompute))
    if rank == 0:
        torch.save({"grads": grads, "choices": choices}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

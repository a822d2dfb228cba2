"""Run under torchrun: a tiled graph plan (runtime/tiled_graph.py) wrapped in DDP, one step
on each rank's volume; with one process, no DDP, both volumes accumulated. Rank 0 saves
the gradients to ``argv[1]``."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from remat3d.capture.joint import capture
from remat3d.planner.liveness import closed_recompute
from remat3d.planspec import GraphTiling
from remat3d.runtime.graph_run import apply_graph_plan
from tests.runtime.test_tiled_graph import _nnunetv2

SHAPE = (1, 1, 32, 32, 32)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = _nnunetv2()
    graph = capture(model, SHAPE).graph
    recompute = closed_recompute(graph, [n.name for n in graph.forward])
    apply_graph_plan(model, recompute, tiling=GraphTiling((16, 16, 16), 2, "sums", True))
    torch.manual_seed(1)
    volumes = torch.randn(2, *SHAPE)
    if world == 1:
        for x in volumes:
            model(x).float().square().mean().backward()
        grads = {n: p.grad / 2 for n, p in model.named_parameters() if p.grad is not None}
    else:
        # nnU-Net v2's deep-supervision heads are unused without deep supervision
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        ddp(volumes[rank]).float().square().mean().backward()  # DDP averages the two
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if rank == 0:
        torch.save({"grads": grads}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

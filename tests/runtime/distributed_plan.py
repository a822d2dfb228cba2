"""Run under torchrun with 2 processes: one training step of a planned model, each rank on
its own volume, wrapped in DDP or FSDP2 (``argv[2]``); rank 0 also takes the step of one
process, unwrapped, accumulating both volumes. The plan (``argv[3]``: ``tiled`` or
``recompute``) is made by every rank alike with a fixed budget, so both steps apply the
same plan. Rank 0 saves both steps' full gradients to ``argv[1]``."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import remat3d

SHAPE = (1, 1, 32, 32, 32)


def network() -> nn.Module:
    from monai.networks.nets import BasicUNet

    torch.manual_seed(0)
    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2,
                     features=(4, 4, 8, 16, 32, 4))


def make_plan(kind: str) -> remat3d.Plan:
    """A module plan: ``tiled`` tiles the full-resolution stages, their saved inputs
    rebuilt from cheap ops that read the normalisations' parameters (NOTE [ Rebuilt saved
    tensors ] rule 6); ``recompute`` checkpoints every block."""
    model = network()
    if kind == "recompute":
        return remat3d.plan(model, SHAPE, budget="1.0x", strategy="blocks")
    plan = remat3d.plan(model, SHAPE, budget="0.4x", graph=False)
    assert plan.tiled and plan.rebuild_saved, plan.summary()
    return plan


def main(out: str, mode: str, kind: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.use_deterministic_algorithms(True)
    plan = make_plan(kind)
    torch.manual_seed(1)
    volumes = torch.randn(2, *SHAPE)
    single = remat3d.apply(network(), plan)
    if rank == 0:  # one process accumulating both volumes
        for x in volumes:
            single(x).square().mean().backward()
    model = remat3d.apply(network(), plan)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for child in model.children():
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child)
        fully_shard(model)
        wrapped = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model)
    wrapped(volumes[rank]).square().mean().backward()  # both average the two
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"single": {n: p.grad / 2 for n, p in single.named_parameters()},
                    "wrapped": grads}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])

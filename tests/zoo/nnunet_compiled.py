"""Run in a subprocess by test_nnunet.py: ``nnUNetTrainerRemat3d`` where nnU-Net compiles.

nnU-Net compiles its network on CUDA by default and never on CPU; here its
``_do_i_compile`` answers as on CUDA, so the trainer's own ``initialize`` compiles the
network and remat3d plans for that (``train/nnunet.py`` rule 3). Then one training step of
the network as the trainer holds it (compiled where it stayed compiled) is compared with
the unplanned eager network of the same weights.

    python -m tests.zoo.nnunet_compiled ROOT BUDGET [BACKEND]

ROOT as ``tests/zoo/nnunet_dataset.py`` makes it; BACKEND ``aot_eager`` (default: dynamo
and AOTAutograd's partitioned graphs, run unfused) or ``inductor``. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(root: Path, budget: str, backend: str) -> dict:
    for name in ("nnUNet_raw", "nnUNet_preprocessed", "nnUNet_results"):
        os.environ[name] = str(root / name)
    os.environ["nnUNet_n_proc_DA"] = "0"
    import torch

    compile_ = torch.compile
    torch.compile = lambda model, **kw: compile_(model, backend=backend, **kw)  # type: ignore

    from batchgenerators.utilities.file_and_folder_operations import load_json
    from torch._dynamo import OptimizedModule

    from remat3d.train import nnunet as trainers

    trainers.nnUNetTrainerRemat3d._do_i_compile = lambda self: True  # as nnU-Net on CUDA
    trainers.nnUNetTrainerRemat3d.remat3d_run = trainers.NnUNetRun(budget=budget)
    folder = root / "nnUNet_preprocessed" / "Dataset001_Tiny"
    plans = {**load_json(str(folder / "nnUNetPlans.json")), "continue_training": False}
    trainer = trainers.nnUNetTrainerRemat3d(plans, "3d_fullres", "all",
                                            load_json(str(folder / "dataset.json")),
                                            device=torch.device("cpu"))
    trainer.initialize()
    compiled = isinstance(trainer.network, OptimizedModule)
    planned = trainer.network._orig_mod if compiled else trainer.network
    manager = trainer.configuration_manager
    reference = trainer.build_network_architecture(
        trainer.plans_manager, manager, trainer.num_input_channels,
        trainer.label_manager.num_segmentation_heads, trainer.enable_deep_supervision)
    reference.load_state_dict(planned.state_dict())

    torch.manual_seed(0)
    x = torch.randn(1, trainer.num_input_channels, *manager.patch_size)
    grads = []
    for net in (trainer.network, reference):
        net.zero_grad(set_to_none=True)
        outputs = net(x)
        sum(o.float().mean() for o in outputs).backward()
        grads.append([p.grad for p in (planned if net is trainer.network else net).parameters()])
    # norm-wise over all gradients: a convolution's bias before a normalisation has a
    # gradient of zero in exact arithmetic, rounding noise in floating point
    planned_grads, reference_grads = (torch.cat([g.flatten() for g in gs]) for gs in grads)
    difference = ((planned_grads - reference_grads).norm() / reference_grads.norm()).item()
    return {"compiled": compiled, "regions": len(trainer.remat3d_plan.regions),
            "graph_backend": (trainer.remat3d_plan.graph_backend
                              if trainer.remat3d_plan.graph_recompute is not None else None),
            "strategy": trainer.remat3d_plan.strategy,
            "tiled": any(r.decision == "tile" for r in trainer.remat3d_plan.regions),
            "gradient_difference": difference}


if __name__ == "__main__":
    root_, budget_ = Path(sys.argv[1]), sys.argv[2]
    print(json.dumps(main(root_, budget_, sys.argv[3] if len(sys.argv) > 3 else "aot_eager")))

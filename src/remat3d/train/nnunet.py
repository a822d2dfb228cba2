"""nnU-Net v2's own trainer on whole volumes: ``remat3d nnunet train DATASET CONFIGURATION
FOLD --budget 24GiB``.

``nnUNetTrainerRemat3d`` is nnU-Net's ``nnUNetTrainer`` with three changes; everything else
(preprocessing, augmentation, the Dice + cross-entropy loss with deep supervision, SGD and
its schedule, ``torch.compile`` where nnU-Net compiles, logging, checkpoints, validation)
is nnU-Net's:

1. The patch is the whole volume: the largest preprocessed training case, padded to the
   network's divisor (the product of its strides per axis), batch 1. nnU-Net's loader pads
   smaller cases; its sliding-window validation then runs one window per case.
2. After nnU-Net builds the network, remat3d plans that step under the budget
   (``remat3d.plan``; the SGD momentum buffers, one per parameter, are taken off the budget
   first) and applies the plan; the plan is written to nnU-Net's training log.
3. ``torch.compile`` is nnU-Net's choice, as with ``nnUNetv2_train`` (on by default on
   CUDA; ``nnUNet_compile=f`` turns it off; nnU-Net never compiles on CPU). Where nnU-Net
   compiles, the step is planned for compilation first (``remat3d.plan(...,
   compiled=True)``: a graph plan whose graphs remat3d compiles with inductor itself, the
   compiled network's dynamo leaving the planned step to it, or recompute regions, which
   inductor's partitioner recomputes inside its graphs); where no such plan fits the
   budget, the network runs eagerly with the plan that does (tiled, offloaded), and the
   log says why. A compiled step's peak is inductor's, not a verified one: on CUDA the
   first training step's allocator peak is logged beside the budget, compiled or not.

Its checkpoints name ``nnUNetTrainer`` as their trainer, whose network they hold (the
module tree and ``state_dict`` of a planned network are the unplanned one's), so nnU-Net's
own ``nnUNetv2_predict -tr nnUNetTrainerRemat3d`` finds and loads them. The budget covers
the network's training step as ``remat3d.plan`` measures it (weights, gradients,
activations, with a mean over the outputs as its loss); nnU-Net's loss adds its softmax
and one-hot targets on top.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer
from torch._dynamo import OptimizedModule  # what nnU-Net checks for compiled networks

from remat3d.units import format_bytes, format_shape

__all__ = ["NnUNetRun", "nnUNetTrainerRemat3d", "train_nnunet"]


@dataclass
class NnUNetRun:
    """What ``remat3d nnunet train`` asks of the trainer besides nnU-Net's arguments."""

    budget: str | int = "auto"
    offload: bool = False
    epochs: int | None = None                # None: nnU-Net's (1000)
    iterations_per_epoch: int | None = None  # None: nnU-Net's (250)


class nnUNetTrainerRemat3d(nnUNetTrainer):  # nnU-Net's naming: its lookups match it
    """See the module docstring."""

    remat3d_run = NnUNetRun()

    def __init__(self, plans: dict, configuration: str, fold: int, dataset_json: dict,
                 device: torch.device | None = None) -> None:
        super().__init__(plans, configuration, fold, dataset_json,
                         torch.device("cuda") if device is None else device)
        run = type(self).remat3d_run
        if run.epochs is not None:
            self.num_epochs = run.epochs
        if run.iterations_per_epoch is not None:
            self.num_iterations_per_epoch = run.iterations_per_epoch
            self.num_val_iterations_per_epoch = max(1, run.iterations_per_epoch // 5)
        self.remat3d_plan: Any = None
        self.remat3d_budget = 0
        self.remat3d_peak_logged = False

    def initialize(self) -> None:
        if self.was_initialized:
            return
        self._whole_volume_patch()  # before nnU-Net sizes its batches and loaders
        super().initialize()  # nnU-Net compiles the network here where it compiles
        self._plan_step()

    def _whole_volume_patch(self) -> None:
        from nnunetv2.training.dataloading.nnunet_dataset import infer_dataset_class

        keys = self.do_split()[0]
        dataset = infer_dataset_class(self.preprocessed_dataset_folder)(
            self.preprocessed_dataset_folder, keys,
            folder_with_segs_from_previous_stage=self.folder_with_segs_from_previous_stage)
        largest = [0, 0, 0]
        for key in keys:
            shape = dataset.load_case(key)[0].shape[1:]
            largest = [max(a, int(b)) for a, b in zip(largest, shape)]
        strides = self.configuration_manager.network_arch_init_kwargs.get("strides") or \
            self.configuration_manager.pool_op_kernel_sizes
        divisor = [math.prod(int(s[axis]) for s in strides) for axis in range(len(largest))]
        patch = [math.ceil(n / d) * d for n, d in zip(largest, divisor)]
        config = self.configuration_manager.configuration
        config["patch_size"], config["batch_size"] = patch, 1
        self.print_to_log_file(f"remat3d: whole volumes: patch {format_shape(patch)} (the "
                               f"largest training case {format_shape(largest)}, padded to "
                               f"multiples of {format_shape(divisor)}), batch 1",
                               also_print_to_console=True)

    def _plan_step(self) -> None:
        import remat3d
        from remat3d.errors import InfeasibleBudgetError
        from remat3d.planning import resolve_budget

        run = type(self).remat3d_run
        compiled = isinstance(self.network, OptimizedModule)  # nnU-Net compiled it
        network = self.network._orig_mod if compiled else self.network
        patch = self.configuration_manager.patch_size
        shape = (1, self.num_input_channels, *patch)
        amp = "fp16" if self.device.type == "cuda" else None  # nnU-Net's autocast
        momentum = sum(p.numel() * p.element_size() for p in network.parameters())
        unplanned = remat3d.profile(network, shape, device="meta", amp=amp).peak_bytes
        if run.budget == "auto" and self.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.device)[0]
        elif run.budget == "auto":
            total = unplanned + momentum  # no device to fit: the unplanned step
        else:
            total = resolve_budget(run.budget, unplanned)
        self.remat3d_budget = total
        step = total - momentum
        self._log(f"budget {format_bytes(total)} = {format_bytes(momentum)} SGD momentum + "
                  f"{format_bytes(step)} for the step (unplanned {format_bytes(unplanned)})")
        plan = None
        if compiled:  # rule 3: a plan for compiled steps, where one fits
            try:
                plan = remat3d.plan(network, shape, budget=step, amp=amp, compiled=True)
            except InfeasibleBudgetError as exc:
                self.network = network
                self._log(f"torch.compile off: no plan for a compiled step fits "
                          f"{format_bytes(step)} (recompute alone reaches "
                          f"{format_bytes(exc.smallest_feasible_bytes)}); the network "
                          "runs eagerly with a plan that fits (tiling, offload)")
            else:
                self._log("torch.compile on (nnU-Net's choice), planned for compiled "
                          "steps: the compiled step's peak is inductor's")
        if plan is None:
            plan = remat3d.plan(network, shape, budget=step, amp=amp, offload=run.offload)
            if not compiled:
                self._log("torch.compile off (nnU-Net's choice on this device and "
                          f"nnUNet_compile={os.environ.get('nnUNet_compile', 'unset')}): "
                          "the plan runs eagerly, as verified")
        remat3d.apply(network, plan)
        self.remat3d_plan = plan
        self._log(plan.summary())

    def train_step(self, batch: dict) -> dict:
        """nnU-Net's step; on CUDA the first one's allocator peak is logged (rule 3)."""
        if self.device.type != "cuda" or self.remat3d_peak_logged:
            return super().train_step(batch)
        torch.cuda.reset_peak_memory_stats(self.device)
        result = super().train_step(batch)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.remat3d_peak_logged = True
        self._log(f"first training step: allocator peak {format_bytes(peak)}, budget "
                  f"{format_bytes(self.remat3d_budget)}"
                  + ("" if peak <= self.remat3d_budget else " (exceeded: plan with a "
                     "smaller --budget, or set nnUNet_compile=f)"))
        return result

    def _log(self, message: str) -> None:
        self.print_to_log_file("remat3d: " + message, also_print_to_console=True)

    def save_checkpoint(self, filename: str) -> None:
        """nnU-Net's checkpoint, naming ``nnUNetTrainer`` as its trainer (module
        docstring), written through a temporary file."""
        super().save_checkpoint(filename)
        if not os.path.isfile(filename):
            return  # checkpointing disabled, or not rank 0
        content = torch.load(filename, map_location="cpu", weights_only=False)
        content["trainer_name"] = "nnUNetTrainer"
        temporary = f"{filename}.tmp"
        torch.save(content, temporary)
        os.replace(temporary, filename)


def train_nnunet(dataset: str, configuration: str, fold: str, run: NnUNetRun, *,
                 plans_identifier: str = "nnUNetPlans", device: str = "auto",
                 continue_training: bool = False, pretrained: str | None = None,
                 validation_probabilities: bool = False) -> Path:
    """What ``nnUNetv2_train`` does in one process, with :class:`nnUNetTrainerRemat3d`;
    returns the fold's output folder."""
    from batchgenerators.utilities.file_and_folder_operations import join, load_json
    from nnunetv2.paths import nnUNet_preprocessed
    from nnunetv2.run.run_training import maybe_load_checkpoint
    from nnunetv2.utilities.dataset_name_id_conversion import maybe_convert_to_dataset_name

    if nnUNet_preprocessed is None:
        from remat3d.errors import Remat3dError

        raise Remat3dError("nnU-Net's folders are not set: export nnUNet_raw, "
                           "nnUNet_preprocessed and nnUNet_results as for nnUNetv2_train.")
    name = dataset if dataset.startswith("Dataset") else maybe_convert_to_dataset_name(
        int(dataset))
    folder = join(nnUNet_preprocessed, name)
    plans = load_json(join(folder, plans_identifier + ".json"))
    plans["continue_training"] = continue_training
    dataset_json = load_json(join(folder, "dataset.json"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    nnUNetTrainerRemat3d.remat3d_run = run
    trainer = nnUNetTrainerRemat3d(plans=plans, configuration=configuration,
                                   fold=fold if fold == "all" else int(fold),
                                   dataset_json=dataset_json, device=torch.device(device))
    maybe_load_checkpoint(trainer, continue_training, False, pretrained)
    trainer.run_training()
    trainer.perform_actual_validation(validation_probabilities)
    return Path(trainer.output_folder)

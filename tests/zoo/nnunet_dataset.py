"""Run in a subprocess by test_nnunet.py (nnU-Net reads its folders from environment
variables when first imported): make a tiny nnU-Net v2 raw dataset, plan and preprocess it
with nnU-Net's own code, build the network nnU-Net's trainer builds, and save a checkpoint
the way its trainer does.

    python -m tests.zoo.nnunet_dataset ROOT

writes ROOT/nnUNet_raw/Dataset001_Tiny (4 cases, 2 channels, labels 0-2, 32^3),
ROOT/nnUNet_preprocessed/Dataset001_Tiny/{nnUNetPlans.json,dataset.json,...}, and
ROOT/trainer.json (the trainer's network: class, state_dict keys and shapes) and
ROOT/checkpoint_final.pth (nnU-Net's trainer after one short epoch, 2 iterations, on CPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

DATASET_ID, DATASET = 1, "Dataset001_Tiny"
SIZE, CASES, CHANNELS = 32, 4, 2


def make_raw(raw: Path) -> None:
    import nibabel as nib

    folder = raw / DATASET
    (folder / "imagesTr").mkdir(parents=True, exist_ok=True)
    (folder / "labelsTr").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    affine = np.eye(4)
    grid = np.stack(np.meshgrid(*[np.arange(SIZE)] * 3, indexing="ij"))
    for case in range(CASES):
        centre = rng.integers(10, 22, size=3)
        dist = np.sqrt(((grid - centre[:, None, None, None]) ** 2).sum(0))
        label = (dist < 6).astype(np.uint8) + (dist < 3).astype(np.uint8)
        for c in range(CHANNELS):
            image = label * (c + 1.0) + rng.normal(0, 0.3, label.shape)
            nib.save(nib.Nifti1Image(image.astype(np.float32), affine),
                     folder / "imagesTr" / f"case{case:03d}_{c:04d}.nii.gz")
        nib.save(nib.Nifti1Image(label, affine), folder / "labelsTr" / f"case{case:03d}.nii.gz")
    (folder / "dataset.json").write_text(json.dumps({
        "channel_names": {"0": "T1", "1": "T2"},
        "labels": {"background": 0, "outer": 1, "inner": 2},
        "numTraining": CASES, "file_ending": ".nii.gz"}))


def main(root: Path) -> None:
    for name in ("nnUNet_raw", "nnUNet_preprocessed", "nnUNet_results"):
        (root / name).mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(root / name)
    os.environ["nnUNet_compile"] = "f"
    make_raw(root / "nnUNet_raw")

    import torch
    from nnunetv2.experiment_planning.plan_and_preprocess_api import (
        extract_fingerprints,
        plan_experiments,
        preprocess,
    )
    from nnunetv2.run.run_training import get_trainer_from_args

    extract_fingerprints([DATASET_ID], num_processes=1, check_dataset_integrity=True)
    plan_experiments([DATASET_ID])
    preprocess([DATASET_ID], configurations=("3d_fullres",), num_processes=(1,))

    # the trainer as nnUNetv2_train makes it (fold "all": 4 cases are too few for 5 folds)
    trainer = get_trainer_from_args(str(DATASET_ID), "3d_fullres", "all", "nnUNetTrainer",
                                    "nnUNetPlans", device=torch.device("cpu"))
    trainer.initialize()
    net = trainer.network
    (root / "trainer.json").write_text(json.dumps({
        "class": f"{type(net).__module__}.{type(net).__qualname__}",
        "state_dict": {k: list(v.shape) for k, v in net.state_dict().items()}}))
    # one short epoch, as nnUNetv2_train runs it (then it saves checkpoint_final.pth with
    # its training log: numpy scalars among plain values)
    trainer.num_iterations_per_epoch, trainer.num_val_iterations_per_epoch = 2, 1
    trainer.num_epochs = 1
    os.environ["nnUNet_n_proc_DA"] = "0"  # augmentation in this process (after planning,
    trainer.run_training()                # which sets its thread count from it)
    fold = Path(trainer.output_folder)
    (root / "checkpoint_final.pth").write_bytes((fold / "checkpoint_final.pth").read_bytes())


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""Helpers that write tiny NIfTI datasets for the data and training tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_volume(path: Path, data: np.ndarray, affine: np.ndarray | None = None) -> Path:
    import nibabel as nib

    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, np.diag([2.0, 2.0, 2.0, 1.0]) if affine is None else affine),
             path)
    return path


def blob_case(shape: tuple[int, int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """An image with a bright ellipsoid (class 1) and a dim one (class 2), plus noise."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.linspace(-1, 1, s) for s in shape], indexing="ij"))
    label = np.zeros(shape, np.uint8)
    for cls, centre in ((1, rng.uniform(-0.3, 0.3, 3)), (2, rng.uniform(-0.3, 0.3, 3) + 0.3)):
        radius = rng.uniform(0.25, 0.4)
        label[(((grid - centre[:, None, None, None]) ** 2).sum(0)) < radius**2] = cls
    image = (label * 100.0 + rng.normal(0, 20, shape)).astype(np.float32)
    return image, label


def write_dataset(root: Path, cases: int = 3, shape: tuple[int, int, int] = (16, 18, 14),
                  validation: int = 1) -> Path:
    """``cases`` training and ``validation`` validation cases, MSD layout + dataset.json."""
    entries = []
    for i in range(cases + validation):
        image, label = blob_case(shape, i)
        write_volume(root / "imagesTr" / f"case{i}.nii.gz", image)
        write_volume(root / "labelsTr" / f"case{i}.nii.gz", label)
        entries.append({"image": f"./imagesTr/case{i}.nii.gz",
                        "label": f"./labelsTr/case{i}.nii.gz"})
    content = {"training": entries[:cases], "validation": entries[cases:],
               "labels": {"0": "background", "1": "bright", "2": "dim"}}
    (root / "dataset.json").write_text(json.dumps(content))
    return root / "dataset.json"

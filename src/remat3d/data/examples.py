"""Example datasets that need no download: synthetic CT phantoms and a real MRI volume.

Both are written to disk as NIfTI files with an MSD ``dataset.json``, so examples, tests and
the demo go through the same loading path as a user's data.

- :func:`write_phantom_dataset`: CT-like torso phantoms in Hounsfield units (air, fat,
  soft tissue, lungs, a spine, an organ with noise and a smooth bias), labels
  0 = background, 1 = organ. No real 3-D CT volume ships offline, so CT must be synthesised.
- :func:`write_mni_dataset`: the MNI ICBM152 2009a T1 template that nilearn ships
  (197×233×189 at 1 mm), labelled 0 = background/CSF, 1 = grey matter, 2 = white matter from
  the template's own tissue probability maps (the most probable class per voxel).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from remat3d.errors import DataError
from remat3d.graph import atomic_write_text

__all__ = ["mni_template_files", "write_mni_dataset", "write_phantom_dataset"]


def write_phantom_dataset(root: str | os.PathLike[str], cases: int = 4,
                          shape: tuple[int, int, int] = (48, 48, 40), seed: int = 0,
                          spacing: float = 2.0) -> Path:
    """Write ``cases`` phantoms to ``root/imagesTr``, ``root/labelsTr`` and
    ``root/dataset.json``; return the datalist's path."""
    import nibabel as nib

    root = Path(root)
    (root / "imagesTr").mkdir(parents=True, exist_ok=True)
    (root / "labelsTr").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    affine = np.diag([spacing, spacing, spacing, 1.0])
    entries = []
    for i in range(cases):
        image, label = _phantom(shape, rng)
        name = f"phantom_{i:03d}"
        nib.save(nib.Nifti1Image(image, affine), root / "imagesTr" / f"{name}.nii.gz")
        nib.save(nib.Nifti1Image(label, affine), root / "labelsTr" / f"{name}.nii.gz")
        entries.append({"image": f"./imagesTr/{name}.nii.gz",
                        "label": f"./labelsTr/{name}.nii.gz"})
    datalist = {"name": "remat3d CT phantoms", "modality": {"0": "CT"},
                "labels": {"0": "background", "1": "organ"}, "numTraining": cases,
                "training": entries}
    atomic_write_text(root / "dataset.json", json.dumps(datalist, indent=2))
    return root / "dataset.json"


def _phantom(shape: tuple[int, int, int], rng: np.random.Generator) -> tuple[np.ndarray,
                                                                              np.ndarray]:
    grid = np.stack(np.meshgrid(*[np.linspace(-1, 1, s) for s in shape], indexing="ij"))

    def ellipsoid(center: np.ndarray, radii: np.ndarray) -> np.ndarray:
        return (((grid - center[:, None, None, None]) / radii[:, None, None, None]) ** 2
                ).sum(0) <= 1

    jitter = lambda scale: rng.uniform(-scale, scale, 3)
    image = np.full(shape, -1000.0)                                    # air
    body_radii = np.array([0.85, 0.75, 1.2]) * rng.uniform(0.9, 1.05, 3)
    body = ellipsoid(jitter(0.05), body_radii)
    image[body] = -100.0                                               # fat
    image[ellipsoid(jitter(0.05), body_radii * 0.88) & body] = 40.0    # muscle/soft tissue
    for side in (-1, 1):                                               # lungs
        lung = ellipsoid(np.array([0.1, 0.38 * side, 0.25]) + jitter(0.05),
                         np.array([0.45, 0.25, 0.5]) * rng.uniform(0.85, 1.1, 3))
        image[lung & body] = -820.0
    spine = ellipsoid(np.array([-0.55, 0.0, 0.0]) + jitter(0.03), np.array([0.12, 0.12, 1.5]))
    image[spine & body] = 650.0                                        # bone
    organ = ellipsoid(np.array([0.15, -0.3, -0.45]) + jitter(0.1),
                      np.array([0.35, 0.3, 0.3]) * rng.uniform(0.7, 1.2, 3)) & body
    image[organ] = 60.0 + rng.uniform(-10, 30)                         # liver-like organ
    bias = 15.0 * np.sin(grid[0] * rng.uniform(1, 3) + rng.uniform(0, 6))
    noise = rng.normal(0.0, 18.0, shape)
    image = (image + (bias + noise) * body).astype(np.float32)
    return image, organ.astype(np.uint8)


def mni_template_files() -> tuple[Path, Path, Path]:
    """Paths of nilearn's MNI152 2009a T1, grey-matter and white-matter maps."""
    try:
        from nilearn import datasets
    except ImportError:
        raise DataError(
            "The MNI152 template comes from nilearn, which is not installed. Install it with "
            "pip install 'remat3d[demo]' (or pip install nilearn)."
        ) from None
    folder = Path(datasets.__file__).parent / "data"
    names = ("t1", "gm", "wm")
    paths = tuple(folder / f"mni_icbm152_{n}_tal_nlin_sym_09a_converted.nii.gz" for n in names)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"nilearn does not ship {missing[0]} in this version; install "
                        "nilearn>=0.10.")
    return paths  # type: ignore[return-value]


def write_mni_dataset(root: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write the MNI152 T1 volume and its tissue labels as a one-case training set, plus a
    validation case: the same anatomy with a different intensity bias, contrast and noise
    (there is one real volume offline; validation measures robustness, not generalisation).
    Returns the datalist's path."""
    import nibabel as nib

    t1_path, gm_path, wm_path = mni_template_files()
    t1: Any = nib.load(t1_path)
    t1_data = np.asarray(t1.get_fdata(), dtype=np.float32)
    gm = np.asarray(nib.load(gm_path).get_fdata(), dtype=np.float32)  # type: ignore[attr-defined]
    wm = np.asarray(nib.load(wm_path).get_fdata(), dtype=np.float32)  # type: ignore[attr-defined]
    scale = max(float(gm.max()), float(wm.max()), 1.0)
    gm, wm = gm / scale, wm / scale
    other = np.clip(1.0 - gm - wm, 0.0, 1.0)
    label = np.argmax(np.stack([other, gm, wm]), axis=0).astype(np.uint8)

    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.linspace(-1, 1, s) for s in t1_data.shape], indexing="ij"))
    bias = 1.0 + 0.15 * np.sin(1.5 * grid[0] + 0.5) * np.cos(grid[2])
    brightness = t1_data / max(float(t1_data.max()), 1.0)
    perturbed = (255.0 * brightness ** 1.2 * bias
                 + rng.normal(0.0, 4.0, t1_data.shape) * (t1_data > 0)).astype(np.float32)
    perturbed = np.clip(perturbed, 0.0, None)

    root = Path(root)
    (root / "imagesTr").mkdir(parents=True, exist_ok=True)
    (root / "labelsTr").mkdir(parents=True, exist_ok=True)
    files = {"mni152": t1_data, "mni152_perturbed": perturbed}
    for name, data in files.items():
        nib.save(nib.Nifti1Image(data, t1.affine), root / "imagesTr" / f"{name}.nii.gz")
        nib.save(nib.Nifti1Image(label, t1.affine), root / "labelsTr" / f"{name}.nii.gz")
    entry = lambda n: {"image": f"./imagesTr/{n}.nii.gz",
                       "label": f"./labelsTr/{n}.nii.gz"}
    datalist = {"name": "MNI ICBM152 2009a T1 (nilearn)", "modality": {"0": "MRI T1"},
                "labels": {"0": "background", "1": "grey matter", "2": "white matter"},
                "training": [entry("mni152")], "validation": [entry("mni152_perturbed")]}
    atomic_write_text(root / "dataset.json", json.dumps(datalist, indent=2))
    return root / "dataset.json"

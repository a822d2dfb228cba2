"""Predict on image files: NIfTI files or DICOM series in, one NIfTI per case out, on the
input's own voxel grid.

Each case is read and prepared as the training data was (``data.volumes``: orientation,
spacing, intensity), padded at the end of each axis to the network's divisor, predicted
whole by :func:`remat3d.predict` under the device budget, cropped back, and put back on the
input's grid by inverting the recorded spatial steps (MONAI's ``Compose.inverse``; nearest
neighbour for labels). Every output is written to a temporary name beside its target and
renamed when complete, so an interrupted or failed case leaves no file behind.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from remat3d.data.padding import Geometry, check_not_too_small, crop_back, pad_to_divisor
from remat3d.data.volumes import Preprocessing, prepare_image, read_image, spatial_transforms
from remat3d.errors import DataError, InputShapeError
from remat3d.predicting import PredictionPlan, plan_prediction, predict

__all__ = ["VolumeCase", "cases_from_inputs", "predict_case"]

logger = logging.getLogger(__name__)

_SUFFIXES = (".nii.gz", ".nii")


@dataclass(frozen=True)
class VolumeCase:
    """One prediction: the files holding its channels and the NIfTI it writes."""

    name: str
    images: tuple[Path, ...]
    output: Path


def _channels_in(path: Path) -> int:
    """Channels a file holds, from its header alone (a DICOM series: one)."""
    if path.is_dir():
        return 1
    import nibabel as nib

    try:
        shape = nib.load(str(path)).shape
    except Exception as exc:  # noqa: BLE001 - nibabel raises many types; name the file
        raise DataError(f"Cannot read {str(path)!r} as a NIfTI image: {type(exc).__name__}: "
                        f"{exc}. Give NIfTI files (.nii, .nii.gz) or DICOM series folders."
                        ) from None
    return int(shape[3]) if len(shape) == 4 else 1


def _case_name(path: Path, grouped: bool) -> str:
    name = path.name
    for suffix in _SUFFIXES:
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
            break
    if grouped and len(name) > 5 and name[-5] == "_" and name[-4:].isdigit():
        name = name[:-5]  # nnU-Net's channel suffix: case_0000.nii.gz, case_0001.nii.gz
    return name


def cases_from_inputs(inputs: Sequence[Path], channels: int, output_dir: Path, *,
                      overwrite: bool = False) -> list[VolumeCase]:
    """Group ``inputs`` into cases of ``channels`` channels (consecutive files, or one file
    holding them all) and name each case's output in ``output_dir``; every problem is found
    here, before anything is predicted or written."""
    if not inputs:
        raise DataError("No input volumes given: name NIfTI files or DICOM series folders.")
    for path in inputs:
        if not path.exists():
            raise DataError(f"Input {str(path)!r} does not exist.")
        if not path.is_dir() and not path.name.lower().endswith(_SUFFIXES):
            raise DataError(f"Input {str(path)!r} is neither a NIfTI file (.nii, .nii.gz) nor "
                            "a DICOM series folder.")
    if output_dir.exists() and not output_dir.is_dir():
        raise DataError(f"The output folder {str(output_dir)!r} is a file; name a folder "
                        "(it is created if absent).")
    cases: list[VolumeCase] = []
    group: list[Path] = []
    held = 0
    for path in inputs:
        group.append(path)
        held += _channels_in(path)
        if held < channels:
            continue
        if held > channels:
            raise InputShapeError(
                f"The network takes {channels} channel(s), but {', '.join(map(str, group))} "
                f"hold {held}. Give each case's channels as consecutive files "
                "(case_0000.nii.gz case_0001.nii.gz ...) or one file holding all of them.")
        name = _case_name(group[0], grouped=len(group) > 1)
        cases.append(VolumeCase(name, tuple(group), output_dir / f"{name}.nii.gz"))
        group, held = [], 0
    if group:
        raise InputShapeError(
            f"The network takes {channels} channels per case; the last case "
            f"({', '.join(map(str, group))}) has only {held}. Give each case's channels as "
            "consecutive files.")
    seen: dict[Path, VolumeCase] = {}
    for case in cases:
        if case.output in seen:
            raise DataError(f"Two cases would write {str(case.output)!r} "
                            f"({str(seen[case.output].images[0])!r} and "
                            f"{str(case.images[0])!r}); rename one input.")
        seen[case.output] = case
        if case.output.exists() and not overwrite:
            raise DataError(f"{str(case.output)!r} exists; remove it, choose another output "
                            "folder, or pass --overwrite.")
    return cases


def predict_case(case: VolumeCase, model: nn.Module, geometry: Geometry, prep: Preprocessing,
                 *, budget: str | int | None, amp: str | None, output: str,
                 device: torch.device, plans: dict[tuple[int, ...], PredictionPlan],
                 progress: Callable[[int, int], None] | None = None) -> PredictionPlan:
    """Predict ``case`` and write its NIfTI; ``plans`` caches a plan per padded shape (a
    dataset of one shape plans once). Returns the plan that ran."""
    image = read_image(case.images)
    if image.shape[0] != geometry.in_channels:
        raise InputShapeError(f"{str(case.images[0])!r} has {image.shape[0]} channel(s); the "
                              f"network takes {geometry.in_channels}.")
    spatial = spatial_transforms(prep, "bilinear")
    prepared = prepare_image(image, prep, spatial)
    check_not_too_small(tuple(prepared.shape[1:]), geometry, f"{str(case.images[0])!r}")
    volume, shape = pad_to_divisor(prepared.as_tensor().to(torch.float32)[None],
                                   geometry.divisor, geometry.min_size)
    key = tuple(volume.shape)
    if key not in plans:
        plans[key] = plan_prediction(model, key, budget=budget, amp=amp, output=output,
                                     device=device)
        logger.info("%s", plans[key].summary())
    out = predict(model, volume, plan=plans[key], progress=progress)
    out = crop_back(out if output != "labels" else out[:, None], shape)[0]
    restored = _restore_grid(out, prepared, spatial, labels=output == "labels")
    _write_nifti(case, restored, image, labels=output == "labels")
    return plans[key]


def _restore_grid(out: torch.Tensor, prepared: Any, spatial: Any, *,
                  labels: bool) -> torch.Tensor:
    """A prediction on the prepared grid, back on the input's grid (channel first) by the
    inverse of ``spatial``, the transforms that prepared it (nearest neighbour for labels)."""
    from monai.data import MetaTensor
    from monai.transforms.utils import convert_applied_interp_mode

    if not prepared.applied_operations:
        return out
    ops = prepared.applied_operations
    if labels:
        ops = convert_applied_interp_mode(ops, mode="nearest", align_corners=None)
    values = out.cpu().to(torch.float32)  # resampling needs floats; integers stay exact
    moved = MetaTensor(values, meta=dict(prepared.meta), applied_operations=list(ops))
    back = spatial.inverse(moved)
    back = back.as_tensor() if isinstance(back, MetaTensor) else back
    return back.round().to(out.dtype) if labels else back.to(out.dtype)


def _write_nifti(case: VolumeCase, out: torch.Tensor, image: Any, *, labels: bool) -> None:
    """``out`` (channel first, on the input's grid) as ``case.output``, written whole under
    a temporary name and renamed."""
    import nibabel as nib

    affine = np.asarray(image.affine, dtype=np.float64)
    array = out.cpu().numpy()
    array = array[0] if labels else np.moveaxis(array, 0, -1).astype(np.float32)
    header = None
    first = case.images[0]
    if not first.is_dir():
        header = nib.load(str(first)).header.copy()
        header.set_data_shape(array.shape)
    nifti = nib.Nifti1Image(array, affine, header=header)
    nifti.set_data_dtype(array.dtype)
    nifti.header.set_slope_inter(1.0, 0.0)
    case.output.parent.mkdir(parents=True, exist_ok=True)
    partial = case.output.with_name(f".{case.name}.{os.getpid()}.partial.nii.gz")
    try:
        nib.save(nifti, str(partial))
        os.replace(partial, case.output)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise

"""Read one case from disk and prepare it for a whole-volume training step.

MONAI reads the files (NIfTI through nibabel, DICOM series through pydicom) and does the
geometry (orientation to RAS, optional resampling to a spacing) and the intensity
normalisation (a CT window scaled to [0, 1], or a z-score over the non-zero voxels of an MR
volume). This module adds the checks a user needs before a long run: every failure names
the file and says how to fix it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from remat3d.data.datalist import Case
from remat3d.errors import DataError, quoted

__all__ = ["Preprocessing", "Volume", "load_case", "prepare_image", "read_image",
           "spatial_transforms"]

logger = logging.getLogger(__name__)

_RAS_LABELS = (("L", "R"), ("P", "A"), ("I", "S"))


@dataclass(frozen=True)
class Preprocessing:
    """How a volume is prepared; plain data, stored with the training settings.

    ``intensity``: ``"ct"`` clips to ``ct_window`` (Hounsfield units) and scales it to [0, 1];
    ``"mr"`` z-scores each channel over its non-zero voxels; ``"none"`` leaves values as read.
    """

    orientation: str | None = "RAS"
    spacing: tuple[float, float, float] | None = None
    intensity: str = "none"
    ct_window: tuple[float, float] = (-1000.0, 1000.0)

    def __post_init__(self) -> None:
        if self.intensity not in ("ct", "mr", "none"):
            raise DataError(
                f"intensity must be 'ct', 'mr' or 'none', got {self.intensity!r}."
            )
        low, high = self.ct_window
        if not low < high:
            raise DataError(f"ct_window must be [low, high] with low < high, got "
                            f"{list(self.ct_window)}.")
        if self.spacing is not None and (len(self.spacing) != 3
                                         or any(s <= 0 for s in self.spacing)):
            raise DataError(f"spacing must be three positive sizes in mm, got "
                            f"{list(self.spacing)}.")


@dataclass
class Volume:
    """A prepared case: image ``(C, D, H, W)`` float32, label ``(1, D, H, W)`` uint8 or
    ``None``, and the affine (voxel -> RAS mm) after orientation and resampling."""

    name: str
    image: torch.Tensor
    label: torch.Tensor | None
    affine: np.ndarray


def load_case(case: Case, prep: Preprocessing) -> Volume:
    """Read, check and prepare one case. Raises :class:`DataError` naming the bad file."""
    image = read_image(case.images)
    label = None
    if case.label is not None:
        label = _read(case.label)
        _same_grid(case.images[0], image, case.label, label, "label")
        if label.shape[0] != 1:
            raise DataError(
                f"Label map {str(case.label)!r} has {label.shape[0]} channels; a label map "
                "holds one integer class per voxel (a 3-D volume)."
            )
        _check_label(case.label, label)
    prepared = prepare_image(image, prep)
    affine = np.asarray(prepared.affine, dtype=np.float64)
    image_t = prepared.as_tensor().to(torch.float32).contiguous()
    label_t = None
    if label is not None:
        label = spatial_transforms(prep, "nearest")(label)
        label_t = label.as_tensor().round().to(torch.uint8).contiguous()
    return Volume(case.name, image_t, label_t, affine)


def read_image(paths: Sequence[Path]) -> Any:
    """The channels of one case (one file or DICOM folder each, on one voxel grid) as a
    channel-first MONAI MetaTensor with the first file's affine, checked finite."""
    channels = [_read(path) for path in paths]
    image = channels[0]
    for path, other in zip(paths[1:], channels[1:]):
        _same_grid(paths[0], channels[0], path, other, "channel")
    if len(channels) > 1:
        image = torch.cat(channels, dim=0)  # MetaTensor: keeps the first channel's affine
    _check_finite(paths, image)
    return image


def spatial_transforms(prep: Preprocessing, mode: str) -> Any:
    """Orientation then resampling (``mode``: ``"bilinear"`` for images, ``"nearest"`` for
    labels), as one MONAI ``Compose``: applied to a MetaTensor it records what it did, so
    ``.inverse`` of a prediction carrying that record puts it back on the input's grid."""
    from monai.transforms import Compose, Orientation, Spacing

    steps: list[Any] = []
    if prep.orientation:
        steps.append(Orientation(axcodes=prep.orientation, labels=_RAS_LABELS))
    if prep.spacing is not None:
        steps.append(Spacing(pixdim=prep.spacing, mode=mode))
    return Compose(steps)


def prepare_image(image: Any, prep: Preprocessing, spatial: Any = None) -> Any:
    """``image`` (a MetaTensor from :func:`read_image`) on the training grid with the
    training intensities; its ``applied_operations`` record the spatial steps, which the
    same ``spatial`` (``spatial_transforms(prep, "bilinear")``, made here if not given)
    can invert."""
    from monai.transforms import NormalizeIntensity, ScaleIntensityRange

    image = (spatial or spatial_transforms(prep, "bilinear"))(image)
    if prep.intensity == "ct":
        low, high = prep.ct_window
        image = ScaleIntensityRange(a_min=low, a_max=high, b_min=0.0, b_max=1.0,
                                    clip=True)(image)
    elif prep.intensity == "mr":
        image = NormalizeIntensity(nonzero=True, channel_wise=True)(image)
    return image


# --------------------------------------------------------------------------- reading


def _read(path: Path) -> Any:
    """One file (or DICOM folder) as a channel-first MONAI MetaTensor."""
    from monai.transforms import LoadImage

    reader = "PydicomReader" if path.is_dir() else "NibabelReader"
    # LoadImage sets up every reader MONAI knows, among them a GPU DICOM decoder plugin that
    # is absent on CPU machines and says so on every call; that is expected, not a problem.
    logging.getLogger("monai.data.nvimgcodec_pydicom_plugin").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nvImageCodec.*")
        try:
            loader = LoadImage(reader=reader, image_only=True, ensure_channel_first=True)
            volume = loader(str(path))
        except Exception as exc:  # noqa: BLE001 - readers raise many types; name the file
            cause = exc.__cause__ or exc
            # MONAI's "no suitable reader" comes with advice to install reader libraries,
            # which is not the problem: no reader recognised the file's contents
            why = ("no image reader recognises its contents." if "suitable reader" in
                   str(cause) else f"{type(cause).__name__}: {quoted(cause)}")
            raise DataError(
                f"Cannot read {str(path)!r} as an image: {why} The file may be truncated, "
                "or not a NIfTI file (DICOM series) whatever its name; re-export or "
                "re-download it."
            ) from None
    if volume.ndim != 4:
        raise DataError(
            f"{str(path)!r} holds a {volume.ndim - 1}-D image of shape "
            f"{tuple(volume.shape[1:])}; remat3d trains on 3-D volumes (one file per channel)."
        )
    return volume


def _same_grid(ref_path: Path, ref: Any, path: Path, other: Any, what: str) -> None:
    if tuple(ref.shape[1:]) != tuple(other.shape[1:]):
        raise DataError(
            f"The {what} {str(path)!r} has shape {tuple(other.shape[1:])} but its image "
            f"{str(ref_path)!r} has {tuple(ref.shape[1:])}. They must be on the same voxel "
            "grid; resample the one to the other (e.g. with the image as reference)."
        )
    a, b = np.asarray(ref.affine), np.asarray(other.affine)
    if not np.allclose(a, b, atol=1e-3, rtol=1e-4):
        worst = float(np.abs(a - b).max())
        raise DataError(
            f"The {what} {str(path)!r} and its image {str(ref_path)!r} have different affines "
            f"(largest difference {worst:.4g} mm): they are not aligned in space. Re-save the "
            f"{what} with the image's affine if they are in fact aligned."
        )


def _check_finite(paths: Sequence[Path], image: Any) -> None:
    for channel, path in enumerate(paths):
        values = image[channel]
        bad = ~torch.isfinite(values.as_tensor() if hasattr(values, "as_tensor") else values)
        if bool(bad.any()):
            count = int(bad.sum())
            raise DataError(
                f"{str(path)!r} has {count} NaN/Inf voxel(s) of {values.numel()}. Replace them "
                "(e.g. with the background value) before training."
            )


def _check_label(path: Path | None, label: Any) -> None:
    values = label.as_tensor() if hasattr(label, "as_tensor") else label
    if not bool(torch.isfinite(values).all()):
        raise DataError(f"Label map {str(path)!r} has NaN/Inf voxels; labels are integers.")
    if bool((values != values.round()).any()) or bool((values < 0).any()):
        raise DataError(
            f"Label map {str(path)!r} has non-integer or negative values (e.g. "
            f"{float(values[(values != values.round()) | (values < 0)][0]):g}); a label "
            "map holds class indices 0, 1, 2, ... (is it a probability map or an image?)."
        )
    if float(values.max()) > 255:
        raise DataError(f"Label map {str(path)!r} has class index {float(values.max()):g}; "
                        "at most 256 classes are supported.")

"""Which volumes a dataset holds: a Medical Segmentation Decathlon ``dataset.json`` datalist,
or folders of images and labels.

A :class:`Case` is plain data (file paths and a name); nothing is read here but the datalist
itself, and every path is checked to exist, so a typo is reported before any training starts.

>>> import json, pathlib, tempfile
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> for name in ("imagesTr/a.nii.gz", "labelsTr/a.nii.gz"):
...     (root / name).parent.mkdir(exist_ok=True); (root / name).touch()
>>> _ = (root / "dataset.json").write_text(json.dumps(
...     {"training": [{"image": "./imagesTr/a.nii.gz", "label": "./labelsTr/a.nii.gz"}]}))
>>> [c.name for c in read_datalist(root / "dataset.json").training]
['a']
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remat3d.errors import DataError

__all__ = ["Case", "Datalist", "case_name", "read_datalist", "split_validation"]

VOLUME_SUFFIXES = (".nii.gz", ".nii", ".dcm")


@dataclass(frozen=True)
class Case:
    """One volume: its image file(s) (one per channel) and, for training, its label map.

    An image or label path may be a NIfTI file or a folder holding one DICOM series.
    """

    name: str
    images: tuple[Path, ...]
    label: Path | None = None


@dataclass
class Datalist:
    """The cases to train on and to validate on, and where they were listed."""

    source: Path
    training: list[Case]
    validation: list[Case] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)  # class index -> name, if given


def case_name(path: Path) -> str:
    """The file (or DICOM folder) name without its volume suffix."""
    name = path.name
    for suffix in VOLUME_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def _without_channel(name: str) -> str | None:
    """``case_0001`` -> ``case`` (nnU-Net's channel suffix); ``None`` if there is none."""
    stem, _, channel = name.rpartition("_")
    return stem if stem and len(channel) == 4 and channel.isdigit() else None


def read_datalist(source: str | os.PathLike[str]) -> Datalist:
    """Read the cases from a ``dataset.json`` file or a folder.

    A folder may hold ``dataset.json``, or ``imagesTr``/``labelsTr`` (the MSD layout), or
    ``images``/``labels``; images and labels are paired by name (``case_0000.nii.gz`` and
    ``case_0001.nii.gz`` are two channels of ``case``, labelled by ``case.nii.gz``).
    """
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(
            f"Dataset {str(path)!r} does not exist. Give an MSD-style dataset.json or a "
            "folder with imagesTr/ and labelsTr/ (or images/ and labels/)."
        )
    if path.is_dir():
        if (path / "dataset.json").is_file():
            return _read_json(path / "dataset.json")
        return _read_folders(path)
    return _read_json(path)


def split_validation(cases: list[Case], fraction: float, seed: int) -> tuple[list[Case],
                                                                          list[Case]]:
    """A seeded split into (training, validation); at least one case stays in training."""
    if not 0 <= fraction < 1:
        raise DataError(f"val_fraction must be in [0, 1), got {fraction}.")
    count = min(round(len(cases) * fraction), len(cases) - 1)
    if count <= 0:
        return list(cases), []
    order = list(range(len(cases)))
    random.Random(seed).shuffle(order)
    chosen = set(order[:count])
    return ([c for i, c in enumerate(cases) if i not in chosen],
            [c for i, c in enumerate(cases) if i in chosen])


# --------------------------------------------------------------------------- json


def _read_json(path: Path) -> Datalist:
    try:
        content = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"Cannot read datalist {str(path)!r}: {exc}.") from None
    except json.JSONDecodeError as exc:
        raise DataError(
            f"Datalist {str(path)!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg}). Fix the file; the MSD format is "
            '{"training": [{"image": "...", "label": "..."}]}.'
        ) from None
    if not isinstance(content, dict) or not isinstance(content.get("training"), list):
        raise DataError(
            f"Datalist {str(path)!r} has no 'training' list. The MSD format is "
            '{"training": [{"image": "./imagesTr/a.nii.gz", "label": "./labelsTr/a.nii.gz"}]}.'
        )
    root = path.parent
    training = [_json_case(root, entry, path, "training", i)
                for i, entry in enumerate(content["training"])]
    validation = [_json_case(root, entry, path, "validation", i)
                  for i, entry in enumerate(content.get("validation") or [])]
    if not training:
        raise DataError(f"Datalist {str(path)!r} lists no training cases; add at least one.")
    labels = {str(k): str(v) for k, v in (content.get("labels") or {}).items()}
    return Datalist(path, training, validation, labels)


def _json_case(root: Path, entry: Any, source: Path, section: str, index: int) -> Case:
    where = f"{section}[{index}] of {str(source)!r}"
    if not isinstance(entry, dict) or "image" not in entry:
        raise DataError(f"Entry {where} needs an 'image' (and a 'label'); got {entry!r}.")
    if "label" not in entry:
        raise DataError(f"Entry {where} has no 'label'; training needs a label map per image.")
    raw = entry["image"] if isinstance(entry["image"], list) else [entry["image"]]
    images = tuple(_existing(root, str(p), where) for p in raw)
    label = _existing(root, str(entry["label"]), where)
    return Case(case_name(images[0]), images, label)


def _existing(root: Path, text: str, where: str) -> Path:
    path = Path(text).expanduser()
    path = path if path.is_absolute() else (root / path)
    if not path.exists():
        raise DataError(
            f"File {str(path)!r} (listed in {where}) does not exist. Paths in a datalist are "
            "relative to the datalist's folder."
        )
    return path


# --------------------------------------------------------------------------- folders


def _read_folders(root: Path) -> Datalist:
    for images_dir, labels_dir in (("imagesTr", "labelsTr"), ("images", "labels")):
        if (root / images_dir).is_dir():
            break
    else:
        raise DataError(
            f"Folder {str(root)!r} has no dataset.json, imagesTr/ or images/. Put the volumes "
            "in imagesTr/ and their label maps in labelsTr/ (same names), or write a "
            "dataset.json."
        )
    if not (root / labels_dir).is_dir():
        raise DataError(f"Folder {str(root / images_dir)!r} has no sibling {labels_dir}/ with "
                        "the label maps; training needs one label map per image.")
    labels = {case_name(p): p for p in sorted((root / labels_dir).iterdir()) if _is_volume(p)}
    images: dict[str, list[Path]] = {}
    for path in sorted((root / images_dir).iterdir()):
        if _is_volume(path):
            name = case_name(path)
            base = _without_channel(name)
            if name not in labels and base is not None:
                name = base  # one channel of case `base`, labelled by `base`
            images.setdefault(name, []).append(path)
    unlabelled = sorted(set(images) - set(labels))
    if unlabelled:
        raise DataError(
            f"Image(s) {', '.join(unlabelled[:5])} in {str(root / images_dir)!r} have no label "
            f"map of the same name in {str(root / labels_dir)!r}. Add them or move the images out."
        )
    if not images:
        raise DataError(f"Folder {str(root / images_dir)!r} holds no .nii, .nii.gz or DICOM "
                        "series; the dataset is empty.")
    cases = [Case(name, tuple(paths), labels[name]) for name, paths in sorted(images.items())]
    return Datalist(root, cases)


def _is_volume(path: Path) -> bool:
    if path.name.startswith("."):
        return False
    if path.is_dir():  # a DICOM series
        return any(p.suffix.lower() == ".dcm" or p.suffix == "" for p in path.iterdir()
                   if p.is_file())
    return path.name.lower().endswith((".nii", ".nii.gz"))

"""Which volumes a dataset holds: a Medical Segmentation Decathlon ``dataset.json`` datalist,
nnU-Net v2's raw dataset (its ``dataset.json`` with ``channel_names``), or folders of images
and labels.

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
    if isinstance(content, dict) and "channel_names" in content and "training" not in content:
        return _read_nnunet_raw(path, content)
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


def _read_nnunet_raw(path: Path, content: dict[str, Any]) -> Datalist:
    """nnU-Net v2's raw dataset (``nnUNet_raw/DatasetXXX_Name``): ``dataset.json`` with
    ``channel_names``, ``labels`` and ``file_ending``; ``imagesTr/{case}_{XXXX}{ending}``,
    one file per channel (stacked in channel order), ``labelsTr/{case}{ending}``."""
    root = path.parent
    channels = content.get("channel_names")
    ending = content.get("file_ending")
    labels = content.get("labels")
    if not isinstance(channels, dict) or not channels:
        raise DataError(f"nnU-Net dataset {str(path)!r}: channel_names must map channel "
                        f"indices to names, got {channels!r}.")
    if not isinstance(ending, str) or not ending:
        raise DataError(f"nnU-Net dataset {str(path)!r} has no file_ending (e.g. "
                        "'.nii.gz').")
    if ending.lower() not in (".nii.gz", ".nii"):
        raise DataError(f"nnU-Net dataset {str(path)!r} stores {ending} files; remat3d reads "
                        "NIfTI (.nii.gz, .nii). Convert the images and labels to NIfTI.")
    if not isinstance(labels, dict) or not labels:
        raise DataError(f"nnU-Net dataset {str(path)!r}: labels must map names to label "
                        f"values, got {labels!r}.")
    regions = [name for name, value in labels.items() if isinstance(value, (list, tuple))]
    if regions or "regions_class_order" in content:
        raise DataError(
            f"nnU-Net dataset {str(path)!r} uses region-based labels ({', '.join(regions)}); "
            "remat3d trains on one class per voxel. Give each label one value, or train this "
            "dataset with nnU-Net's own trainer.")
    if "ignore" in labels:
        raise DataError(f"nnU-Net dataset {str(path)!r} has an 'ignore' label; remat3d's "
                        "losses have none. Remove it (or relabel those voxels).")
    if "dataset" in content:
        raise DataError(f"nnU-Net dataset {str(path)!r} lists its cases in a 'dataset' "
                        "entry; remat3d reads the imagesTr/labelsTr layout only.")
    order = sorted(int(k) for k in channels)
    if order != list(range(len(order))):
        raise DataError(f"nnU-Net dataset {str(path)!r}: channel_names must be numbered 0, "
                        f"1, ...; got {sorted(channels)}.")
    images_dir, labels_dir = root / "imagesTr", root / "labelsTr"
    for folder in (images_dir, labels_dir):
        if not folder.is_dir():
            raise DataError(f"nnU-Net dataset {str(path)!r} has no {folder.name}/ folder.")
    cases = []
    for label in sorted(labels_dir.iterdir()):
        if label.name.startswith(".") or not label.name.endswith(ending):
            continue
        name = label.name[: -len(ending)]
        images = tuple(images_dir / f"{name}_{c:04d}{ending}" for c in order)
        missing = [p.name for p in images if not p.is_file()]
        if missing:
            raise DataError(f"nnU-Net dataset {str(path)!r}: case {name!r} lacks "
                            f"{', '.join(missing)} in imagesTr/ (one file per channel).")
        cases.append(Case(name, images, label))
    if not cases:
        raise DataError(f"nnU-Net dataset {str(path)!r}: labelsTr/ holds no {ending} label "
                        "maps; the dataset is empty.")
    expected = content.get("numTraining")
    if isinstance(expected, int) and expected != len(cases):
        raise DataError(f"nnU-Net dataset {str(path)!r} says numTraining {expected}, but "
                        f"labelsTr/ holds {len(cases)} cases.")
    names = {str(int(value)): str(name) for name, value in labels.items()}
    return Datalist(path, cases, [], names)


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

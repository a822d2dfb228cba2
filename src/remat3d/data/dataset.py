"""Full-volume training samples: each case whole, padded to the model's divisor.

No patch sampling by default: the network sees the whole volume. ``patch_size`` crops one
random patch per step instead, only to compare with patch training; the crop position comes
from a generator seeded by (seed, epoch, index), so a resumed run draws the same patches.
Volumes of different shapes are fine: each step has its own shape, and the trainer plans
each shape once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from remat3d.data.datalist import Case
from remat3d.data.padding import Geometry, check_not_too_small, pad_to_divisor, padded_shape
from remat3d.data.volumes import Preprocessing, Volume, load_case
from remat3d.errors import DataError

__all__ = ["Sample", "VolumeDataset"]

logger = logging.getLogger(__name__)


@dataclass
class Sample:
    """One training/validation input: ``image`` ``(1, C, D, H, W)`` and ``label``
    ``(1, 1, D, H, W)`` int64, both padded; ``shape`` is the unpadded spatial shape."""

    name: str
    image: torch.Tensor
    label: torch.Tensor
    shape: tuple[int, int, int]


class VolumeDataset:
    """Cases read through :func:`load_case`, checked against the model's geometry.

    ``cache=True`` keeps prepared volumes in memory (read once); otherwise each access reads
    the files again. :meth:`check` reads every case once up front, so a bad file or a volume
    too small for the model is reported before training starts.
    """

    def __init__(self, cases: Sequence[Case], prep: Preprocessing, geometry: Geometry, *,
                 cache: bool = True, patch_size: tuple[int, int, int] | None = None,
                 seed: int = 0) -> None:
        if not cases:
            raise DataError("The dataset is empty: no cases to train on.")
        self.cases = list(cases)
        self.prep = prep
        self.geometry = geometry
        self.cache = cache
        self.patch_size = patch_size
        self.seed = seed
        self._volumes: dict[int, Volume] = {}
        if patch_size is not None:
            bad = [p for p in patch_size if p % geometry.divisor or p < geometry.min_size]
            if len(patch_size) != 3 or bad:
                raise DataError(
                    f"patch_size {list(patch_size)} must be three edges, each a multiple of "
                    f"{geometry.divisor} and at least {geometry.min_size} for this model."
                )

    def __len__(self) -> int:
        return len(self.cases)

    def volume(self, index: int) -> Volume:
        if index in self._volumes:
            return self._volumes[index]
        volume = load_case(self.cases[index], self.prep)
        self._check(index, volume)
        if self.cache:
            self._volumes[index] = volume
        return volume

    def check(self) -> list[tuple[int, int, int]]:
        """Read every case once; return the padded spatial shape of each step's input."""
        shapes = []
        for i in range(len(self)):
            volume = self.volume(i)
            shapes.append(self.step_shape(tuple(volume.image.shape[1:])))  # type: ignore[arg-type]
        return shapes

    def step_shape(self, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        if self.patch_size is not None:
            return self.patch_size
        return padded_shape(shape, self.geometry.divisor, self.geometry.min_size)  # type: ignore[return-value]

    def sample(self, index: int, epoch: int = 0) -> Sample:
        volume = self.volume(index)
        image, label = volume.image, volume.label
        assert label is not None
        if self.patch_size is not None:
            image, label = self._patch(image, label, index, epoch)
        image, shape = pad_to_divisor(image, self.geometry.divisor, self.geometry.min_size)
        label, _ = pad_to_divisor(label, self.geometry.divisor, self.geometry.min_size)
        return Sample(volume.name, image.unsqueeze(0), label.unsqueeze(0).long(), shape)

    # ------------------------------------------------------------------------ private

    def _check(self, index: int, volume: Volume) -> None:
        case = self.cases[index]
        g = self.geometry
        channels = int(volume.image.shape[0])
        if channels != g.in_channels:
            raise DataError(
                f"Case {case.name!r} ({str(case.images[0])!r}) has {channels} channel(s) but "
                f"the model takes {g.in_channels}. List one file per channel in the datalist, "
                f"or build the model with in_channels={channels} (model_kwargs)."
            )
        shape = tuple(int(s) for s in volume.image.shape[1:])
        check_not_too_small(shape, g, f"Case {case.name!r} ({str(case.images[0])!r})")
        if volume.label is not None:
            top = int(volume.label.max())
            if top >= g.out_channels:
                raise DataError(
                    f"Label map {str(case.label)!r} has class {top} but the model predicts "
                    f"{g.out_channels} classes (0..{g.out_channels - 1}). Build it with "
                    f"out_channels={top + 1} (model_kwargs)."
                )

    def _patch(self, image: torch.Tensor, label: torch.Tensor, index: int,
               epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.patch_size is not None
        # a volume smaller than the patch is padded up to it first (as for whole volumes)
        image, _ = pad_to_divisor(image, 1, max(self.patch_size))
        label, _ = pad_to_divisor(label, 1, max(self.patch_size))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 10_007 + index)
        starts = []
        for size, patch in zip(image.shape[1:], self.patch_size):
            room = max(int(size) - patch, 0)
            starts.append(int(torch.randint(room + 1, (1,), generator=generator)))
        window = (slice(None), *(slice(s, s + p) for s, p in zip(starts, self.patch_size)))
        return image[window], label[window]

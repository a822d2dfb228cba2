"""Whole volumes of any size through networks that need sizes divisible by 2^levels.

A U-Net with ``k`` downsamplings needs every spatial edge divisible by ``2^k`` (SwinUNETR:
32). :func:`pad_to_divisor` pads the end of each axis up to the next multiple, and
:func:`crop_back` cuts a prediction back to the volume's own shape, so the loss and Dice are
computed on the real voxels only. For a model remat3d does not know, :func:`probe_geometry`
finds the divisor by running it on the meta device (no memory, any size) at sizes that are odd
multiples of each candidate.

>>> import torch
>>> x = torch.zeros(1, 1, 20, 33, 32)
>>> padded, shape = pad_to_divisor(x, 16)
>>> tuple(padded.shape), shape
((1, 1, 32, 48, 32), (20, 33, 32))
>>> tuple(crop_back(padded, shape).shape)
(1, 1, 20, 33, 32)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from remat3d.errors import DataError, InputShapeError

__all__ = ["Geometry", "check_not_too_small", "crop_back", "pad_to_divisor", "padded_shape",
           "probe_geometry"]

_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128)
_PROBE_EDGE = 48  # probe edges are at least this: past the depth limit of common networks


@dataclass(frozen=True)
class Geometry:
    """What a segmentation network needs of its input volume."""

    in_channels: int
    out_channels: int
    divisor: int
    min_size: int
    reason: str = ""  # in words, for error messages


def check_not_too_small(shape: tuple[int, ...], geometry: Geometry, what: str) -> None:
    """Refuse a volume that padding up to the network's smallest edge would more than
    double: the network would mostly see padding."""
    if min(shape) < geometry.min_size / 2:
        from remat3d.units import format_shape

        raise DataError(
            f"{what} is {format_shape(shape)} voxels after preprocessing; the model needs "
            f"edges of at least {geometry.min_size} ({geometry.reason or 'its downsampling depth'}"
            "), so padding would more than double it. Use a finer spacing, or a model with "
            "fewer levels."
        )


def padded_shape(shape: tuple[int, ...], divisor: int, min_size: int = 1) -> tuple[int, ...]:
    """Each edge rounded up to a multiple of ``divisor`` (and at least ``min_size``)."""
    return tuple(math.ceil(max(s, min_size) / divisor) * divisor for s in shape)


def pad_to_divisor(x: torch.Tensor, divisor: int, min_size: int = 1,
                   value: float = 0.0) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Pad the last three axes at their end; return the padded tensor and the old shape."""
    shape = tuple(int(s) for s in x.shape[-3:])
    target = padded_shape(shape, divisor, min_size)
    if target == shape:
        return x, shape  # type: ignore[return-value]
    pads: list[int] = []
    for size, goal in zip(reversed(shape), reversed(target)):
        pads += [0, goal - size]
    return F.pad(x, pads, value=value), shape  # type: ignore[return-value]


def crop_back(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The first ``shape`` voxels of the last three axes (undoes :func:`pad_to_divisor`)."""
    d, h, w = shape
    return x[..., :d, :h, :w]


def probe_geometry(model: nn.Module, in_channels: int | None = None,
                   divisible_by: int | None = None) -> Geometry:
    """Channels, divisor and smallest edge of a segmentation network, found on meta.

    The divisor is the smallest candidate ``k`` for which two odd multiples of ``k`` (of at
    least 48 voxels) both give an output of the input's spatial shape; ``divisible_by``
    skips the search. The smallest edge is the smallest multiple of ``k`` that works.
    """
    from remat3d.instrument.step import meta_copy

    probe = meta_copy(model)
    channels = in_channels or _first_in_channels(probe)
    if channels is None:
        raise InputShapeError(
            f"Cannot tell how many input channels {type(model).__name__} takes (no Conv3d or "
            "Linear found first). Set in_channels in model_kwargs."
        )

    def out_channels_at(edge: int) -> int | None:
        x = torch.empty(1, channels, edge, edge, edge, device="meta")
        try:
            with torch.no_grad():
                y = probe(x)
        except Exception:  # noqa: BLE001 - a shape the network cannot take is the probe's answer
            return None
        y = y[0] if isinstance(y, (tuple, list)) else y
        if not isinstance(y, torch.Tensor) or tuple(y.shape[2:]) != (edge,) * 3:
            return None
        return int(y.shape[1])

    candidates = (divisible_by,) if divisible_by else _CANDIDATES
    for k in candidates:
        # two odd multiples of k, large enough that depth (not divisibility) cannot fail them
        odd = max(3, math.ceil(_PROBE_EDGE / k)) | 1
        outs = [out_channels_at(k * m) for m in (odd, odd + 2)]
        if all(o is not None for o in outs):
            assert outs[0] is not None
            smallest = next(k * m for m in range(1, odd + 1) if out_channels_at(k * m))
            return Geometry(channels, outs[0], k, smallest, reason="found by probing the model")
    raise InputShapeError(
        f"{type(model).__name__} gave no output of its input's spatial shape for any edge "
        f"that is an odd multiple of {', '.join(map(str, candidates))} (probed on meta with "
        f"{channels} input channel(s)). remat3d trains segmentation networks whose output "
        "matches the input's size; set divisible_by in the settings if the probe is wrong."
    )


def _first_in_channels(model: nn.Module) -> int | None:
    for module in model.modules():
        if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
            return int(module.in_channels)
        if isinstance(module, nn.Linear):
            return int(module.in_features)
    return None

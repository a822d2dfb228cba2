"""The input shapes a preset accepts: divisibility and minimum sizes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from remat3d.errors import InputShapeError
from remat3d.units import format_shape
from remat3d.zoo.presets import Preset, get_preset

__all__ = ["SIZE_NEUTRAL_KWARGS", "check_input_shape", "legal_shape", "smallest_input_shape"]

# model kwargs that cannot change which input sizes a preset's network takes (any other,
# strides, depth, kernels, may: those shapes are checked on the network built)
SIZE_NEUTRAL_KWARGS = frozenset({
    "in_channels", "out_channels", "n_input_channels", "num_classes", "dropout",
    "dropout_prob", "dropout_rate", "act", "act_name", "norm", "norm_name", "bias"})


# --------------------------------------------------------------------------- shapes


def _legal_edge(preset: Preset, size: int) -> int:
    size = max(int(size), preset.min_size)
    return math.ceil(size / preset.divisor) * preset.divisor


def legal_shape(preset: str | Preset, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with each spatial edge (the last three) padded up to the nearest legal size."""
    preset = get_preset(preset)
    if len(shape) < 3:
        raise InputShapeError(
            f"An input shape needs three spatial sizes (D, H, W), got {format_shape(shape)}."
        )
    return tuple(int(s) for s in shape[:-3]) + tuple(_legal_edge(preset, s) for s in shape[-3:])


def smallest_input_shape(preset: str | Preset) -> tuple[int, int, int, int, int]:
    """``(1, in_channels, m, m, m)`` for the smallest legal edge ``m``."""
    preset = get_preset(preset)
    m = _legal_edge(preset, 1)
    return (1, preset.in_channels, m, m, m)


def check_input_shape(
    preset: str | Preset,
    shape: tuple[int, ...],
    model_kwargs: Mapping[str, Any] | None = None,
    divisibility: bool = True,
) -> None:
    """Raise :class:`InputShapeError` unless ``shape`` (B, C, D, H, W) suits the preset.

    ``model_kwargs`` are the kwargs the model is built with; an ``in_channels`` there
    (``n_input_channels`` for resnet3d) replaces the preset's default channel count. The
    divisibility rule is the preset's default one; with kwargs that change the network's
    geometry (strides, depth) pass ``divisibility=False`` and check the built network
    (``data.padding.probe_geometry``) instead.
    """
    preset = get_preset(preset)
    shape = tuple(int(s) for s in shape)
    if len(shape) != 5:
        raise InputShapeError(
            f"{preset.name} takes a 5-D input (batch, channels, D, H, W); got {len(shape)} dims: "
            f"{format_shape(shape)}. Example of a legal shape: "
            f"{format_shape(smallest_input_shape(preset))}."
        )
    kwargs = model_kwargs or {}
    in_channels = kwargs.get("in_channels", kwargs.get("n_input_channels", preset.in_channels))
    if shape[1] != in_channels:
        raise InputShapeError(
            f"{preset.name} is built for {in_channels} input channel(s); got {shape[1]} in "
            f"{format_shape(shape)}. Pass in_channels={shape[1]} in the model kwargs, or give "
            f"the input {in_channels} channel(s)."
        )
    fixed = legal_shape(preset, shape)
    if fixed == shape or not divisibility:
        return
    spatial = dict(zip("DHW", shape[2:]))
    small = [axis for axis, size in spatial.items() if size < preset.min_size]
    ragged = [axis for axis, size in spatial.items() if size % preset.divisor]
    rules = []
    if ragged:
        rules.append(f"divisible by {preset.divisor} ({preset.divisor_rule})")
    if small:
        rules.append(f"at least {preset.min_size} ({preset.min_size_rule})")
    offending = ", ".join(f"{axis}={spatial[axis]}" for axis in "DHW" if axis in small + ragged)
    verb = "is not" if len(set(small + ragged)) == 1 else "are not"
    raise InputShapeError(
        f"{preset.name} needs every spatial size {' and '.join(rules)}; got {format_shape(shape)} "
        f"({offending} {verb}). Pad to {format_shape(fixed)}."
    )

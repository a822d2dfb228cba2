"""Model presets of the field's standard 3D networks (built through MONAI) and model specs.

A *model spec* is what the command line's ``--model`` takes:

- a preset name from :data:`PRESETS` (below);
- ``package.module:Class`` — imported, then called as ``Class(**model_kwargs)``;
- a path to a ``.py`` file that defines ``build_model(**model_kwargs) -> nn.Module``.

The package: ``presets.py`` (the table of presets and the shapes each accepts),
``specs.py`` (model specs and their kwargs), ``meta.py`` (building on the meta device),
``shapes.py`` (divisibility and minimum sizes), ``full_resolution.py`` (each preset's
full-resolution modules as tiled plan regions).

>>> check_input_shape("nnunet", (1, 1, 100, 128, 128))
Traceback (most recent call last):
...
remat3d.errors.InputShapeError: nnunet needs every spatial size divisible by 32 (2^5 \
downsamplings); got 1x1x100x128x128 (D=100 is not). Pad to 1x1x128x128x128.
>>> legal_shape("unet", (2, 1, 20, 40, 33))
(2, 1, 32, 48, 48)
>>> smallest_input_shape("segresnet")
(1, 1, 8, 8, 8)
"""

from remat3d.zoo.presets import PRESETS, Preset, get_preset, preset_names
from remat3d.zoo.shapes import (
    SIZE_NEUTRAL_KWARGS,
    check_input_shape,
    legal_shape,
    smallest_input_shape,
)
from remat3d.zoo.specs import build_model, parse_model_kwargs

__all__ = [
    "PRESETS",
    "SIZE_NEUTRAL_KWARGS",
    "Preset",
    "build_model",
    "check_input_shape",
    "get_preset",
    "legal_shape",
    "parse_model_kwargs",
    "preset_names",
    "smallest_input_shape",
]

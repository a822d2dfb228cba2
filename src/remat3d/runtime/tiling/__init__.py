"""Exact spatially tiled execution of full-resolution stages (``remat3d.tile``).

A run of spatially local modules is executed tile by tile with the halos its receptive
field needs, forward and backward, keeping only its inputs; normalisations use whole-volume
statistics gathered over tiles. See ``docs/tiling.md``.
"""

from remat3d.runtime.tiling.tiled import TiledRun, tile
from remat3d.runtime.tiling.trace import TilingError

__all__ = ["TiledRun", "TilingError", "tile"]

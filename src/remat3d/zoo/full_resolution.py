"""Which modules of the zoo presets run at full resolution, as tiled plan regions.

Each entry is a module whose every input and output is a full-resolution tensor (or a
half-resolution input that it upsamples): the stages whose working set dominates a
whole-volume training step. ``full_resolution_plan`` makes a :class:`~remat3d.Plan` that
tiles them; combine it with recompute regions for the rest of the network.

>>> [r.module for r in full_resolution_plan("basicunet", 48).regions]
['conv_0', 'upcat_1', 'final_conv']
"""

from __future__ import annotations

from remat3d.errors import PlanError
from remat3d.planspec import Plan, Region

__all__ = ["FULL_RESOLUTION", "full_resolution_plan"]

FULL_RESOLUTION: dict[str, tuple[str, ...]] = {
    # DynUNet: first block; last decoder stage (transposed conv, skip concat, 2 convs); 1x1 head
    "nnunet": ("input_block", "upsamples.4", "output_block"),
    # MONAI UNet: the stride-2 residual unit reading the input; the top up layer
    "unet": ("model.0", "model.2"),
    # BasicUNet: first two convs; last UpCat (transposed conv, concat, two convs); 1x1 head
    "basicunet": ("conv_0", "upcat_1", "final_conv"),
    # SegResNet: stem conv, first ResBlock; 1x1 conv + trilinear upsampling; last ResBlock;
    # head (GroupNorm, ReLU, 1x1 conv)
    "segresnet": ("convInit", "down_layers.0", "up_samples.2", "up_layers.2", "conv_final"),
}


def full_resolution_plan(preset: str, tile: int | tuple[int, int, int]) -> Plan:
    """A plan that tiles the full-resolution modules of ``preset`` with output tile ``tile``."""
    if preset not in FULL_RESOLUTION:
        raise PlanError(f"No full-resolution stages known for preset {preset!r}; known: "
                         f"{', '.join(FULL_RESOLUTION)}. Write the regions by hand: "
                         "Region(module, decision='tile', tile=[D, H, W]).")
    size = [tile] * 3 if isinstance(tile, int) else list(tile)
    return Plan(regions=[Region(m, decision="tile", tile=size) for m in FULL_RESOLUTION[preset]],
                model=preset, strategy="manual")

"""The one vocabulary of decisions, shared by the planner, the plan and the executor.

Each member is a ``str`` (``Decision.RECOMPUTE == "recompute"``), so plans stay plain JSON
and older code comparing with the strings keeps working.

>>> Decision("recompute") is Decision.RECOMPUTE
True
>>> [d.value for d in PLAN_DECISIONS]
['recompute', 'offload', 'keep', 'tile']
"""

from __future__ import annotations

from enum import Enum

__all__ = ["PLAN_DECISIONS", "SELECTIVE_POLICY", "Decision", "TiledOutput"]


class Decision(str, Enum):
    """What happens to a stage's (or region's) saved activations."""

    KEEP = "keep"            # stored for backward, as without a plan
    RECOMPUTE = "recompute"  # only the inputs are kept; forward runs again in backward
    # recompute, keeping the outputs of compute-heavy ops (convolutions, matmuls): written
    # in a plan as RECOMPUTE with the op policy SELECTIVE_POLICY
    SELECTIVE = "selective"
    OFFLOAD = "offload"      # stored in host memory, copied back for backward
    TILE = "tile"            # run tile by tile, forward and backward (remat3d.tile)

    def __str__(self) -> str:
        return self.value


# what a plan's Region.decision may say (SELECTIVE is RECOMPUTE plus a policy there)
PLAN_DECISIONS = (Decision.RECOMPUTE, Decision.OFFLOAD, Decision.KEEP, Decision.TILE)
SELECTIVE_POLICY = "save-compute-heavy"


class TiledOutput(str, Enum):
    """Where a tiled region's output lives: written out on the device, never stored
    (``Region.fuse``: tiled readers recompute it), kept in host memory (``Region.host``),
    or on the device until its readers' forwards are done and made again in each of
    their backwards (``Region.rebuild``)."""

    DEVICE = "device"
    FUSED = "fused"
    HOST = "host"
    REBUILT = "rebuilt"

    def __str__(self) -> str:
        return self.value

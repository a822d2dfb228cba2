"""remat3d: train 3D networks on whole CT/MRI volumes within a memory budget.

Measure a model's training step (memory, FLOPs; on the meta device at any size), then plan
gradient checkpointing so the step fits a budget with gradients identical to ordinary
training.
"""

from remat3d.errors import Remat3dError
from remat3d.graph import CostGraph
from remat3d.instrument.tracker import MemoryTracker
from remat3d.measurement import Measurement, measure
from remat3d.nn.tiling import TilingError, tile
from remat3d.planning import plan
from remat3d.planspec import Plan, Region
from remat3d.profiling import Profile, profile
from remat3d.runtime.apply import apply, remove
from remat3d.runtime.region import checkpoint
from remat3d.runtime.report import Report, report
from remat3d.runtime.state import is_recomputing

__all__ = [
    "CostGraph",
    "Measurement",
    "MemoryTracker",
    "Plan",
    "Profile",
    "Region",
    "Remat3dError",
    "Report",
    "TilingError",
    "__version__",
    "apply",
    "checkpoint",
    "is_recomputing",
    "measure",
    "plan",
    "profile",
    "remove",
    "report",
    "tile",
]

__version__ = "0.1.0"

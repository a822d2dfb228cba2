"""remat3d: train 3D networks on whole CT/MRI volumes within a memory budget.

Measure a model's training step (memory, FLOPs; on the meta device at any size), then plan
gradient checkpointing so the step fits a budget with gradients identical to ordinary
training.
"""

from remat3d.errors import Remat3dError
from remat3d.graph import CostGraph
from remat3d.instrument.tracker import MemoryTracker
from remat3d.measurement import Measurement, measure
from remat3d.profile import Profile, profile

__all__ = [
    "CostGraph",
    "Measurement",
    "MemoryTracker",
    "Profile",
    "Remat3dError",
    "__version__",
    "measure",
    "profile",
]

__version__ = "0.1.0"

"""remat3d: train 3D networks on whole CT/MRI volumes within a memory budget.

Measure a model's training step (memory, FLOPs; on the meta device at any size), then plan
gradient checkpointing so the step fits a budget with gradients identical to ordinary
training.

The package is lazy (PEP 562): ``import remat3d`` loads no torch; each public name is
imported from its module the first time it is used, so the torch-free planner
(``remat3d.planner``) and ``remat3d --help`` stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    "predict",
    "profile",
    "remove",
    "report",
    "tile",
]

__version__ = "0.1.0"

# public name -> the module that defines it
_WHERE = {
    "CostGraph": "remat3d.graph",
    "Measurement": "remat3d.measurement",
    "MemoryTracker": "remat3d.instrument.tracker",
    "Plan": "remat3d.planspec",
    "Profile": "remat3d.profiling",
    "Region": "remat3d.planspec",
    "Remat3dError": "remat3d.errors",
    "Report": "remat3d.runtime.report",
    "TilingError": "remat3d.errors",
    "apply": "remat3d.runtime.apply",
    "checkpoint": "remat3d.runtime.region",
    "is_recomputing": "remat3d.instrument.state",
    "measure": "remat3d.measurement",
    "plan": "remat3d.planning",
    "predict": "remat3d.predicting",
    "profile": "remat3d.profiling",
    "remove": "remat3d.runtime.apply",
    "report": "remat3d.runtime.report",
    "tile": "remat3d.runtime.tiling",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'remat3d' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from remat3d.errors import Remat3dError, TilingError
    from remat3d.graph import CostGraph
    from remat3d.instrument.state import is_recomputing
    from remat3d.instrument.tracker import MemoryTracker
    from remat3d.measurement import Measurement, measure
    from remat3d.planning import plan
    from remat3d.planspec import Plan, Region
    from remat3d.profiling import Profile, profile
    from remat3d.runtime.apply import apply, remove
    from remat3d.runtime.region import checkpoint
    from remat3d.runtime.report import Report, report
    from remat3d.runtime.tiling import tile

"""The planner: every strategy and the search behind one registry. Pure Python (numpy and
scipy's HiGHS), never torch: it reads plain data (``CostGraph``, ``StageModel``) and writes
plain data (``Plan``); ``remat3d.plan`` supplies the verifier that measures candidates.

- ``stages.py``: the stage model (blocks, loose compute layers) and its linear memory model
- ``registry.py``: the strategies by name; ``optimal.py`` (MILP), ``chain.py`` (rotor-style
  DP), ``recursive.py`` (binomial / budgeted trees), ``segments.py`` (fixed segmentations)
- ``searching.py``: decisions to verified plans under the budget (NOTE [ The budget is a
  promise ]); ``tiled_plans.py`` and ``tiling.py``: tiling layouts when nothing else fits
"""

from remat3d.planner.measured import Measured, Verifier
from remat3d.planner.registry import STRATEGIES, PlannerOptions, get_strategy
from remat3d.planner.searching import Problem, search

__all__ = ["STRATEGIES", "Measured", "PlannerOptions", "Problem", "Verifier", "get_strategy",
           "search"]

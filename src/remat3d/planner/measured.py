"""What the search's verifier answers of a candidate plan, and where it may stop.

Plain data between the torch side (``planning.py`` measures a candidate on meta under the
tracker) and the pure search (``searching.py``, ``tiled_plans.py``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

from remat3d.planspec import Plan

__all__ = ["Limits", "Measured", "Verifier", "signature"]


class Measured(NamedTuple):
    """What the verifier measured of one planned step."""

    peak_bytes: int
    recompute_flops: int
    flops: int        # every FLOP of the planned step (recomputation, tile passes, halos)
    host_bytes: int   # host memory of host-resident tiled outputs
    peak_module: str | None = None  # the innermost module running at the peak
    # per tiled region's label and part of its run, the most bytes live while it ran
    tiled_peaks: Mapping[str, Mapping[str, int]] = MappingProxyType({})
    # False: stopped at a limit (``Limits``); ``peak_bytes`` and ``flops`` are then lower
    # bounds of the step's, ``peak_module`` where it passed the limit, the rest unknown
    complete: bool = True
    # when the peak was reached: "forward" or "backward" (None: unknown)
    peak_phase: str | None = None

    def answers(self, within: Limits | None) -> bool:
        """Whether this measurement answers a request made ``within`` those limits:
        complete, or stopped past one of them too."""
        if self.complete:
            return True
        return within is not None and (
            (within.peak_bytes is not None and self.peak_bytes > within.peak_bytes)
            or (within.flops is not None and self.flops > within.flops))


class Limits(NamedTuple):
    """Where a verifier may stop measuring a candidate (NOTE [ Bounded measurements ] in
    ``instrument/tracker.py``): once its peak passes ``peak_bytes`` or its FLOPs pass
    ``flops``, it is of no use to the search (None: no limit)."""

    peak_bytes: int | None = None
    flops: int | None = None


# a candidate and where its measurement may stop (None: measure it whole)
Verifier = Callable[[Plan, Limits | None], Measured]


def signature(plan: Plan) -> str:
    """What a measurement of ``plan`` depends on, as a key (searches revisit plans, and
    each distinct one is measured once): every field of its regions and the plan-wide
    settings the runtime and the verifier read."""
    return json.dumps([dataclasses.asdict(r) for r in plan.regions]
                      + [plan.offload_min_bytes, plan.prefetch, plan.rebuild_saved,
                         plan.spans, plan.amp, plan.input_shapes, plan.graph_backend],
                      sort_keys=True)

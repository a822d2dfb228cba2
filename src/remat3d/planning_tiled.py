"""Tiled plans: the planner's tiling layouts as plan regions, verified, then pruned.

Used by ``remat3d.plan`` (``planning.py``) when no plan of keep / recompute / selective /
offload decisions fits the budget; the layouts themselves come from the pure
``planner/tiling.py`` (NOTE [ Tiling layouts ]).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from torch import nn

from remat3d.graph import CostGraph
from remat3d.planner.registry import PlannerOptions
from remat3d.planner.stages import KEEP, RECOMPUTE, SELECTIVE, Stage, StageModel
from remat3d.planner.tiling import Layout, layouts
from remat3d.planspec import Plan, Region
from remat3d.units import format_bytes

__all__ = ["extra_cost", "layout_regions", "prune_tiled", "tiled_plan"]

log = logging.getLogger(__name__)


def layout_regions(stages: StageModel, layout: Layout,
                   recomputable: list[bool] | None = None) -> list[Region]:
    """A tiling layout as plan regions: its stages tiled (and fused), every other stage
    recomputed where it may be (NOTE [ Tiling layouts ] rule 4)."""
    ok = recomputable or [True] * len(stages.stages)
    regions = []
    for st in stages.stages:
        if st.index in layout.tiled:
            size, output = layout.tiled[st.index]
            regions.append(Region(st.name, calls=[st.call_index], decision="tile",
                                  tile=list(size), fuse=output == "fused",
                                  host=output == "host"))
        elif ok[st.index]:
            regions.append(Region(st.name, calls=[st.call_index]))
    return regions


def tiled_plan(model: nn.Module, shapes: list[tuple[int, ...]], amp: str | None, graph: CostGraph,
           stages: StageModel, options: PlannerOptions, budget: int,
           check: Callable[[Plan], Plan], header: Plan) -> tuple[Plan | None, int]:
    """The first tiling layout (cheapest expected first, NOTE [ Tiling layouts ]) whose
    verified peak fits ``budget`` (and whose host memory fits ``header``'s host budget),
    and the smallest verified peak among those tried that fit the host budget.

    Each layout tiles its stages and recomputes every other stage (``prune_tiled``
    then keeps what still fits); layouts whose verified peak exceeds the budget are
    passed over, as are stages that cannot run tiled (``runtime/tiling/probe.py``)."""
    from remat3d.runtime.tiling.probe import tileable
    from remat3d.runtime.tiling.trace import TilingError

    names = [(st.name, st.call_index) for st in stages.stages]
    ok = tileable(model, shapes, amp, names)
    smallest = 1 << 62
    for layout in layouts(graph, stages, ok, host=options.offload):
        candidate = dataclasses.replace(header, regions=layout_regions(stages, layout,
                                                                       options.recomputable),
                                        notes=[f"tiling layout: {layout.label}"])
        try:
            check(candidate)
        except TilingError as exc:  # an op the probe did not see (shape-dependent code)
            log.info("tiling layout %s skipped: %s", layout.label, exc)
            continue
        peak = candidate.verified_peak_bytes or 0
        host = candidate.verified_host_bytes or 0
        log.info("tiling layout %s: verified peak %s, host %s, extra %.3g FLOPs",
                 layout.label, format_bytes(peak), format_bytes(host),
                 candidate.extra_flops or 0)
        if header.host_budget_bytes is not None and host > header.host_budget_bytes:
            continue
        smallest = min(smallest, peak)
        if peak <= budget:
            return candidate, smallest
    return None, smallest


def extra_cost(p: Plan) -> int:
    """Extra FLOPs of a verified plan (tiled plans: halos and passes too)."""
    return p.extra_flops if p.extra_flops is not None else (p.recompute_flops or 0)


def prune_tiled(best: Plan, budget: int, stages: StageModel,
                   check: Callable[[Plan], Plan]) -> Plan:
    """A tiled plan made cheaper like ``planning._prune`` does: each recomputed stage, costliest
    first, is kept instead, else recomputed keeping its convolution outputs, while the
    verified peak still fits and the extra FLOPs do not grow. So a tiled plan mixes keep,
    selective recomputation, recomputation and tiling (NOTE [ Tiling layouts ] rule 4 is
    where it starts). Tiled regions stay as they are.

    Verifying a tiled plan is slow at 512³ (tens of seconds), so a step is only tried
    for a stage that recomputes at least 1 % of the step's FLOPs, and when the bytes it
    would add to the stage's saved tensors, by the stage model, fit in what the budget
    has left above the verified peak.
    """
    by_name = {(st.name, st.call_index): st for st in stages.stages}

    def stage_of(r: Region) -> Stage | None:
        if r.decision != RECOMPUTE or r.segment or r.policy is not None:
            return None
        return by_name.get((r.module, (r.calls or [0])[0]))

    floor = (best.step_flops or 0) // 100
    recomputed = [(r, st) for r in best.regions
                  if (st := stage_of(r)) is not None and st.fwd_flops >= floor]
    for region, st in sorted(recomputed, key=lambda pair: -pair[1].fwd_flops):
        others = [r for r in best.regions if r is not region]
        selective = dataclasses.replace(region, policy="save-compute-heavy")
        for decision, trial in ((KEEP, others), (SELECTIVE, [*others, selective])):
            slack = budget - (best.verified_peak_bytes or 0)
            if st.kept(decision) - st.kept(RECOMPUTE) > slack:
                continue
            candidate = check(dataclasses.replace(best, regions=trial, notes=list(best.notes)))
            if (candidate.verified_peak_bytes or 0) <= budget and extra_cost(candidate) <= extra_cost(best):
                best = candidate
                break
    return best

"""The tiled half of the search: tiling layouts as plan regions, the first that fits, pruned.

Used by the search (``searching.py``) when no plan of keep / recompute / selective / offload
decisions fits the budget; the layouts come from ``tiling.py`` (NOTE [ Tiling layouts ]).
Pure: candidates are measured through the ``check`` the search passes in.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from remat3d.decisions import SELECTIVE_POLICY, Decision, TiledOutput
from remat3d.errors import TilingError
from remat3d.planner.registry import PlannerOptions
from remat3d.planner.stages import KEEP, RECOMPUTE, SELECTIVE, Stage, StageModel
from remat3d.planner.tiling import Layout
from remat3d.planspec import Plan, Region
from remat3d.units import format_bytes

__all__ = ["extra_cost", "first_fitting_layout", "greedy_prune", "layout_regions",
           "prune_tiled"]

log = logging.getLogger(__name__)

Check = Callable[[Plan], Plan]
T = TypeVar("T")


def extra_cost(p: Plan) -> int:
    """Extra FLOPs of a verified plan (tiled plans: halos and passes too)."""
    return p.extra_flops if p.extra_flops is not None else (p.recompute_flops or 0)


def layout_regions(stages: StageModel, layout: Layout,
                   recomputable: list[bool] | None = None) -> list[Region]:
    """A tiling layout as plan regions: its stages tiled (and fused), every other stage
    recomputed where it may be (NOTE [ Tiling layouts ] rule 4)."""
    ok = recomputable or [True] * len(stages.stages)
    regions = []
    for st in stages.stages:
        if st.index in layout.tiled:
            size, output = layout.tiled[st.index]
            regions.append(Region(st.name, calls=[st.call_index], decision=Decision.TILE,
                                  tile=list(size), fuse=output == TiledOutput.FUSED,
                                  host=output == TiledOutput.HOST))
        elif ok[st.index]:
            regions.append(Region(st.name, calls=[st.call_index]))
    return regions


def first_fitting_layout(candidates: Iterable[Layout], stages: StageModel,
                         options: PlannerOptions, host_budget: int | None, budget: int,
                         fresh: Callable[[list[Region]], Plan], check: Check
                         ) -> tuple[Plan | None, int]:
    """The first tiling layout (cheapest expected first, NOTE [ Tiling layouts ]) whose
    verified peak fits ``budget`` (and whose host memory fits ``host_budget``), and the
    smallest verified peak among those tried that fit the host budget.

    Each layout tiles its stages and recomputes every other stage (``prune_tiled`` then
    keeps what still fits); layouts whose verified peak exceeds the budget are passed
    over. ``fresh(regions)`` makes a plan with the search's header fields."""
    smallest = 1 << 62
    for layout in candidates:
        candidate = fresh(layout_regions(stages, layout, options.recomputable))
        candidate.notes.append(f"tiling layout: {layout.label}")
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
        if host_budget is not None and host > host_budget:
            continue
        smallest = min(smallest, peak)
        if peak <= budget:
            return candidate, smallest
    return None, smallest


def prune_tiled(best: Plan, budget: int, stages: StageModel, check: Check) -> Plan:
    """A tiled plan made cheaper like the search's ``prune`` does: each recomputed stage,
    costliest first, is kept instead, else recomputed keeping its convolution outputs,
    while the verified peak still fits and the extra FLOPs do not grow. So a tiled plan
    mixes keep, selective recomputation, recomputation and tiling (NOTE [ Tiling layouts ]
    rule 4 is where it starts). Tiled regions stay as they are.

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

    def trials(step: tuple[Region, Stage], current: Plan) -> Iterator[Plan]:
        region, st = step
        others = [r for r in current.regions if r is not region]
        selective = dataclasses.replace(region, policy=SELECTIVE_POLICY)
        for decision, regions in ((KEEP, others), (SELECTIVE, [*others, selective])):
            slack = budget - (current.verified_peak_bytes or 0)
            if st.kept(decision) - st.kept(RECOMPUTE) <= slack:
                yield check(dataclasses.replace(current, regions=regions,
                                                notes=list(current.notes)))

    def cheaper(candidate: Plan, current: Plan) -> bool:
        return (candidate.verified_peak_bytes or 0) <= budget and \
            extra_cost(candidate) <= extra_cost(current)

    return greedy_prune(best, sorted(recomputed, key=lambda pair: -pair[1].fwd_flops),
                        trials, cheaper)


def greedy_prune(best: Plan, steps: Iterable[T], trials: Callable[[T, Plan], Iterator[Plan]],
                 cheaper: Callable[[Plan, Plan], bool]) -> Plan:
    """Make ``best`` cheaper one verified step at a time: for each step (in the order
    given: costliest first), the first of its trial plans (made from the current best, and
    verified, one at a time: later ones only if earlier ones fail) that is ``cheaper``
    replaces it. Both prunings (stage plans in the search, tiled plans here) are this."""
    for step in steps:
        for candidate in trials(step, best):
            if cheaper(candidate, best):
                best = candidate
                break
    return best

"""The search that turns a strategy's decisions into a verified plan under the budget.

Pure: it never imports torch. What it needs of the torch side comes in a
:class:`Problem`: the stage model and cost graph of the profiled step, the budget, and a
*verifier* that measures a candidate :class:`~remat3d.planspec.Plan` (``planning.py``
replays it on the meta device under the tracker; tests pass a fake one).

NOTE [ The budget is a promise ]
  1. The strategy solves on the stage model (``planner/stages.py``), which predicts.
  2. Each plan is then measured by the verifier; that verified peak is what is compared
     with the budget and stored in the plan.
  3. For ``optimal``, the model's budget is a search variable: targets are bisected, each
     plan verified, and the cheapest that fits is pruned one verified step at a time
     (``_Search.seeds``, ``_Search.prune``). The model errs both ways, so when its plan at
     the budget does not fit, targets somewhat above the budget are tried too. If nothing
     fits, tiling layouts are tried (NOTE [ Tiling layouts ] in ``planner/tiling.py``); if
     still nothing fits, or the budget is below the smallest peak any plan reaches, the
     error names the smallest feasible budget (itself verified).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from remat3d.decisions import SELECTIVE_POLICY, Decision
from remat3d.errors import InfeasibleBudgetError
from remat3d.graph import CostGraph
from remat3d.planner.measured import Limits, Measured, Verifier, signature
from remat3d.planner.optimal import min_peak
from remat3d.planner.registry import Decisions, Infeasible, PlannerOptions, get_strategy
from remat3d.planner.stages import KEEP, RECOMPUTE, SELECTIVE, Stage, StageModel
from remat3d.planner.tiled_plans import (
    extra_cost,
    first_fitting_layout,
    greedy_prune,
    hand_rebuilt_inputs,
    prune_tiled,
    staged_regions,
    stash_where_room,
    store_tiled_outputs,
    untile_where_room,
    whole_rebuilds_where_room,
)
from remat3d.planner.tiling import (
    extend_layout,
    layouts,
    stage_at,
    stage_norms,
    stage_producers,
    stage_readers,
    storing_saves,
)
from remat3d.planspec import Plan, Region
from remat3d.units import format_bytes, format_shape

__all__ = ["Problem", "decision_regions", "extra_cost", "search", "smallest_feasible_phrase"]

_ROUNDS = 8  # bisection steps per search


@dataclass
class Problem:
    """One planning problem: everything the search reads."""

    stages: StageModel
    graph: CostGraph
    budget: int
    strategy: str
    options: PlannerOptions
    # the fields every plan made shares (model, fingerprint, shapes, amp, budget, strategy,
    # host budget); its regions and measurements are ignored
    header: Plan
    step_flops: int       # the unplanned step's FLOPs
    unplanned_peak: int
    verify: Verifier | None = None   # None: plans are predicted, not measured
    # which stages may run tiled (asked only when no other plan fits); None: no tiling
    tileable: Callable[[], list[bool]] | None = None
    # a lower bound on the peak of every plan without tiling (the recompute floor, less
    # its slack: ``planning.py`` NOTE [ Which plan optimal chooses ] rule 2); above the
    # budget, ``optimal`` with tiling tries tiling first and measures untiled plans only
    # for the error's smallest peak
    untiled_floor: int = 0
    # the smallest peak another search of the same step verified (``planning.py``: the
    # spans' search before the modules'); what this one finds for the error matters only
    # below it: its layouts are measured for the error only until they pass it, and its
    # untiled plans not at all where the untiled floor is at or above it
    known_smallest: int = 1 << 62
    # the verifier's measurements by plan ``signature``: given, shared with the other
    # searches of the same step (``planning.py``: the tiled phase does not measure again
    # what the untiled one did)
    measured: dict[str, Measured] = field(default_factory=dict)


def search(problem: Problem) -> Plan:
    """The cheapest plan the strategy reaches under ``problem.budget``; raises
    :class:`InfeasibleBudgetError` naming the smallest feasible budget."""
    return _Search(problem).run()


def decision_regions(model: StageModel, result: Decisions) -> list[Region]:
    """A strategy's decisions as plan regions (kept stages have none)."""
    regions = [Region(name, calls=[call]) for name, call in result.containers]
    regions += [Region(name, calls=[call], segment=list(children))
                for name, call, children in result.segments]
    for s, (stage, decision) in enumerate(zip(model.stages, result.decisions)):
        if decision == KEEP:
            continue
        policy = result.policies.get(s)
        if decision == SELECTIVE:
            decision, policy = RECOMPUTE, SELECTIVE_POLICY
        regions.append(Region(stage.name, calls=[stage.call_index], decision=decision,
                              policy=policy))
    return regions


def smallest_feasible_phrase(smallest: int) -> str:
    """How an infeasible-budget error names its smallest feasible budget (one wording: a
    caller that names a lower one replaces this phrase)."""
    return f"the smallest feasible budget is {format_bytes(smallest)} ({smallest} bytes)"


class _Search:
    def __init__(self, problem: Problem) -> None:
        self.p = problem
        self.stages = problem.stages
        self.budget = problem.budget
        self.solver = get_strategy(problem.strategy)

    # -- one candidate --------------------------------------------------------------
    def measure(self, candidate: Plan, within: Limits | None = None) -> Measured:
        """The verifier's measurement, once per distinct plan (searches revisit plans),
        stopped ``within`` limits where given (one stopped at a limit is measured again
        where it does not answer a later request)."""
        assert self.p.verify is not None
        key = signature(candidate)
        known = self.p.measured.get(key)
        if known is None or not known.answers(within):
            known = self.p.measured[key] = self.p.verify(candidate, within)
        return known

    def check(self, candidate: Plan, within: Limits | None = None) -> Plan:
        """``candidate`` with its verified numbers filled in; measured only until it
        passes one of the limits ``within``, if given (then its peak and extra FLOPs are
        lower bounds: enough to reject it)."""
        m = self.measure(candidate, within)
        if m.peak_bytes > self.budget and candidate.offloads:
            # NOTE [ Offload paths ]: without the prefetch the copies back are not hidden,
            # but the previous region's tensors are not held early either
            candidate.prefetch = False
            late = self.measure(candidate, within)
            if late.peak_bytes < m.peak_bytes:
                m = late
            else:
                candidate.prefetch = True
        candidate.verified_peak_bytes, candidate.recompute_flops = m.peak_bytes, m.recompute_flops
        candidate.verified_host_bytes = m.host_bytes or None
        candidate.verified_peak_module = m.peak_module
        candidate.verified_peak_phase = m.peak_phase
        candidate.verified_tiled_peaks = {k: dict(v) for k, v in m.tiled_peaks.items()}
        candidate.extra_flops = m.flops - self.p.step_flops
        candidate.step_flops = self.p.step_flops
        return candidate

    def build(self, result: Decisions, within: Limits | None = None) -> Plan:
        """``result`` as a plan, verified (only until it passes the limits ``within``)
        where the search verifies."""
        candidate = self.fresh(regions=decision_regions(self.stages, result),
                               predicted_peak_bytes=self.stages.peak(result.decisions))
        if self.p.verify is not None:
            return self.check(candidate, within)
        candidate.recompute_flops = self.stages.recompute_flops(result.decisions)
        return candidate

    def fresh(self, regions: list[Region], **fields: object) -> Plan:
        """A new plan with the header's fields (its own lists: plans are the caller's)."""
        header = self.p.header
        return dataclasses.replace(header, regions=regions, notes=[],
                                   input_shapes=[list(s) for s in header.input_shapes],
                                   **fields)  # type: ignore[arg-type]

    def make(self, target: int) -> Plan | None:
        try:
            return self.build(self.solver(self.stages, target, self.p.options))
        except Infeasible:
            return None

    def fits(self, candidate: Plan | None) -> bool:
        return candidate is not None and (candidate.verified_peak_bytes or 0) <= self.budget

    # -- the search -------------------------------------------------------------------
    def run(self) -> Plan:
        return self.lean(self.choose())

    def lean(self, chosen: Plan) -> Plan:
        """``chosen`` without rebuilt saved tensors if it fits the budget without them.

        NOTE [ Rebuilding only where it pays ]
          Rebuilding saved tensors from cheap ops (``runtime/rebuild.py``) lowers the
          peak at no FLOPs, but it watches every op outside the regions (Python code per
          op) and replays the cheap ones in backward: wall time. Candidates are verified
          with it; the chosen plan is verified once more without, and goes without when
          that still fits (every-block plans mostly do: almost nothing is saved outside
          their regions). The verified peak is the one of the plan as returned.
        """
        if self.p.verify is None or not chosen.rebuild_saved:
            return chosen
        lean = self.check(dataclasses.replace(chosen, rebuild_saved=False,
                                              regions=list(chosen.regions)))
        return lean if (lean.verified_peak_bytes or 0) <= self.budget else chosen

    def choose(self) -> Plan:
        if self.p.strategy != "optimal":
            chosen = self.make(self.budget)
            if chosen is not None:
                return chosen
            raise self.infeasible(self.smallest_feasible())
        verify = self.p.verify is not None
        tiles = verify and self.p.tileable is not None
        untiled = not tiles or self.p.untiled_floor <= self.budget
        seeds = self.seeds() if untiled else []
        if verify:
            seeds = [self.prune(seed) for seed in seeds]
        if seeds:
            return min(seeds, key=lambda p: p.recompute_flops or 0)
        smallest = self.smallest_feasible() if untiled else 1 << 62
        if tiles:
            # below every plan of keep / recompute / offload decisions: tile
            ok = self.p.tileable()
            norms = stage_norms(self.p.graph, self.stages)
            readers = stage_readers(self.p.graph, self.stages)
            offload = self.p.options.offload

            def first_fitting(smallest_only: bool) -> tuple[Plan | None, int]:
                return first_fitting_layout(
                    layouts(self.p.graph, self.stages, ok, host=offload),
                    self.stages, self.p.options, self.p.header.host_budget_bytes,
                    self.budget, self.fresh, self.check,
                    extend=lambda layout, module: extend_layout(
                        self.p.graph, self.stages, ok, layout, module),
                    # NOTE [ Tiling layouts ] rule 10: with offload, runs stash on the host
                    stash="host" if offload else None, readers=readers,
                    smallest_only=smallest_only, below=self.p.known_smallest)

            tiled, tiled_smallest = first_fitting(False)
            if tiled is None:  # every layout stopped at the budget: the smallest, for the error
                tiled, tiled_smallest = first_fitting(True)
            smallest = min(smallest, tiled_smallest)
            if tiled is not None:
                saves = storing_saves(self.p.graph, self.stages, {
                    st.index for r, st in staged_regions(tiled, self.stages)
                    if r.decision == Decision.TILE})
                # NOTE [ Tiling layouts ] rules 8, 9 and 4: the room the layout left
                tiled = store_tiled_outputs(
                    tiled, self.budget, self.stages, self.check, saves, readers,
                    stage_producers(self.p.graph, self.stages),
                    lambda module: stage_at(self.p.graph, self.stages, module))
                tiled = untile_where_room(tiled, self.budget, self.stages, self.check,
                                          norms, readers, self.p.options.recomputable)
                tiled = stash_where_room(tiled, self.budget, self.stages, self.check, norms,
                                         readers)
                tiled = whole_rebuilds_where_room(tiled, self.budget, self.stages,
                                                  self.check, readers)
                tiled = hand_rebuilt_inputs(tiled, self.budget, self.stages, self.check,
                                            readers)
                return prune_tiled(tiled, self.budget, self.stages, self.check)
            if not untiled and self.p.untiled_floor < min(smallest, self.p.known_smallest):
                # below the untiled floor: their smallest, for the error only, where it
                # may be the lowest
                smallest = min(smallest, self.smallest_feasible())
        raise self.infeasible(min(smallest, self.p.known_smallest))

    def infeasible(self, smallest: int) -> InfeasibleBudgetError:
        h, offload = self.p.header, self.p.options.offload
        host = h.host_budget_bytes
        return InfeasibleBudgetError(
            f"Budget {format_bytes(self.budget)} is infeasible for {h.model} "
            f"{' '.join(format_shape(s) for s in h.input_shapes)} "
            f"(amp={h.amp or 'none'}{', offload' if offload else ''}"
            f"{'' if host is None else ', host memory ' + format_bytes(host)}"
            f"): {smallest_feasible_phrase(smallest)}; the "
            f"unplanned peak is {format_bytes(self.p.unplanned_peak)}."
            + ("" if offload else " Allowing offload (offload=True) may lower it.")
            + ("" if self.p.tileable is not None
               else " Allowing tiling (tile=True; --tile) may lower it.")
            + ("" if host is None or not offload
               else " A larger host budget (host_budget) may lower it."),
            smallest_feasible_bytes=smallest, unplanned_peak_bytes=self.p.unplanned_peak,
        )

    def seeds(self) -> list[Plan]:
        """The plans that ``prune`` starts from: the cheapest verified plans under the
        budget (NOTE rule 3), at most two, cheapest first; empty when none fits.

        The model's targets are searched by bisection between the most frugal plan's
        predicted peak and the unplanned one: a larger target allows less recomputation,
        and each candidate is verified; the cheapest one that fits wins. When the model's
        plan at the budget itself does not fit, a second bisection also tries targets up
        to 1/8 above the budget: the model errs both ways, and such a target can verify
        under the budget with less recomputation. Its winner is pruned too, beside the
        first bisection's, because pruning can end cheaper from either.
        """
        budget, stages, options = self.budget, self.stages, self.p.options
        verify = self.p.verify is not None
        first = self.make(budget)
        unplanned = max(stages.unplanned_peak, stages.peak([KEEP] * len(stages.stages))) + 1
        if first is not None and (not verify or self.fits(first)):
            if not first.regions:
                return [first]
            # fits at the real budget: try looser targets only
            seeds = [self.bisect(first, budget, unplanned)]
        else:
            frugal = min_peak(stages, offload=options.offload,
                              recomputable=options.recomputable, costs=options.costs)[0]
            seeds = [self.bisect(None, frugal, budget)]
            if verify:
                seeds.append(self.bisect(None, frugal, budget + budget // 8))
        others: list[Plan] = []
        if verify:
            others += self.chain_trees()
        # the fixed strategies and the most frugal plans compete too: optimal never costs
        # more than any of them at a budget they keep
        others += [p for p in self.candidates() if self.fits(p)]
        found: list[Plan] = []
        for seed in seeds:
            best = seed
            for other in others:
                if best is None or (other.recompute_flops or 0) < (best.recompute_flops or 0):
                    best = other
            if best is not None and all(best is not f for f in found):
                found.append(best)
        return sorted(found, key=lambda p: p.recompute_flops or 0)

    def chain_trees(self) -> list[Plan]:
        """The chain dynamic program's region trees (nested regions, which the MILP does
        not choose) that fit: its model is approximate, so its target moves by the
        verified error, three times at most."""
        found, target = [], self.budget
        for _ in range(3):
            tree = self.build(get_strategy("recursive")(self.stages, target, self.p.options))
            peak = tree.verified_peak_bytes or 0
            if peak <= self.budget:
                found.append(tree)
            if abs(self.budget - peak) <= max(1, self.budget // 1000):
                break
            target += self.budget - peak
        return found

    def bisect(self, best: Plan | None, low: int, high: int) -> Plan | None:
        """The cheapest plan under the budget among the model's plans at targets bisected
        between ``low`` and ``high`` (a target whose plan fits raises ``low``)."""
        for _ in range(_ROUNDS):
            if high - low <= max(1, self.budget // 1000):
                break
            mid = (low + high) // 2
            candidate = self.make(mid)
            if candidate is None:
                low = mid
                continue
            if self.fits(candidate):
                if best is None or (candidate.recompute_flops or 0) <= (best.recompute_flops or 0):
                    best = candidate
                low = mid
            else:
                high = mid
        return best

    def candidates(self) -> list[Plan]:
        """Plans every budget search also considers: no region at all (what rebuilding
        saved tensors alone reaches), the model's most frugal one, every stage, every
        stage inside nested regions on every container (the deepest recomputation), and
        the fixed strategies (blocks, uniform, sqrt, balanced, recursive)."""
        stages, options = self.stages, self.p.options
        plans = [self.build(Decisions([KEEP] * len(stages.stages)))]
        frugal = self.make(min_peak(stages, offload=options.offload,
                                    recomputable=options.recomputable,
                                    costs=options.costs)[0])
        if frugal is not None:
            plans.append(frugal)
        ok = options.recomputable or [True] * len(stages.stages)
        every = [RECOMPUTE if ok[st.index] else KEEP for st in stages.stages]
        plans.append(self.build(Decisions(every)))
        nested = [(name, call) for name, call, covered in stages.containers
                  if all(ok[i] for i in covered)]
        if nested:
            plans.append(self.build(Decisions(every, containers=nested)))
        for name in ("blocks", "uniform", "sqrt", "balanced", "recursive"):
            plans.append(self.build(get_strategy(name)(stages, None, options)))
        return plans

    def smallest_feasible(self) -> int:
        """The smallest peak among the plans every search considers (each distinct plan is
        measured once, so the search's candidates are not measured again)."""
        return min(p.verified_peak_bytes if p.verified_peak_bytes is not None
                   else (p.predicted_peak_bytes or 0) for p in self.candidates())

    # -- pruning ----------------------------------------------------------------------
    def prune(self, best: Plan) -> Plan:
        """Make the plan cheaper one verified step at a time, costliest region first.

        The stage model is conservative, so the solver's plan may recompute more than
        needed. Each region is first dropped, else downgraded from a full recompute to a
        selective one (keeping its convolution outputs); a step is taken only if the
        verified peak still fits and the recomputed FLOPs do not grow. Regions on
        containers and segments (nested plans) stay. A trial is measured only until its
        peak passes the budget (NOTE [ Bounded measurements ]: it is rejected then).
        """
        within = Limits(self.budget, None)
        by_name = {(st.name, st.call_index): st for st in self.stages.stages}
        decisions = self._parse(best, by_name)[0]
        order = sorted(decisions, key=lambda k: -by_name[k].fwd_flops
                       if decisions[k] == RECOMPUTE else -by_name[k].saved_bytes)

        def trials(key: tuple[str, int], current: Plan) -> Iterator[Plan]:
            now, containers, segments = self._parse(current, by_name)
            if key not in now:
                return
            for trial in ({k: v for k, v in now.items() if k != key},
                          {**now, key: SELECTIVE} if now[key] == RECOMPUTE else None):
                if trial is not None:
                    yield self.build(Decisions(
                        [trial.get((st.name, st.call_index), KEEP) for st in self.stages.stages],
                        containers=containers, segments=segments), within)

        def cheaper(candidate: Plan, current: Plan) -> bool:
            return self.fits(candidate) and \
                (candidate.recompute_flops or 0) <= (current.recompute_flops or 0)

        return greedy_prune(best, order, trials, cheaper)

    @staticmethod
    def _parse(plan: Plan, by_name: dict[tuple[str, int], Stage]
               ) -> tuple[dict[tuple[str, int], Decision], list[tuple[str, int]],
                          list[tuple[str, int, list[str]]]]:
        """A plan's regions back as stage decisions, containers and segments."""
        decisions: dict[tuple[str, int], Decision] = {}
        containers: list[tuple[str, int]] = []
        segments: list[tuple[str, int, list[str]]] = []
        for r in plan.regions:
            key = (r.module, (r.calls or [0])[0])
            if r.segment:
                segments.append((r.module, key[1], list(r.segment)))
            elif key not in by_name:
                containers.append(key)
            else:
                decisions[key] = SELECTIVE if r.policy == SELECTIVE_POLICY else Decision(r.decision)
        return decisions, containers, segments

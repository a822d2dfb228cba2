"""The plan search (planner/searching.py) against a fake verifier: pure Python, milliseconds.

The fake verifier measures a plan by the stage model's own prediction, off by a chosen
error, so the search's promises can be checked on many synthetic models: what it returns
is measured under the budget, costs no more than any fixed strategy that fits, and an
infeasible budget names a budget that is feasible.
"""

from __future__ import annotations

import random

import pytest

from remat3d.errors import InfeasibleBudgetError, Remat3dError
from remat3d.graph import CostGraph
from remat3d.planner.measured import Limits, Measured
from remat3d.planner.registry import PlannerOptions, get_strategy
from remat3d.planner.searching import Problem, decision_regions, search
from remat3d.planner.stages import KEEP, OFFLOAD, RECOMPUTE, SELECTIVE, StageModel
from remat3d.planspec import Plan
from tests.planner.test_optimal import random_model


def _decisions(model: StageModel, plan: Plan) -> list[str]:
    by_name = {st.name: st.index for st in model.stages}
    decisions = [KEEP] * len(model.stages)
    for r in plan.regions:
        if r.module in by_name:
            decisions[by_name[r.module]] = (
                SELECTIVE if r.policy == "save-compute-heavy"
                else OFFLOAD if r.decision == "offload" else RECOMPUTE)
    return decisions


def fake_verifier(model: StageModel, error: float = 0.0, calls: list[int] | None = None):
    """The stage model's prediction times ``1 + error``, as a verifier would measure it."""
    def verify(plan: Plan, within: object = None) -> Measured:
        if calls is not None:
            calls.append(1)
        decisions = _decisions(model, plan)
        peak = int(model.peak(decisions) * (1 + error))
        recompute = model.recompute_flops(decisions)
        return Measured(peak, recompute, 1000 + recompute, 0)

    return verify


def _problem(model: StageModel, budget: int, **kw) -> Problem:  # type: ignore[no-untyped-def]
    return Problem(stages=model, graph=CostGraph(nodes=[], edges=[]), budget=budget,
                   strategy=kw.pop("strategy", "optimal"), options=PlannerOptions(),
                   header=Plan(model="Synthetic", input_shapes=[[1, 1, 8, 8, 8]],
                               budget_bytes=budget),
                   step_flops=1000, unplanned_peak=model.peak([KEEP] * len(model.stages)),
                   **kw)


@pytest.mark.parametrize("error", [0.0, 0.08, -0.05])
@pytest.mark.parametrize("seed", range(12))
def test_search_keeps_the_budget_and_beats_every_fixed_strategy(seed: int, error: float):
    rng = random.Random(seed)
    model = random_model(rng, rng.randint(2, 6))
    model.unplanned_peak = model.peak([KEEP] * len(model.stages))
    verify = fake_verifier(model, error)
    low = int(min(model.peak(d) for d in ([RECOMPUTE] * len(model.stages),
                                           [SELECTIVE] * len(model.stages))) * (1 + error))
    for budget in (low + 1, (low + model.unplanned_peak) // 2, model.unplanned_peak * 2):
        try:
            plan = search(_problem(model, budget, verify=verify))
        except InfeasibleBudgetError as exc:
            # the promise of the error: the budget it names is feasible
            assert exc.smallest_feasible_bytes > budget
            again = search(_problem(model, exc.smallest_feasible_bytes, verify=verify))
            assert again.verified_peak_bytes <= exc.smallest_feasible_bytes
            continue
        assert plan.verified_peak_bytes is not None and plan.verified_peak_bytes <= budget
        assert plan.budget_bytes == budget and plan.model == "Synthetic"
        for name in ("blocks", "uniform", "sqrt", "balanced"):
            fixed = Plan(regions=decision_regions(model, get_strategy(name)(
                model, None, PlannerOptions())))
            measured = verify(fixed)
            if measured.peak_bytes <= budget:
                assert plan.recompute_flops <= measured.recompute_flops, name


def test_each_distinct_plan_is_verified_once():
    """Searches revisit plans (bisection, candidates, pruning); a verification at 512³
    takes tens of seconds, so each distinct plan is measured once."""
    model = random_model(random.Random(3), 5)
    model.unplanned_peak = model.peak([KEEP] * 5)
    inner = fake_verifier(model)
    seen: list[tuple] = []

    def verify(plan: Plan, within: object = None) -> Measured:
        seen.append((plan.prefetch, plan.rebuild_saved,
                     *((r.module, r.decision, str(r.policy)) for r in plan.regions)))
        return inner(plan)

    search(_problem(model, model.unplanned_peak, verify=verify))
    assert seen and len(seen) == len(set(seen))


@pytest.mark.parametrize("without", [0, 10**12])
def test_the_plan_goes_without_rebuilding_only_where_it_fits_without(without: int):
    """NOTE [ Rebuilding only where it pays ]: rebuilding costs wall time per op."""
    model = random_model(random.Random(4), 5)
    model.unplanned_peak = model.peak([KEEP] * 5)
    inner = fake_verifier(model)

    def verify(plan: Plan, within: object = None) -> Measured:
        m = inner(plan)
        return m._replace(peak_bytes=m.peak_bytes + (0 if plan.rebuild_saved else without))

    budget = (model.unplanned_peak * 9) // 10
    chosen = search(_problem(model, budget, verify=verify))
    assert chosen.rebuild_saved is (without > 0)
    assert chosen.verified_peak_bytes is not None and chosen.verified_peak_bytes <= budget


def test_the_plan_with_no_region_competes():
    """Rebuilding saved tensors alone may reach a budget: then nothing is recomputed."""
    model = random_model(random.Random(6), 5)
    model.unplanned_peak = model.peak([KEEP] * 5)
    inner = fake_verifier(model)

    def verify(plan: Plan, within: object = None) -> Measured:  # what keeps everything measures low
        m = inner(plan)
        return m._replace(peak_bytes=1) if not plan.regions else m

    chosen = search(_problem(model, model.unplanned_peak // 2, verify=verify))
    assert chosen.regions == [] and not chosen.recompute_flops


def test_infeasible_budget_names_the_smallest_and_says_what_may_lower_it():
    model = random_model(random.Random(5), 4)
    model.unplanned_peak = model.peak([KEEP] * 4)
    with pytest.raises(InfeasibleBudgetError, match="Allowing offload") as info:
        search(_problem(model, 1, verify=fake_verifier(model)))
    assert "tile=True" in str(info.value)  # no tileable list: tiling was not allowed
    assert info.value.unplanned_peak_bytes == model.unplanned_peak
    assert "Synthetic 1x1x8x8x8" in str(info.value)


def test_without_a_verifier_plans_are_predictions():
    model = random_model(random.Random(7), 4)
    model.unplanned_peak = model.peak([KEEP] * 4)
    plan = search(_problem(model, model.unplanned_peak, verify=None))
    assert plan.verified_peak_bytes is None
    assert plan.predicted_peak_bytes is not None and plan.recompute_flops is not None


def test_fixed_strategies_return_their_plan_and_unknown_names_are_refused():
    model = random_model(random.Random(9), 4)
    model.unplanned_peak = model.peak([KEEP] * 4)
    plan = search(_problem(model, model.unplanned_peak * 10, strategy="blocks",
                           verify=fake_verifier(model)))
    assert plan.strategy == "manual"  # the header's: the caller names the strategy there
    with pytest.raises(Remat3dError, match="Unknown strategy"):
        search(_problem(model, 1, strategy="nope", verify=fake_verifier(model)))


def test_pruning_trials_are_measured_only_until_they_pass_the_budget():
    """NOTE [ Bounded measurements ]: a pruning trial whose peak passes the budget is
    rejected, so its measurement stops there; the plan chosen is the one measuring every
    trial whole gives."""
    model = random_model(random.Random(7), 6)
    model.unplanned_peak = model.peak([KEEP] * 6)
    inner = fake_verifier(model)
    asked: list[Limits | None] = []

    def bounded(plan: Plan, within: Limits | None = None) -> Measured:
        m = inner(plan)
        asked.append(within)
        if within is not None and within.peak_bytes is not None \
                and m.peak_bytes > within.peak_bytes:
            return Measured(within.peak_bytes + 1, 0, 0, 0, complete=False)
        return m

    with pytest.raises(InfeasibleBudgetError) as info:
        search(_problem(model, 1, verify=inner))
    budget = (info.value.smallest_feasible_bytes + model.unplanned_peak) // 2
    whole = search(_problem(model, budget, verify=lambda plan, within=None: inner(plan)))
    chosen = search(_problem(model, budget, verify=bounded))
    assert chosen.regions == whole.regions
    assert chosen.verified_peak_bytes == whole.verified_peak_bytes <= budget
    stopped = [w for w in asked if w is not None]
    assert stopped and all(w.peak_bytes == budget for w in stopped)

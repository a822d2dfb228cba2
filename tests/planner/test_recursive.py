"""``recursive``: the chain dynamic program as nested regions the executor runs."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

import remat3d
from remat3d.planner.chain import revolve_closed_form, solve_chain
from remat3d.planner.recursive import expressible_ranges, recursive_tree, stage_chain
from remat3d.planner.registry import PlannerOptions, get_strategy
from remat3d.planner.searching import decision_regions
from remat3d.planner.stages import KEEP, Stage, StageModel, build_stages
from remat3d.planspec import Plan
from tests.runtime.exactness import assert_exact


def chain_model(n: int, rng: random.Random | None = None, sequential: bool = True,
                containers: list[tuple[int, int]] = ()) -> StageModel:
    """``n`` stages in a row; children of one nn.Sequential, or (``sequential=False``) of
    a module tree whose only multi-stage modules are ``containers`` (U-Net-like)."""
    rng = rng or random.Random(0)
    stages = [Stage(index=i, node=i, name=f"s{i}", call_index=0,
                    saved_bytes=rng.randint(20, 60), input_bytes=rng.randint(5, 20),
                    output_bytes=10, fwd_flops=rng.randint(100, 1000), fwd_delta=30,
                    bwd_delta=30, param_bytes=0, is_block=True) for i in range(n)]
    return StageModel(
        stages=stages, base=0, glue_saved=[0] * n, pending=[0] * n, grads_after=[0] * n,
        containers=[(f"c{a}_{b}", 0, list(range(a, b))) for a, b in containers],
        sequences=[("", 0, [(str(i), [i]) for i in range(n)])] if sequential else [],
    )


@pytest.mark.parametrize("n", [5, 8, 13, 20])
def test_without_budget_it_is_revolves_binomial_schedule(n):
    model = chain_model(n)
    tree = recursive_tree(model, None, [True] * n)
    slots = math.ceil(math.log2(n))
    assert tree.schedule.recompute == revolve_closed_form(n, slots)
    # multi-stage regions are segments of the Sequential, and regions nest
    spans = [(int(c[0]), int(c[-1]) + 1) for _, _, c in tree.segments]
    spans += [(i, i + 1) for i, d in enumerate(tree.decisions) if d != KEEP]
    assert tree.segments and any(a <= c and d <= b and (a, b) != (c, d)
                         for a, b in spans for c, d in spans)


def test_with_a_budget_on_a_sequential_it_is_the_unrestricted_optimum():
    rng = random.Random(3)
    model = chain_model(9, rng)
    chain = stage_chain(model, PlannerOptions().costs)
    everything = sum(chain.x) + sum(chain.tape) + 200
    for budget in range(40, everything, 17):
        tree = recursive_tree(model, budget, [True] * 9)
        free = solve_chain(chain, budget)  # exact sizes: 500 slots is finer than 1 byte here
        assert (tree is None) == (free is None)
        if tree is not None:
            assert tree.schedule.cost == pytest.approx(free.cost)


def test_on_a_unet_tree_only_expressible_regions_are_used_and_that_can_cost_more():
    model = chain_model(7, random.Random(5), sequential=False,
                        containers=[(0, 7), (1, 6), (2, 5)])
    ranges = expressible_ranges(model, [True] * 7)
    assert set(ranges) == {(i, i + 1) for i in range(7)} | {(0, 7), (1, 6), (2, 5)}
    chain = stage_chain(model, PlannerOptions().costs)
    worse = 0
    for budget in range(60, 400, 10):
        tree = recursive_tree(model, budget, [True] * 7)
        free = solve_chain(chain, budget)
        if tree is None:
            continue
        assert set(tree.schedule.regions) <= set(ranges)
        assert tree.schedule.cost >= free.cost - 1e-9
        worse += tree.schedule.cost > free.cost + 1e-9
    assert worse > 0  # the approximation is strictly worse at some budgets


def _net(n: int) -> nn.Sequential:
    torch.manual_seed(0)
    # each block ends with an op that saves its output, so a recomputation early-stopped
    # at a block's saved tensors still runs the whole block (see docs/planner.md)
    return nn.Sequential(*[nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), nn.Conv3d(2, 2, 1),
                                         nn.Tanh()) for _ in range(n)])


def test_binomial_plan_runs_exactly_and_costs_what_the_dp_says():
    n, shape = 8, (1, 2, 6, 6, 6)
    net = _net(n)
    stages = build_stages(remat3d.profile(net, shape).graph)
    assert len(stages.stages) == n
    decided = get_strategy("recursive")(stages, None, PlannerOptions())
    plan = Plan(regions=decision_regions(stages, decided))
    assert any(r.segment for r in plan.regions)
    report = assert_exact(net, torch.randn(shape), plan)
    assert report is not None
    # every block has the same FLOPs: recomputed FLOPs = DP recompute steps x block FLOPs
    tree = recursive_tree(stages, None, [True] * n)
    remat3d.apply(net, plan)
    try:
        measured = remat3d.measure(net, shape, device="meta")
    finally:
        remat3d.remove(net)
    per_block = stages.stages[0].fwd_flops
    assert measured.recompute_flops == tree.schedule.recompute * per_block
    assert [d for d in decided.decisions if d != KEEP]


def test_recursive_plan_with_a_budget_verifies():
    n, shape = 10, (1, 2, 8, 8, 8)
    net = _net(n)
    unplanned = remat3d.profile(net, shape)
    p = remat3d.plan(net, shape, budget=int(unplanned.peak_bytes * 0.6), strategy="recursive")
    assert p.verified_peak_bytes < unplanned.peak_bytes
    assert p.recompute_flops > 0


def test_nested_segments_of_one_sequential_run_exactly_and_crossing_ones_are_refused():
    from remat3d.planspec import PlanError, Region

    net = _net(8)
    x = torch.randn(1, 2, 6, 6, 6)
    seg = [str(i) for i in range(8)]
    nested = Plan(regions=[Region("", segment=seg[0:6]), Region("", segment=seg[0:3]),
                           Region("", segment=seg[3:5])])
    report = assert_exact(net, x, nested)
    assert sorted(r.recomputes for r in report.regions) == [1, 1, 1]
    crossing = Plan(regions=[Region("", segment=seg[0:4]), Region("", segment=seg[2:6])])
    remat3d.apply(net, crossing)
    try:
        with pytest.raises(PlanError, match="must nest"):
            net(x)
    finally:
        remat3d.remove(net)

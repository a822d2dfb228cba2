"""Tiling layouts (planner/tiling.py) and ``optimal`` choosing tiles below the
recomputation floor (planning._tiled)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from collections.abc import Callable

import pytest
import torch

import remat3d
from remat3d.errors import InfeasibleBudgetError
from remat3d.instrument.step import meta_copy
from remat3d.planner.measured import Limits
from remat3d.planner.registry import PlannerOptions
from remat3d.planner.stages import Stage, StageModel, build_stages
from remat3d.planner.tiled_plans import at_least_as_frugal, first_fitting_layout
from remat3d.planner.tiling import Layout, _facts, layouts, stage_levels, stage_readers
from remat3d.planspec import Plan, Region
from remat3d.profiling import profile
from tests.tiling.test_fused import TinyUNet, _step, assert_same_step

SHAPE = (1, 1, 32, 32, 32)


@pytest.fixture(scope="module")
def graph_and_stages():  # type: ignore[no-untyped-def]
    prof = profile(TinyUNet(), SHAPE, device="meta")
    return prof.graph, build_stages(prof.graph)


def test_levels_and_readers(graph_and_stages) -> None:  # type: ignore[no-untyped-def]
    graph, stages = graph_and_stages
    names = [s.name for s in stages.stages]
    level = dict(zip(names, stage_levels(graph, stages)))
    # the encoder stage reads the full-resolution skip: level 0 like the stem and decoder
    assert level["stem"] == level["down"] == level["up"] == level["head"] == 0
    assert level["inner"] == 1
    readers = stage_readers(graph, stages)
    index = {n: i for i, n in enumerate(names)}
    assert readers[index["up"]] == {index["head"]}
    assert readers[index["head"]] == {None}  # read by the loss only
    assert index["up"] in readers[index["stem"]]


def test_layouts_fuse_what_only_tiled_stages_read(graph_and_stages) -> None:  # type: ignore[no-untyped-def]
    graph, stages = graph_and_stages
    names = [s.name for s in stages.stages]
    everything = layouts(graph, stages, [True] * len(names), tiles=(16,), max_depth=2)
    keys = [tuple(sorted(lay.tiled.items())) for lay in everything]
    assert len(keys) == len(set(keys))  # no layout twice
    assert all("host" not in lay.fuse for lay in everything)  # host memory only when asked
    by = {(lay.depth, lay.fuse): lay for lay in everything}
    fused = {mode: {names[s] for s, (_t, out) in lay.tiled.items() if out == "fused"}
             for (depth, mode), lay in by.items() if depth == 1}
    assert fused["none"] == set()
    assert fused["chain"] == {"up"}  # the decoder stage feeds the head only
    assert "head" not in fused["all"] and "up" in fused["all"]
    # two levels: "chain" fuses a stage into its one reader only where that run gains no
    # normalisation pass: "down" into "inner" (none), "up" into the head; not "inner"
    # into "up" (its convolutions would run again in the pass of up's normalisation)
    two = {names[s] for s, (_t, out) in by[(2, "chain")].tiled.items() if out == "fused"}
    assert two == {"down", "up"}
    # with host memory allowed: "host" keeps every output that only tiled stages read
    # (the skip, read by the encoder's "down" and the decoder's "up"; the decoder's output,
    # read by the head) in host memory; "chain+host" fuses the chain and keeps the rest
    # there; "chain+rebuild" likewise rebuilds them in each reader's backward ("rebuild",
    # which would not fuse "up" into the head, is not made where that one does). In a
    # level: none, host, chain, chain+host, chain+rebuild; full fusion ("all",
    # recomputing the skip in both readers) after every other layout of every level.
    with_host = layouts(graph, stages, [True] * len(names), tiles=(16,), host=True)
    order = [lay.fuse for lay in with_host if lay.depth == 1]
    assert order == ["none", "host", "chain", "chain+host", "chain+rebuild", "all"]
    first_all = [lay.fuse for lay in with_host].index("all")
    assert all(lay.fuse == "all" for lay in with_host[first_all:])
    assert {lay.depth for lay in with_host[:first_all]} == {1, 2}
    outputs = {lay.fuse: {names[s]: out for s, (_t, out) in lay.tiled.items()}
               for lay in with_host if lay.depth == 1}
    assert outputs["host"] == {"stem": "host", "down": "device", "up": "host",
                               "head": "device"}
    assert outputs["chain+host"] == {"stem": "host", "down": "device", "up": "fused",
                                     "head": "device"}
    assert outputs["chain+rebuild"] == {"stem": "rebuilt", "down": "device", "up": "fused",
                                        "head": "device"}
    # a stage whose output is at half resolution gets half the tile
    lay = by[(1, "none")]
    assert lay.tiled[names.index("down")][0] == (8, 8, 8)
    assert lay.tiled[names.index("up")][0] == (16, 16, 16)
    # a stage that cannot be tiled is never tiled, and nothing fuses into it
    no_up = layouts(graph, stages, [n != "up" for n in names], tiles=(16,))
    assert all(names.index("up") not in lay.tiled for lay in no_up)


def _smallest_budget(net: TinyUNet, **options: bool) -> int:
    """The smallest budget an infeasible budget's error names."""
    with pytest.raises(InfeasibleBudgetError) as info:
        remat3d.plan(net, SHAPE, budget=1, **options)
    return info.value.smallest_feasible_bytes


def test_optimal_tiles_below_the_recomputation_floor() -> None:
    torch.manual_seed(0)
    net = TinyUNet()
    # every budget below the least peak of keep/recompute plans was infeasible before
    # tiling existed; the error's number now includes tiled layouts
    smallest = _smallest_budget(net)
    plan = remat3d.plan(net, SHAPE, budget=smallest)
    assert any(r.decision == "tile" for r in plan.regions)
    assert plan.verified_peak_bytes is not None and plan.verified_peak_bytes <= smallest
    # where and when the verified peak was (what rule 8 reads of it)
    assert plan.verified_peak_phase in ("forward", "backward")
    with pytest.raises(InfeasibleBudgetError, match="tile=True"):
        remat3d.plan(net, SHAPE, budget=smallest, tile=False)  # the caller said no
    untiled_floor = remat3d.plan(net, SHAPE, budget="1x")  # no tiling needed
    assert not any(r.decision == "tile" for r in untiled_floor.regions)
    assert "tiling layout" in plan.notes[0] and plan.extra_flops and plan.extra_flops > 0
    # the plan is exact on the real model (checked in float64: no rounding noise)
    net = net.double()
    tiled = copy.deepcopy(net)
    remat3d.apply(tiled, plan)
    x = torch.randn(SHAPE, dtype=torch.float64)
    assert_same_step(_step(net, x), _step(tiled, x), 1e-12)


def test_below_the_recompute_floor_tiling_is_searched_first(caplog) -> None:  # type: ignore[no-untyped-def]
    """``planning.py`` NOTE [ Which plan optimal chooses ] rule 2: no plan without tiling,
    offload or not, peaks below the recompute floor; a budget under it goes to tiling at
    once, and the untiled searches run only for an error's smallest peak."""
    from remat3d.capture.joint import capture
    from remat3d.planner.liveness import recompute_floor
    from remat3d.planning import clear_plan_cache

    torch.manual_seed(0)
    net = TinyUNet()
    floor = recompute_floor(capture(net, torch.empty(SHAPE, device="meta")).graph).bytes
    for offload in (False, True):
        assert _smallest_budget(net, tile=False, graph=False, offload=offload) >= floor
    smallest = _smallest_budget(net)
    assert smallest < 0.97 * floor  # what tiling reaches, below the floor less its slack
    clear_plan_cache()  # (another test may have planned this network at that budget)
    with caplog.at_level(logging.INFO, logger="remat3d.planning"):
        plan = remat3d.plan(net, SHAPE, budget=smallest)
    verified = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("verifying a candidate plan")]
    assert verified and all("tiled" in m for m in verified), verified  # none untiled
    assert any(r.decision == "tile" for r in plan.regions)


def test_a_tiled_plan_keeps_the_stages_that_still_fit() -> None:
    """Between the tiled floor and the recompute-only floor, the tiled layout's other
    stages are kept where the verified peak allows (``planning._prune_regions``): the plan
    mixes tile and keep, and costs less than the layout that recomputes them."""
    torch.manual_seed(0)
    net = TinyUNet()
    floors = []
    for tile in (True, False):
        floors.append(_smallest_budget(net, tile=tile))
    # three quarters of the way up from the tiled floor: room for a stage kept whole
    budget = floors[0] + 3 * (floors[1] - floors[0]) // 4
    plan = remat3d.plan(net, SHAPE, budget=budget)
    assert any(r.decision == "tile" for r in plan.regions)
    assert "inner" not in [r.module for r in plan.regions]  # kept: no region
    assert plan.verified_peak_bytes is not None and plan.verified_peak_bytes <= budget
    layout = dataclasses.replace(plan, regions=[*plan.regions, Region("inner")])
    recomputed = remat3d.measure(remat3d.apply(meta_copy(net), layout), SHAPE, device="meta")
    assert plan.extra_flops is not None and plan.step_flops is not None
    assert plan.step_flops + plan.extra_flops < recomputed.flops


# -m slow: 30 s (three tiled searches); host-resident tiled outputs: tests/tiling/test_host.py
@pytest.mark.slow
def test_with_offload_the_skip_goes_to_the_host_instead_of_being_recomputed() -> None:
    """At the smallest budget tiling reaches without host memory (the skip fused into
    both of its readers, recomputed in each), allowing offload keeps the skip in host
    memory instead: the same budget at fewer FLOPs, and the plan says how much host
    memory it holds."""
    torch.manual_seed(0)
    net = TinyUNet()
    smallest = _smallest_budget(net)
    device_only = remat3d.plan(net, SHAPE, budget=smallest)
    hosted = remat3d.plan(net, SHAPE, budget=smallest, offload=True)
    assert "stem" in [r.module for r in hosted.regions if r.host]
    assert hosted.verified_peak_bytes is not None and hosted.verified_peak_bytes <= smallest
    assert hosted.verified_host_bytes and hosted.verified_host_bytes >= 4 * 32**3 * 4
    assert device_only.extra_flops is not None and hosted.extra_flops is not None
    assert hosted.extra_flops < device_only.extra_flops
    assert "output on host" in hosted.summary()
    # a host budget below what that plan holds there: another layout, within both budgets
    cap = hosted.verified_host_bytes - 1
    limited = remat3d.plan(net, SHAPE, budget=smallest, offload=True, host_budget=cap)
    assert (limited.verified_host_bytes or 0) <= cap and limited.host_budget_bytes == cap
    assert limited.verified_peak_bytes is not None and limited.verified_peak_bytes <= smallest
    net = net.double()
    tiled = copy.deepcopy(net)
    remat3d.apply(tiled, hosted)
    x = torch.randn(SHAPE, dtype=torch.float64)
    assert_same_step(_step(net, x), _step(tiled, x), 1e-12)


def test_a_layout_is_passed_over_when_a_more_frugal_one_does_not_fit() -> None:
    """NOTE [ Tiling layouts ] rule 6: before a layout is verified, the most frugal layout
    of its stages (the smallest tiles of its sweep, the most in host memory) is; when it
    does not fit, none it dominates is verified, and the layout chosen is the first in
    cost order that fits and was measured."""
    from remat3d.planner.registry import PlannerOptions
    from remat3d.planner.stages import Stage, StageModel
    from remat3d.planner.tiled_plans import first_fitting_layout
    from remat3d.planner.tiling import Layout
    from remat3d.planspec import Plan

    stages = StageModel(stages=[Stage(i, i, f"s{i}", 0, 0, 0, 0, 0, 0, 0, 0)
                                for i in range(2)],
                        base=0, glue_saved=[0, 0], pending=[0, 0], grads_after=[0, 0])
    edge = (8, 8, 8)

    def lay(tile: int, fuse: str, first: str) -> Layout:
        return Layout(depth=1, fuse=fuse, tile=tile,
                      tiled={0: (edge if tile == 8 else (4, 4, 4), first),
                             1: (edge if tile == 8 else (4, 4, 4), "device")})

    # cost order: tile 8 stored, tile 8 on host, tile 4 stored, tile 4 on host
    order = [lay(8, "none", "device"), lay(8, "host", "host"),
             lay(4, "none", "device"), lay(4, "host", "host")]
    peaks = {(8, "device"): 90, (8, "host"): 70, (4, "device"): 60, (4, "host"): 40}
    verified: list[tuple[int, str]] = []

    def check(plan: Plan, within: Limits | None = None) -> Plan:
        tiled = [r for r in plan.regions if r.decision == "tile"]
        key = (tiled[0].tile[0], "host" if tiled[0].host else "device")
        verified.append(key)
        return _measured(plan, peaks[key], within)

    def fresh(regions: list[Region]) -> Plan:
        return Plan(regions=regions)

    # a budget no layout fits: the most frugal one (tile 4 on the host) is measured
    # once, and every other is passed over unmeasured (each keeps as much or more)
    chosen, smallest = first_fitting_layout(order, stages, PlannerOptions(), None, 30,
                                            fresh, check)
    assert chosen is None and smallest == 1 << 62  # each stopped at the budget
    assert verified == [(4, "host")]
    # the smallest (what the error names): each measured until it passes the smallest
    # measured whole so far; the first whole
    verified.clear()
    chosen, smallest = first_fitting_layout(order, stages, PlannerOptions(), None, 30,
                                            fresh, check, smallest_only=True)
    assert chosen is None and smallest == 40
    assert verified == [(4, "host")]
    # one that only tile 4 on the host fits: the frugal probe fits, so the cheaper
    # layouts before it in cost order are each measured, then it is chosen
    verified.clear()
    chosen, smallest = first_fitting_layout(order, stages, PlannerOptions(), None, 50,
                                            fresh, check)
    assert chosen is not None and chosen.regions[0].tile == [4, 4, 4]
    assert chosen.regions[0].host  # the stored tile-4 layout (60) does not fit 50
    assert verified == [(4, "host"), (8, "device"), (8, "host"), (4, "device")]
    assert smallest == 40
    # a budget the stored tile-8 layout fits: it is chosen, after its frugal probe
    verified.clear()
    chosen, _ = first_fitting_layout(order, stages, PlannerOptions(), None, 95, fresh, check)
    assert chosen is not None and chosen.regions[0].tile == [8, 8, 8]
    assert not chosen.regions[0].host
    assert verified == [(4, "host"), (8, "device")]
    # at 75: after the probe, 8 stored is measured (90, over) and then 8 on the host
    # (70), the first in cost order that fits
    verified.clear()
    chosen, _ = first_fitting_layout(order, stages, PlannerOptions(), None, 75, fresh, check)
    assert chosen is not None and chosen.regions[0].tile == [8, 8, 8]
    assert chosen.regions[0].host
    assert verified == [(4, "host"), (8, "device"), (8, "host")]


def test_a_layout_is_extended_by_the_stage_that_held_its_peak(graph_and_stages) -> None:  # type: ignore[no-untyped-def]
    """NOTE [ Tiling layouts ] rule 7 on a real graph: the stage is found from the peak's
    innermost module, tiled with the layout's tile scaled to its output and the layout's
    fusion rules; nothing is added for a stage already tiled, one that cannot be tiled,
    or a peak outside every stage."""
    from remat3d.planner.tiling import extend_layout, stage_at

    graph, stages = graph_and_stages
    names = [s.name for s in stages.stages]
    ok = [True] * len(names)
    base = next(lay for lay in layouts(graph, stages, ok, tiles=(16,), host=True)
                if lay.depth == 1 and lay.fuse == "host")
    assert stage_at(graph, stages, "inner.1") == names.index("inner")  # a ReLU inside it
    assert stage_at(graph, stages, "") is None and stage_at(graph, stages, None) is None
    base = dataclasses.replace(base, tiled={s: v for s, v in base.tiled.items()
                                            if names[s] != "down"})
    grown = extend_layout(graph, stages, ok, base, "down.0")
    assert grown is not None and grown.added == ("down",)
    assert grown.tiled[names.index("down")][0] == (8, 8, 8)  # half resolution: half tile
    assert grown.label.endswith("+ down, fuse host")
    # the skip, now read by two tiled stages only, goes to the host like the layout's rule
    assert grown.tiled[names.index("stem")][1] == "host"
    assert extend_layout(graph, stages, ok, grown, "down.0") is None       # tiled already
    assert extend_layout(graph, stages, [n != "down" for n in names], base, "down.0") is None
    assert extend_layout(graph, stages, ok, base, "") is None              # outside stages


class _TableVerifier:
    """A stand-in for the search's verifier and rule 7's ``extend`` over stages s0, s1,
    ...: a layout's verified peak and the module running at it come from ``peaks``, keyed
    by ``key(tiled regions)``; ``verified`` lists the keys in the order measured, and
    ``relayout(layout, stages, added)`` makes a repair."""

    def __init__(self, count: int, peaks: dict, key: Callable[[list[Region]], object],
                 relayout: Callable[[Layout, set[int], tuple[str, ...]], Layout]) -> None:
        self.stages = StageModel(stages=[Stage(i, i, f"s{i}", 0, 0, 0, 0, 0, 0, 0, 0)
                                         for i in range(count)],
                                 base=0, glue_saved=[0] * count, pending=[0] * count,
                                 grads_after=[0] * count)
        self.peaks, self.key, self.relayout = peaks, key, relayout
        self.verified: list[object] = []

    def check(self, plan: Plan, within: Limits | None = None) -> Plan:
        key = self.key([r for r in plan.regions if r.decision == "tile"])
        self.verified.append(key)
        peak, plan.verified_peak_module = self.peaks[key]
        return _measured(plan, peak, within)

    def extend(self, layout: Layout, module: str | None) -> Layout | None:
        s = int(module[1]) if module else None
        if s is None or s in layout.tiled:
            return None
        return self.relayout(layout, {*layout.tiled, s}, (*layout.added, f"s{s}"))

    def first_fitting(self, order: list[Layout], budget: int,
                      repair: bool = True) -> Plan | None:
        self.verified.clear()
        chosen, _ = first_fitting_layout(order, self.stages, PlannerOptions(), None, budget,
                                         lambda regions: Plan(regions=regions), self.check,
                                         extend=self.extend if repair else None)
        return chosen


def _measured(plan: Plan, peak: int, within: Limits | None) -> Plan:
    """``plan`` as a verifier reports a step of that peak ``within`` those limits (NOTE
    [ Bounded measurements ]): whole, or stopped just past the limit, with the FLOPs done
    by then standing for how far the step got (here: the lower its peak, the further)."""
    limit = None if within is None else within.peak_bytes
    if limit is not None and peak > limit:
        plan.verified_peak_bytes, plan.extra_flops = limit + 1, 10**6 - peak
    else:
        plan.verified_peak_bytes = peak
    return plan


def _tiled_stages(tiled: list[Region]) -> tuple[int, ...]:
    return tuple(int(r.module[1]) for r in tiled)


def test_the_smallest_is_sought_from_the_most_frugal_layout_and_below_a_known_one() -> None:
    """For the error's smallest peak (``smallest_only``) the layouts go most frugal first
    (the reverse of the cost order), so the first measured whole sets a low bar and the
    rest are measured only until they pass it; ``below`` (the smallest another search
    verified) is the bar from the start, and where nothing goes under it, none is."""

    stages = StageModel(stages=[Stage(i, i, f"s{i}", 0, 0, 0, 0, 0, 0, 0, 0)
                                for i in range(2)],
                        base=0, glue_saved=[0, 0], pending=[0, 0], grads_after=[0, 0])
    tile = ((4, 4, 4), "device")
    # no layout dominates another (each tiles other stages), cost order
    order = [Layout(depth=1, fuse="none", tile=4, tiled=dict.fromkeys(tiled, tile))
             for tiled in ([0], [1], [0, 1])]
    peaks = {(0,): 90, (1,): 70, (0, 1): 40}
    seen: list[tuple[tuple[int, ...], int | None]] = []

    def check(plan: Plan, within: Limits | None = None) -> Plan:
        key = _tiled_stages([r for r in plan.regions if r.decision == "tile"])
        seen.append((key, None if within is None else within.peak_bytes))
        return _measured(plan, peaks[key], within)

    def fresh(regions: list[Region]) -> Plan:
        return Plan(regions=regions)

    chosen, smallest = first_fitting_layout(order, stages, PlannerOptions(), None, 30,
                                            fresh, check, smallest_only=True)
    assert chosen is None and smallest == 40
    assert seen == [((0, 1), None), ((1,), 40), ((0,), 40)]
    seen.clear()
    chosen, smallest = first_fitting_layout(order, stages, PlannerOptions(), None, 30,
                                            fresh, check, smallest_only=True, below=50)
    assert chosen is None and smallest == 40
    assert seen == [((0, 1), 50), ((1,), 40), ((0,), 40)]
    seen.clear()
    chosen, smallest = first_fitting_layout(order, stages, PlannerOptions(), None, 30,
                                            fresh, check, smallest_only=True, below=35)
    assert chosen is None and smallest == 1 << 62  # none went under it
    assert seen == [((0, 1), 35), ((1,), 35), ((0,), 35)]


def test_a_measured_fine_full_fusion_passes_over_the_coarse_one() -> None:
    """Rule 6 with full fusion: in cost order the coarse layout is measured before the
    fine one of the same stages (the fine one is the dear one to measure); measured
    first, as the smallest's most frugal layout, the fine one's miss stands for the
    coarse one too (a larger tile holds no less), which is not measured."""
    stages = StageModel(stages=[Stage(i, i, f"s{i}", 0, 0, 0, 0, 0, 0, 0, 0)
                                for i in range(2)],
                        base=0, glue_saved=[0, 0], pending=[0, 0], grads_after=[0, 0])

    def lay(edge: int) -> Layout:
        return Layout(depth=1, fuse="all", tile=edge, fine=edge == 2,
                      tiled=dict.fromkeys([0, 1], ((edge,) * 3, "device")))

    coarse, fine = lay(4), lay(2)
    assert not at_least_as_frugal(fine, coarse)  # not measured first for it
    assert at_least_as_frugal(fine, coarse, across_sweeps=True)
    assert not at_least_as_frugal(coarse, fine, across_sweeps=True)
    seen: list[tuple[int, int | None]] = []

    def check(plan: Plan, within: Limits | None = None) -> Plan:
        edge = next(r.tile[0] for r in plan.regions if r.decision == "tile")
        seen.append((edge, None if within is None else within.peak_bytes))
        return _measured(plan, {2: 40, 4: 60}[edge], within)

    def fresh(regions: list[Region]) -> Plan:
        return Plan(regions=regions)

    chosen, smallest = first_fitting_layout([coarse, fine], stages, PlannerOptions(), None,
                                            30, fresh, check, smallest_only=True)
    assert chosen is None and smallest == 40
    assert seen == [(2, None)]
    # in cost order (a budget it may fit) the coarse one is measured first, as before
    seen.clear()
    chosen, _ = first_fitting_layout([coarse, fine], stages, PlannerOptions(), None, 50,
                                     fresh, check)
    assert chosen is not None and chosen.regions[0].tile == [2, 2, 2]
    assert seen == [(4, 50), (2, 50)]


def test_a_near_miss_is_repaired_before_the_next_group_of_layouts() -> None:
    """Rule 7: a layout whose verified peak lay in a stage it does not tile gets that
    stage tiled too, verified before any layout of the next group (more levels); the
    repair goes on while the peak falls, and stops where it does not."""
    tile = ((4, 4, 4), "device")

    def lay(depth: int, tiled: set[int], added: tuple[str, ...] = ()) -> Layout:
        return Layout(depth=depth, fuse="none", tile=4,
                      tiled=dict.fromkeys(sorted(tiled), tile), added=added)

    order = [lay(1, {0}), lay(2, {0, 1, 2})]
    # tiled set -> (verified peak, the module running at it)
    peaks = {(0,): (80, "s1.conv"), (0, 1): (45, "s2.conv"), (0, 1, 2): (30, "s0.conv")}
    table = _TableVerifier(3, peaks, _tiled_stages,
                           lambda like, tiled, added: lay(like.depth, tiled, added))
    verified, choose = table.verified, functools.partial(table.first_fitting, order)

    chosen = choose(50)  # {0} misses at 80 with its peak in s1: {0, 1} fits, before L2
    assert chosen is not None and verified == [(0,), (0, 1)]
    assert "levels < 1 + s1" in chosen.notes[0]
    chosen = choose(40)  # {0, 1} misses too, lower, its peak in s2: {0, 1, 2}
    assert chosen is not None and verified == [(0,), (0, 1), (0, 1, 2)]
    assert "+ s1 + s2" in chosen.notes[0]
    peaks[(0, 1)] = (85, "s2.conv")  # the repair did not lower the peak: no further
    chosen = choose(40)
    assert verified == [(0,), (0, 1), (0, 1, 2)]  # the last one is L2, by the order
    assert chosen is not None and "+" not in chosen.notes[0]
    assert choose(20) is None  # nothing fits: every layout and repair tried once
    assert sorted(verified) == [(0,), (0, 1), (0, 1, 2)]
    # without ``extend`` (the default), no repair
    choose(50, repair=False)
    assert verified == [(0,), (0, 1, 2)]


def test_a_miss_that_passed_its_limit_outside_every_stage_is_measured_whole() -> None:
    """Rule 7 after a bounded measurement (NOTE [ Bounded measurements ]): a layout stopped
    where its peak passed the budget names the module it passed it in; where that was
    outside every stage (the parent's own ops, the loss), the repair has nothing to add,
    so the layout is measured whole once to find the stage at its peak."""
    tile = ((4, 4, 4), "device")

    def lay(tiled: set[int], added: tuple[str, ...] = ()) -> Layout:
        return Layout(depth=1, fuse="none", tile=4,
                      tiled=dict.fromkeys(sorted(tiled), tile), added=added)

    peaks = {(0,): (80, "s1.conv"), (0, 1): (45, "s2.conv")}
    table = _TableVerifier(3, peaks, _tiled_stages, lambda like, tiled, added: lay(tiled, added))
    limits: list[int | None] = []
    inner = table.check

    def check(plan: Plan, within: Limits | None = None) -> Plan:
        inner(plan, within)
        limits.append(None if within is None else within.peak_bytes)
        if within is not None and within.peak_bytes is not None \
                and (plan.verified_peak_bytes or 0) > within.peak_bytes:
            plan.verified_peak_module = None  # it passed the limit in the parent's ops
        return plan

    table.check = check  # type: ignore[method-assign]
    chosen = table.first_fitting([lay({0})], 50)
    assert chosen is not None and "levels < 1 + s1" in chosen.notes[0]
    assert table.verified == [(0,), (0,), (0, 1)] and limits == [50, None, 50]
    # the repair misses too, stopped outside every stage again, later in the step than
    # its parent (it went down): it is measured whole, and repaired in turn
    peaks[(0, 1, 2)] = (25, "s0.conv")
    limits.clear()
    chosen = table.first_fitting([lay({0})], 30)
    assert chosen is not None and "levels < 1 + s1 + s2" in chosen.notes[0]
    assert table.verified == [(0,), (0,), (0, 1), (0, 1), (0, 1, 2)]
    assert limits == [30, None, 30, None, 30]


def test_the_fine_tile_is_a_second_sweep_before_full_fusion() -> None:
    """Rule 5: by default a half and a quarter of the volume's shortest edge, then the
    same order again with an eighth, for budgets the larger tiles cannot reach: the
    layouts without full fusion or rebuilt outputs in both sweeps, then those with
    rebuilt outputs in both, then full fusion in both (it costs more than the halos of
    the smaller tiles)."""
    prof = profile(TinyUNet(), (1, 1, 128, 128, 128), device="meta")
    stages = build_stages(prof.graph)
    every = layouts(prof.graph, stages, [True] * len(stages.stages))
    assert {lay.tile for lay in every} == {64, 32, 16}
    full = [lay.fuse == "all" for lay in every]
    assert full == sorted(full)  # no partial fusion after full fusion
    rebuilt = ["rebuild" in lay.fuse for lay in every if lay.fuse != "all"]
    assert rebuilt == sorted(rebuilt) and any(rebuilt)
    for part in ([lay for lay in every if lay.fuse != "all" and "rebuild" not in lay.fuse],
                 [lay for lay in every if "rebuild" in lay.fuse],
                 [lay for lay in every if lay.fuse == "all"]):
        fine = [lay.fine for lay in part]
        assert fine == sorted(fine) and any(fine)
        assert all(lay.tile == 16 for lay in part if lay.fine)
        assert not any(lay.tile == 16 for lay in part if not lay.fine)
        assert [(lay.depth, lay.fuse) for lay in part if lay.fine] == \
            [(lay.depth, lay.fuse) for lay in part if lay.tile == 64]
    small = profile(TinyUNet(), SHAPE, device="meta")  # an eighth of 32 is under 16
    small_stages = build_stages(small.graph)
    assert not any(lay.fine for lay in layouts(small.graph, small_stages,
                                               [True] * len(small_stages.stages)))


def test_the_coarse_sweeps_repairs_come_before_the_fine_sweep() -> None:
    """Rules 6 and 7 across the sweeps: the fine tile of the same stages is measured
    first (it holds no more); where it fits, the coarse layout is measured, and its
    repair comes before the fine layout; where it misses, the coarse layout is passed
    over but repaired from the fine one's peak, still before the fine sweep's layouts."""
    def lay(tiled: set[int], edge: int, added: tuple[str, ...] = ()) -> Layout:
        return Layout(depth=1, fuse="none", tile=edge, added=added, fine=edge == 2,
                      tiled=dict.fromkeys(sorted(tiled), ((edge,) * 3, "device")))

    def table(peaks: dict) -> _TableVerifier:
        return _TableVerifier(2, peaks, lambda tiled: (_tiled_stages(tiled), tiled[0].tile[0]),
                              lambda like, tiled, added: lay(tiled, like.tile, added))

    fits = table({((0,), 4): (80, "s1.conv"), ((0, 1), 4): (30, None), ((0,), 2): (40, None)})
    chosen = fits.first_fitting([lay({0}, 4), lay({0}, 2)], 50)
    assert fits.verified == [((0,), 2), ((0,), 4), ((0, 1), 4)]
    assert chosen is not None and chosen.verified_peak_bytes == 30

    misses = table({((0,), 2): (80, "s1.conv"), ((0, 1), 4): (30, None),
                    ((0, 1), 2): (25, None)})
    chosen = misses.first_fitting([lay({0}, 4), lay({0}, 2)], 50)
    assert misses.verified == [((0,), 2), ((0, 1), 4)]
    assert chosen is not None and chosen.verified_peak_bytes == 30
    # without repairs, the coarse layout is passed over and nothing else fits
    assert misses.first_fitting([lay({0}, 4), lay({0}, 2)], 50, repair=False) is None
    assert misses.verified == [((0,), 2)]


class _Stemmed(torch.nn.Module):
    """A single-conv stem unit (conv, norm, activation in their own modules, as nnU-Net's
    ``StackedConvBlocks`` of one ``ConvDropoutNormReLU`` writes it) before a block."""

    def __init__(self) -> None:
        super().__init__()
        unit = torch.nn.Module()
        unit.conv = torch.nn.Conv3d(1, 4, 3, padding=1)
        unit.all_modules = torch.nn.Sequential(unit.conv, torch.nn.InstanceNorm3d(4, affine=True),
                                               torch.nn.LeakyReLU(inplace=True))
        self.stem = torch.nn.Sequential(unit.all_modules)
        self.block = torch.nn.Sequential(torch.nn.Conv3d(4, 4, 3, padding=1), torch.nn.ReLU(),
                                         torch.nn.Conv3d(4, 4, 1))
        self.out = torch.nn.Sequential(torch.nn.Conv3d(4, 4, 3, padding=1), torch.nn.ReLU(),
                                       torch.nn.Conv3d(4, 2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.stem(x)))


def test_a_single_conv_unit_is_one_stage_with_its_norm_and_activation() -> None:
    """A compute layer outside every block is staged with the largest module around it
    holding no other compute layer: its norm and activation belong to the stage (a
    region can recompute or tile them), not to glue that every plan keeps. (ResEnc-L's
    full-resolution stem: conv-only, its 512³ norm and activation were glue and no
    layout went below 49.76 GiB.)"""
    net = _Stemmed()
    stages = build_stages(profile(net, SHAPE, device="meta").graph)
    assert [s.name for s in stages.stages] == ["stem", "block", "out"]
    # the stem's norm output (fp32, 4 channels) is the stage's saved tensor, not glue's
    assert stages.glue_saved == [0, 0, 0]
    assert stages.stages[0].saved_bytes >= 4 * 32**3 * 4
    plan = remat3d.plan(net, SHAPE, budget="0.6x")
    assert "stem" in [r.module for r in plan.regions]


def test_fused_outputs_are_stored_where_they_fit_largest_saving_first(graph_and_stages) -> None:  # type: ignore[no-untyped-def]
    """NOTE [ Tiling layouts ] rule 8: the fused outputs of a layout that fits are stored
    on the device where the verified peak still fits and the extra FLOPs fall, the
    largest expected saving first; one fused into a single reader without normalisations
    (a head) is left fused; a stored output that does not fit the room left is not
    verified; host outputs are stored on the device where they fit, at the same FLOPs."""
    from remat3d.planner.tiled_plans import layout_regions, store_tiled_outputs
    from remat3d.planner.tiling import storing_saves
    from remat3d.planspec import Plan

    graph, stages = graph_and_stages
    names = [s.name for s in stages.stages]
    index = {n: i for i, n in enumerate(names)}
    tiled = {index[n] for n in ("stem", "down", "up", "head")}
    saves = storing_saves(graph, stages, tiled)
    # the skip (stem: a norm, two tiled readers with norms) saves the most; "up" fused
    # into the head (no normalisation) saves nothing; the head's readers are the loss
    assert saves[index["stem"]] > 0
    assert saves[index["up"]] == 0 and saves[index["head"]] == 0
    assert storing_saves(graph, stages, {index["stem"]})[index["stem"]] == 0  # none tiled

    lay = next(lay for lay in layouts(graph, stages, [True] * len(names), tiles=(16,))
               if lay.depth == 1 and lay.fuse == "all")
    assert {names[s] for s, (_t, out) in lay.tiled.items() if out == "fused"} == {"stem", "up"}
    start = Plan(regions=layout_regions(stages, lay), verified_peak_bytes=100,
                 extra_flops=1000)
    verified: list[list[str]] = []

    def check(plan: Plan, within: Limits | None = None) -> Plan:
        fused = sorted(r.module for r in plan.regions if r.fuse)
        verified.append(fused)
        plan.verified_peak_bytes = 100 + 10 * (2 - len(fused))
        plan.extra_flops = 1000 - 300 * ("stem" not in fused) - 1 * ("up" not in fused)
        return plan

    roomy = 100 + stages.stages[index["stem"]].output_bytes  # the output, stored
    chosen = store_tiled_outputs(start, roomy, stages, check, saves)
    assert verified == [["up"]]  # only the skip is tried; the head's input stays fused
    assert [r.module for r in chosen.regions if r.fuse] == ["up"]
    assert chosen.extra_flops == 700 and chosen.verified_peak_bytes == 110
    verified.clear()
    assert store_tiled_outputs(start, 105, stages, check, saves) is start  # no room: no trial
    assert verified == []
    # a host-resident output that fits is stored on the device (no copies, same FLOPs)
    hosted = Plan(regions=[dataclasses.replace(r, fuse=False, host=r.module == "stem")
                           for r in start.regions], verified_peak_bytes=100, extra_flops=700)

    def check_host(plan: Plan, within: Limits | None = None) -> Plan:
        plan.verified_peak_bytes, plan.extra_flops = 120, 700
        return plan

    assert not any(r.host for r in store_tiled_outputs(hosted, 10**9, stages, check_host,
                                                       saves).regions)
    assert store_tiled_outputs(hosted, 110, stages, check_host, saves) is hosted


def test_a_stored_fused_output_needs_room_for_its_gradient_at_the_peak(graph_and_stages) -> None:  # type: ignore[no-untyped-def]
    """NOTE [ Tiling layouts ] rule 8: a fused output stored is whole, and so is its
    gradient from its first reader run's backward until its own; where the verified peak
    was reached in backward between them (outside the runs computing it), a trial needs
    room for both, and is not verified without it."""
    from remat3d.planner.tiled_plans import layout_regions, store_tiled_outputs
    from remat3d.planner.tiling import MODEL_INPUT, stage_at, stage_producers, storing_saves

    graph, stages = graph_and_stages
    names = [s.name for s in stages.stages]
    index = {n: i for i, n in enumerate(names)}
    producers = stage_producers(graph, stages)
    assert producers[index["stem"]] == {MODEL_INPUT}
    assert producers[index["head"]] == {index["up"]}
    assert producers[index["up"]] == {index["inner"], index["stem"]}
    readers = stage_readers(graph, stages)
    lay = next(lay for lay in layouts(graph, stages, [True] * len(names), tiles=(16,))
               if lay.depth == 1 and lay.fuse == "all")
    saves = storing_saves(graph, stages, set(lay.tiled))
    skip = stages.stages[index["stem"]].output_bytes  # fused: read by the runs of down, head
    verified: list[str] = []

    def check(plan: Plan, within: Limits | None = None) -> Plan:
        verified.append(",".join(sorted(r.module for r in plan.regions if r.fuse)))
        plan.verified_peak_bytes, plan.extra_flops = 100, 700
        return plan

    def trials(budget: int, module: str, phase: str) -> list[str]:
        verified.clear()
        start = Plan(regions=layout_regions(stages, lay), verified_peak_bytes=100,
                     extra_flops=1000, verified_peak_module=module, verified_peak_phase=phase)
        store_tiled_outputs(start, budget, stages, check, saves, readers, producers,
                            lambda m: stage_at(graph, stages, m))
        return verified

    # in inner's backward the skip's gradient is whole (the head's run made it), stored
    assert trials(100 + skip, "inner", "backward") == []
    assert trials(100 + 2 * skip, "inner", "backward") == ["up"]
    # in forward no gradient is; inside a run that computes it, the run itself changes
    assert trials(100 + skip, "inner", "forward") == ["up"]
    assert trials(100 + skip, "down", "backward") == ["up"]
    assert trials(100 + skip, "up", "backward") == ["up"]


def test_tiled_stages_run_whole_where_room_allows_most_passes_first(graph_and_stages) -> None:  # type: ignore[no-untyped-def]
    """NOTE [ Tiling layouts ] rule 9: a tiled stage whose output is stored runs whole
    (recomputed, or kept where it may not be recomputed) when the verified peak still
    fits and the extra FLOPs fall; the stage saving the most passes is tried first; a
    fused or host output's stage never, nor a stage reading one (run whole, it would
    make that output whole), nor one saving under 1 % of the step's FLOPs; no trial is
    verified without room for it."""
    from remat3d.planner.tiled_plans import layout_regions, untile_where_room
    from remat3d.planner.tiling import stage_norms
    from remat3d.planspec import Plan

    graph, stages = graph_and_stages
    names = [s.name for s in stages.stages]
    norms, readers = stage_norms(graph, stages), stage_readers(graph, stages)
    assert norms[names.index("stem")] == 1 and norms[names.index("down")] == 1
    assert norms[names.index("inner")] == 0 and norms[names.index("head")] == 0
    lay = next(lay for lay in layouts(graph, stages, [True] * len(names), tiles=(16,))
               if lay.depth == 1 and lay.fuse == "chain")
    start = Plan(regions=layout_regions(stages, lay), verified_peak_bytes=100,
                 extra_flops=1000, step_flops=1)
    # "up" is fused into the head: the head stays tiled
    assert {r.module for r in start.regions if r.decision == "tile" and not r.fuse} == \
        {"stem", "down", "head"}
    verified: list[str] = []

    def check(plan: Plan, within: Limits | None = None) -> Plan:
        tiled = {r.module for r in plan.regions if r.decision == "tile"}
        whole = sorted({"stem", "down", "head"} - tiled)
        verified.append(",".join(whole))
        plan.verified_peak_bytes = 100 + 10 * len(whole)
        plan.extra_flops = 1000 - 100 * len(whole)
        return plan

    chosen = untile_where_room(start, 10**12, stages, check, norms, readers)
    order = sorted(("stem", "down"), key=lambda n: (
        -stages.stages[names.index(n)].fwd_flops * (1 + norms[names.index(n)]),
        names.index(n)))
    assert verified == [order[0], "down,stem"]  # the most passes saved first; not the head
    assert {r.module for r in chosen.regions if r.decision == "tile"} == {"up", "head"}
    assert {r.module for r in chosen.regions if r.decision == "recompute"} >= {"stem", "down"}
    assert chosen.extra_flops == 800 and chosen.verified_peak_bytes == 120
    verified.clear()
    assert untile_where_room(start, 100, stages, check, norms, readers) is start  # no room
    assert verified == []
    # a stage that may not be recomputed is kept whole: no region for it
    no_stem = [n != "stem" for n in names]
    kept = untile_where_room(start, 10**12, stages, check, norms, readers, no_stem)
    assert "stem" not in {r.module for r in kept.regions}
    # a stage saving under 1 % of the step's FLOPs is not tried
    verified.clear()
    big = dataclasses.replace(start, step_flops=10**15)
    assert untile_where_room(big, 10**12, stages, check, norms, readers) is big
    assert verified == []


def test_runs_stash_on_the_device_where_room_allows_most_passes_first(graph_and_stages) -> None:  # type: ignore[no-untyped-def]
    """NOTE [ Tiling layouts ] rule 10 without offload: each tiled run with normalisations
    (its own or a fused producer's) stashes on the device where the verified peak still
    fits and the extra FLOPs fall, the most passes saved first; a fused stage is not a
    run of its own; no trial is verified without room for its normalisation inputs."""
    from remat3d.planner.tiled_plans import layout_regions, stash_where_room
    from remat3d.planner.tiling import stage_norms
    from remat3d.planspec import Plan

    graph, stages = graph_and_stages
    names = [s.name for s in stages.stages]
    norms, readers = stage_norms(graph, stages), stage_readers(graph, stages)
    lay = next(lay for lay in layouts(graph, stages, [True] * len(names), tiles=(16,))
               if lay.depth == 1 and lay.fuse == "chain")
    start = Plan(regions=layout_regions(stages, lay), verified_peak_bytes=100,
                 extra_flops=1000, step_flops=1)
    verified: list[list[str]] = []

    def check(plan: Plan, within: Limits | None = None) -> Plan:
        stashed = sorted(r.module for r in plan.regions if r.stash)
        verified.append(stashed)
        plan.verified_peak_bytes = 100 + 10 * len(stashed)
        plan.extra_flops = 1000 - 100 * len(stashed) - 50 * ("down" in stashed)
        return plan

    def saved(name: str) -> int:  # the head computes the fused "up" (a norm) in its run
        run = ["up", "head"] if name == "head" else [name]
        return sum(stages.stages[names.index(n)].fwd_flops * norms[names.index(n)]
                   for n in run)

    order = sorted(("stem", "down", "head"), key=lambda n: -saved(n))
    chosen = stash_where_room(start, 10**12, stages, check, norms, readers)
    assert [v[-1] if len(v) == 1 else None for v in verified[:1]] == [order[0]]
    assert len(verified) == 3 and verified[-1] == sorted(order)
    assert {r.module for r in chosen.regions if r.stash == "device"} == {"stem", "down", "head"}
    assert chosen.extra_flops == 650 and chosen.verified_peak_bytes == 130
    verified.clear()
    assert stash_where_room(start, 100, stages, check, norms, readers) is start  # no room
    assert verified == []
    # the room is the budget above what each run held while its passes ran: the step's
    # peak elsewhere leaves room in the stem's run (its final pass, which holds no stash,
    # is at the peak), none in the others'
    big = 10**9
    held = Plan(regions=start.regions, verified_peak_bytes=big, extra_flops=1000,
                step_flops=1, verified_tiled_peaks={
                    "stem#0": {"forward": 1, "sums": 1, "final": big},
                    "down#0": {"forward": big, "sums": 1, "final": 1}})

    def level(plan: Plan, within: Limits | None = None) -> Plan:
        check(plan)
        plan.verified_peak_bytes = big
        return plan

    verified.clear()
    chosen = stash_where_room(held, big, stages, level, norms, readers)
    assert verified == [["stem"]]
    assert {r.module for r in chosen.regions if r.stash == "device"} == {"stem"}
    # with offload every layout's runs stash on the host already (a fused stage runs in
    # its reader's run): nothing to try
    hosted = Plan(regions=layout_regions(stages, lay, stash="host"), verified_peak_bytes=100,
                  extra_flops=1000, step_flops=1)
    assert {r.module for r in hosted.regions if r.stash == "host"} == {"stem", "down", "head"}
    verified.clear()
    assert stash_where_room(hosted, 10**12, stages, check, norms, readers) is hosted
    assert verified == []


def test_a_run_whose_stashes_do_not_all_fit_stashes_one(graph_and_stages) -> None:  # type: ignore[no-untyped-def]
    """Rule 10: where a run's normalisation inputs do not all fit the room its passes
    left, the one that saves the most and fits is stashed alone (``stash_norms``): the
    last normalisation's input is whole in forward only, an earlier one's in the
    backward's sums passes too."""
    from remat3d.planner.tiled_plans import layout_regions, stash_where_room
    from remat3d.planner.tiling import stage_norms

    graph, stages = graph_and_stages
    names = [s.name for s in stages.stages]
    norms, readers = stage_norms(graph, stages), stage_readers(graph, stages)
    lay = next(lay for lay in layouts(graph, stages, [True] * len(names), tiles=(16,))
               if lay.depth == 1 and lay.fuse == "all")
    # the head's run computes the fused stem (an InstanceNorm) and up (an InstanceNorm)
    size = stages.stages[names.index("stem")].output_bytes
    big = 10**9
    start = Plan(regions=layout_regions(stages, lay), verified_peak_bytes=big,
                 extra_flops=1000, step_flops=1, verified_tiled_peaks={
                     "head#0": {"forward": big - size, "sums": big - size // 2},
                     "down#0": {"forward": big, "sums": big}})
    verified: list[tuple[str, list[int] | None]] = []

    def check(plan: Plan, within: Limits | None = None) -> Plan:
        verified.extend((r.module, r.stash_norms) for r in plan.regions if r.stash)
        plan.verified_peak_bytes, plan.extra_flops = big, 900
        return plan

    chosen = stash_where_room(start, big, stages, check, norms, readers)
    assert verified == [("head", [1])]
    head = next(r for r in chosen.regions if r.module == "head")
    assert (head.stash, head.stash_norms) == ("device", [1])


def test_a_run_with_one_stash_takes_a_second_where_it_fits(graph_and_stages) -> None:  # type: ignore[no-untyped-def]
    """Rule 10: a run of three normalisations whose inputs do not all fit, but two do,
    stashes one, then the best second one beside it (both whole in forward; the earlier
    in the backward's sums passes unless the later is the run's last)."""
    from remat3d.planner.tiled_plans import layout_regions, stash_where_room
    from remat3d.planner.tiling import stage_norms

    graph, stages = graph_and_stages
    names = [s.name for s in stages.stages]
    norms, readers = stage_norms(graph, stages), stage_readers(graph, stages)
    norms = list(norms)
    norms[names.index("up")] = 2  # the head's run: stem's normalisation, then up's two
    lay = next(lay for lay in layouts(graph, stages, [True] * len(names), tiles=(16,))
               if lay.depth == 1 and lay.fuse == "all")
    sizes = [stages.stages[names.index(n)].output_bytes for n in ("stem", "up", "up")]
    big = 10**9
    start = Plan(regions=layout_regions(stages, lay), verified_peak_bytes=big,
                 extra_flops=1000, step_flops=1, verified_tiled_peaks={
                     "head#0": {"forward": big - 2 * max(sizes), "sums": big - max(sizes)},
                     "down#0": {"forward": big, "sums": big}})
    verified: list[list[int] | None] = []

    def check(plan: Plan, within: Limits | None = None) -> Plan:
        head = next(r for r in plan.regions if r.module == "head")
        verified.append(head.stash_norms)
        plan.verified_peak_bytes = big
        plan.extra_flops = 1000 - 100 * len(head.stash_norms or [])
        return plan

    chosen = stash_where_room(start, big, stages, check, norms, readers)
    # all three do not fit the sums passes' room: one first, then a pair holding it
    assert None not in verified and len(verified[0]) == 1
    assert len(verified[-1]) == 2 and verified[0][0] in verified[-1]
    head = next(r for r in chosen.regions if r.module == "head")
    assert (head.stash, head.stash_norms) == ("device", verified[-1])


def test_runs_reading_rebuilt_outputs_compute_them_in_tiles_then_whole_where_room(
        graph_and_stages) -> None:  # type: ignore[no-untyped-def]
    """NOTE [ Tiling layouts ] rule 12: every tiled run that reads a rebuilt output, itself
    or through a fused producer it computes, computes it in tiles in its backward; then
    each rebuilds whole where the verified peak still fits and the FLOPs fall, the most
    rebuilt FLOPs first, none verified without room for the outputs whole."""
    from remat3d.planner.tiled_plans import layout_regions, whole_rebuilds_where_room

    graph, stages = graph_and_stages
    names = [s.name for s in stages.stages]
    readers = stage_readers(graph, stages)
    by = {lay.fuse: lay for lay in layouts(graph, stages, [True] * len(names), tiles=(16,))
          if lay.depth == 1}
    chosen = sorted(by["chain+rebuild"].tiled)
    by["rebuild"] = Layout(depth=1, fuse="rebuild", tile=16,  # (not made: rule 5)
                           tiled=_facts(graph, stages).tiled(chosen, "rebuild", 16))

    def in_tiles(fuse: str) -> set[str]:
        return {r.module for r in layout_regions(stages, by[fuse], readers=readers)
                if r.rebuild_in_tiles}

    assert in_tiles("rebuild") == {"down", "up", "head"}  # stem's readers, up's reader
    assert in_tiles("chain+rebuild") == {"down", "head"}  # head computes the fused up
    assert in_tiles("chain") == set()
    assert not any(r.rebuild_in_tiles for r in layout_regions(stages, by["rebuild"]))
    start = Plan(regions=layout_regions(stages, by["rebuild"], readers=readers),
                 verified_peak_bytes=100, extra_flops=1000, step_flops=1)
    verified: list[list[str]] = []

    def check(plan: Plan, within: Limits | None = None) -> Plan:
        whole = sorted(r.module for r in plan.regions
                       if r.decision == "tile" and not r.rebuild_in_tiles)
        verified.append(whole)
        plan.verified_peak_bytes = 100 + 10 * len(whole)
        plan.extra_flops = 1000 - 100 * len(whole)
        return plan

    rebuilt_read = {"down": ["stem"], "up": ["stem"], "head": ["up"]}
    order = sorted(rebuilt_read, key=lambda n: -sum(
        stages.stages[names.index(p)].fwd_flops for p in rebuilt_read[n]))
    chosen = whole_rebuilds_where_room(start, 10**12, stages, check, readers)
    assert verified == [sorted({"stem", *order[:k]}) for k in (1, 2, 3)]
    assert not any(r.rebuild_in_tiles for r in chosen.regions)
    assert chosen.extra_flops == 600  # (stem, with no rebuilt input, counts as whole)
    verified.clear()
    assert whole_rebuilds_where_room(start, 100, stages, check, readers) is start  # no room
    assert verified == []


def test_rebuilt_runs_reading_rebuilt_outputs_hand_their_inputs_on_where_they_fit(
        graph_and_stages) -> None:  # type: ignore[no-untyped-def]
    """NOTE [ Tiling layouts ] rule 11: a rebuilt run that reads a rebuilt output (``up``
    reads the rebuilt ``stem``) hands the inputs its last reader's rebuild made to its own
    backward, one rebuild fewer, where the verified peak still fits and the FLOPs fall;
    a rebuilt run reading nothing rebuilt is not tried."""
    from remat3d.planner.tiled_plans import hand_rebuilt_inputs, layout_regions

    graph, stages = graph_and_stages
    readers = stage_readers(graph, stages)
    chain = next(lay for lay in layouts(graph, stages, [True] * len(stages.stages),
                                        tiles=(16,)) if lay.depth == 1
                 and lay.fuse == "chain+rebuild")
    rebuild = Layout(depth=1, fuse="rebuild", tile=16,
                     tiled=_facts(graph, stages).tiled(sorted(chain.tiled), "rebuild", 16))
    start = Plan(regions=layout_regions(stages, rebuild, readers=readers),
                 verified_peak_bytes=100, extra_flops=1000, step_flops=1)
    assert {r.module for r in start.regions if r.rebuild} == {"stem", "up"}
    tried: list[list[str]] = []

    def check(plan: Plan, cost: int) -> Plan:
        handing = sorted(r.module for r in plan.regions if r.hand_inputs)
        tried.append(handing)
        plan.verified_peak_bytes = 100 + cost * len(handing)
        plan.extra_flops = 1000 - 100 * len(handing)
        return plan

    chosen = hand_rebuilt_inputs(start, 150, stages, lambda p, within=None: check(p, 10), readers)
    assert tried == [["up"]]
    assert [r.module for r in chosen.regions if r.hand_inputs] == ["up"]
    assert chosen.extra_flops == 900
    tried.clear()  # over the budget: the plan as it was
    assert hand_rebuilt_inputs(start, 150, stages, lambda p, within=None: check(p, 60),
                               readers) is start
    assert tried == [["up"]]

"""The graph plan search (planner/graph_search.py) on captured steps."""

from __future__ import annotations

import pytest
import torch

from remat3d.capture.joint import capture
from remat3d.planner.graph_search import search_graph
from remat3d.planner.liveness import closed_recompute, simulate
from remat3d.runtime.graph_run import measure_graph_plan
from tests.capture.nets import ParentConcat


def _unet():
    from monai.networks.nets import UNet

    return UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1,
                norm="instance")


@pytest.fixture(scope="module", params=["concat", "monai-unet"])
def captured(request):
    torch.manual_seed(0)
    model = ParentConcat() if request.param == "concat" else _unet()
    shape = (1, 1, 32, 32, 32)
    return model, shape, capture(model, shape).graph


def test_a_budget_the_step_fits_needs_no_plan(captured):
    _, _, graph = captured
    choice = search_graph(graph, simulate(graph).peak_bytes)
    assert choice.fits and choice.recompute == [] and choice.cost == 0


def test_plans_fit_their_budget_as_measured_and_cost_more_for_less(captured):
    model, shape, graph = captured
    unplanned = simulate(graph).peak_bytes
    costs = []
    for fraction in (0.9, 0.75):
        choice = search_graph(graph, int(fraction * unplanned))
        assert choice.fits, fraction
        assert choice.recompute == sorted(closed_recompute(graph, choice.recompute))
        measured = measure_graph_plan(model, (shape,), choice.recompute,
                                      twice=choice.twice).peak_bytes
        assert choice.liveness.peak_bytes <= fraction * unplanned
        assert abs(measured - choice.liveness.peak_bytes) <= 0.03 * measured
        costs.append(choice.cost)
    assert costs[0] <= costs[1]


def test_an_infeasible_budget_returns_the_smallest_peak_found(captured):
    _, _, graph = captured
    weights = sum(n.bytes for n in graph.nodes if n.phase == "input")
    choice = search_graph(graph, weights)  # below what parameters alone take
    assert not choice.fits
    assert choice.liveness.peak_bytes < simulate(graph).peak_bytes


def test_a_later_search_walks_the_path_and_chooses_what_a_fresh_one_does(captured):
    # the greedy's steps do not depend on the budget (graph_search.py NOTE rule 4)
    from remat3d.planner import graph_search

    _, _, graph = captured
    graph_search._PATHS.clear()
    floor = search_graph(graph, 1).liveness.peak_bytes  # the whole path, then walked
    middle = (floor + simulate(graph).peak_bytes) // 2
    walked = [search_graph(graph, b) for b in (floor, middle)]
    fresh = []
    for budget in (floor, middle):
        graph_search._PATHS.clear()
        fresh.append(search_graph(graph, budget))
    for a, b in zip(walked, fresh):
        assert (a.recompute, a.twice, a.fits, a.liveness.peak_bytes) == \
            (b.recompute, b.twice, b.fits, b.liveness.peak_bytes)
    assert walked[0].fits and walked[0].liveness.peak_bytes == floor

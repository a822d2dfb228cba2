"""The forward-tiling planner on plain data (no torch): materialized tensors, steps, the
search's tiles and host placement, the infeasible error."""

from __future__ import annotations

import pytest

from remat3d.errors import InfeasibleBudgetError
from remat3d.planner.forward_tiles import materialized, plan_forward, steps_of
from remat3d.tilegraph import TileGraph, TileNode

SIZE = (64, 64, 64)
VOXELS = 64 ** 3


def _conv(name: str, source: str, channels: int = 8) -> TileNode:
    return TileNode(name, "convolution", "local", [source], [source, "w"], SIZE,
                    VOXELS * channels * 4, 4, relation="conv", kernel=(3, 3, 3),
                    padding=(1, 1, 1))


def _graph() -> TileGraph:
    """volume -> conv -> norm -> relu = skip -> conv -> add(skip) -> conv (the output)."""
    nodes = [
        TileNode("x", "input", "input", size=SIZE, bytes=VOXELS * 4, itemsize=4),
        TileNode("w", "const", "const", bytes=4096),
        _conv("c1", "x"),
        TileNode("n1", "native_group_norm", "stats", ["c1"], ["c1"], SIZE, VOXELS * 32, 4),
        TileNode("g1", "getitem", "local", ["n1"], ["n1"], SIZE, VOXELS * 32, 4),
        TileNode("skip", "relu", "local", ["g1"], ["g1"], SIZE, VOXELS * 32, 4),
        _conv("c2", "skip"),
        TileNode("sum", "add", "local", ["c2", "skip"], ["c2", "skip"], SIZE, VOXELS * 32, 4),
        _conv("out", "sum", channels=2),
    ]
    return TileGraph("toy", (1, 1, *SIZE), nodes, "out")


def test_materialized_tensors_and_steps():
    graph = _graph()
    # the volume, the norm's input, the skip (two readers) and the output
    assert materialized(graph) == {"x", "c1", "skip", "out"}
    steps = steps_of(graph)
    assert [(s.root, s.nodes) for s in steps] == [
        ("c1", ["c1"]), ("skip", ["n1", "g1", "skip"]), ("out", ["c2", "sum", "out"])]


def test_the_search_tiles_then_spills_and_its_plan_fits():
    graph = _graph()
    whole = plan_forward(graph, 1 << 40)
    assert not whole.tiled and not whole.host
    tiled = plan_forward(graph, int(whole.peak_bytes * 0.6))
    assert tiled.tiled and tiled.peak_bytes <= whole.peak_bytes * 0.6
    spilled = plan_forward(graph, int(whole.peak_bytes * 0.2))
    assert spilled.host and spilled.peak_bytes <= whole.peak_bytes * 0.2
    # the same graph and budget, the same plan
    assert spilled.to_dict() == plan_forward(graph, int(whole.peak_bytes * 0.2)).to_dict()


def test_an_infeasible_budget_names_the_smallest():
    graph = _graph()
    with pytest.raises(InfeasibleBudgetError, match="smallest feasible budget") as info:
        plan_forward(graph, 1024, host_separate=False)
    smallest = info.value.smallest_feasible_bytes
    assert plan_forward(graph, smallest, host_separate=False).peak_bytes <= smallest

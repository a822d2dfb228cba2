"""Tiled regions on plain data (planner/graph_tiles.py): convex regions, passes, and the
parts of each value a tile needs."""

from __future__ import annotations

from remat3d.halo import CONV, POINTWISE, SpatialOp
from remat3d.planner.graph_tiles import TileValue, needed, regions_of

G = (16, 16, 16)
SAME = SpatialOp(POINTWISE, (0,), 1)
CONV3 = SpatialOp(CONV, (0,), 1, (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1))


def _chain() -> list[TileValue]:
    """x -> conv -> norm (its statistics a reduce) -> out; a weight gradient summed over
    the output; then an outside op reading the output, and a member reading that."""
    return [
        TileValue("x", "outside", [], G),
        TileValue("w", "outside", []),
        TileValue("conv", "local", ["x", "w"], G, {"x": CONV3}),
        TileValue("stats", "reduce", ["conv"], None, {"conv": SAME}, "conv"),
        TileValue("norm", "local", ["conv", "stats"], G, {"conv": SAME}),
        TileValue("gw", "reduce", ["norm", "x"], None, {"norm": SAME, "x": CONV3}, "norm"),
        TileValue("gw0", "pick", ["gw"]),
        TileValue("pool", "outside", ["norm"], (8, 8, 8)),
        TileValue("up", "local", ["pool", "norm"], G, {"pool": SAME, "norm": SAME}),
    ]


def test_regions_are_convex_and_run_in_passes():
    values = _chain()
    first, second = regions_of(values, ["gw0", "up"])
    assert first.members == ["conv", "stats", "norm", "gw", "gw0"]
    # the statistics are read one pass after the one that makes the convolution
    assert first.made == {"conv": 0, "stats": 0, "norm": 1, "gw": 1, "gw0": 1}
    assert first.passes == 2
    assert first.inputs == ["x", "w"]
    assert first.outputs == ["norm", "gw0"]  # read by the outside pooling; returned
    # the member after the outside op is a region of its own
    assert second.members == ["up"] and second.inputs == ["pool", "norm"]


def test_a_pass_needs_halos_and_sums_each_voxel_once():
    values = _chain()
    by_name = {v.name: v for v in values}
    region = regions_of(values, ["gw0", "up"])[0]
    tiles = region.tiles((8, 8, 8))
    owned = []
    for tile in tiles:
        want = needed(region, by_name, 0, tile, {"x"})
        # the statistics sum the convolution over the tile's own part, read without halo
        assert want["stats"] == tile and want["conv"] == tile
        assert want["x"] == tuple((max(lo - 1, 0), min(hi + 1, 16)) for lo, hi in tile)
        owned.append(want["stats"])
    voxels = sum((a1 - a0) * (b1 - b0) * (c1 - c0) for (a0, a1), (b0, b1), (c0, c1) in owned)
    assert voxels == 16 ** 3
    # pass 1: the norm is an output made whole, the weight gradient reads x with a halo
    # through the convolution, recomputed per tile
    want = needed(region, by_name, 1, tiles[0], {"x"})
    assert want["norm"] == tiles[0] and want["conv"] == tiles[0]
    assert want["x"] == ((0, 9), (0, 9), (0, 9))

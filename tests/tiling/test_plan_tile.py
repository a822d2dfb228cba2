"""The 'tile' decision of a Plan: validation, JSON round trip, old plans, apply/remove."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat3d
from remat3d.planspec import Plan, PlanError, Region


def test_tile_region_round_trip_and_summary() -> None:
    plan = Plan(regions=[Region("0", decision="tile", tile=[8, 16, 8]), Region("1")])
    again = Plan.from_dict(plan.to_dict())
    assert again == plan
    assert "tile=8x16x8" in plan.summary()
    assert "1 tile" in plan.summary().splitlines()[0]


def test_old_plans_without_tile_field_still_load() -> None:
    data = Plan(regions=[Region("a")]).to_dict()
    for region in data["regions"]:
        del region["tile"]
    assert Plan.from_dict(data).regions[0].tile is None


@pytest.mark.parametrize("kwargs", [
    {"decision": "tile"},                                   # no size
    {"decision": "recompute", "tile": [4, 4, 4]},           # size without decision
    {"decision": "tile", "tile": [4, 4]},                   # two edges
    {"decision": "tile", "tile": [0]},                      # not positive
    {"decision": "tile", "tile": [4], "policy": "save-compute-heavy"},
])
def test_bad_tile_regions_refused(kwargs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanError):
        Plan(regions=[Region("m", **kwargs)])


def test_apply_tile_region_and_remove() -> None:
    net = nn.Sequential(nn.Conv3d(1, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.ReLU(),
                        nn.Conv3d(3, 2, 3, padding=1))
    x = torch.randn(1, 1, 9, 8, 7, requires_grad=True)
    y_ref = net(x)
    (g_ref,) = torch.autograd.grad(y_ref.sum(), x)
    remat3d.apply(net, Plan(regions=[Region("", segment=["0", "1", "2"], decision="tile",
                                            tile=[4])]))
    y = net(x)
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    assert remat3d.report(net).regions[0].forward_runs == 1
    remat3d.remove(net)
    assert "forward" not in net.__dict__

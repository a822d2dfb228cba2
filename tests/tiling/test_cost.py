"""The planner's cost model of a tiled stage against the tracker's measured FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat3d
from remat3d.nn.tiling import tile
from remat3d.nn.tiling.cost import describe, tiled_cost


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(2, 4, 3, padding=1)
        self.norm = nn.InstanceNorm3d(4, affine=True)
        self.conv2 = nn.Conv3d(4, 3, 3, stride=2, padding=1)


class _Tiled(nn.Module):
    def __init__(self, stage: _Stage, size: tuple[int, int, int]) -> None:
        super().__init__()
        self.stage = stage
        self.size = size

    def run(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stage
        return s.conv2(torch.relu(s.norm(s.conv1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tile(self.run, x, tile=self.size)


@pytest.mark.parametrize("size", [(4, 4, 4), (3, 8, 5), (8, 8, 8)])
def test_cost_model_flops_equal_tracker(size: tuple[int, int, int]) -> None:
    with torch.device("meta"):
        model = _Tiled(_Stage(), size)
    x = torch.empty(1, 2, 16, 16, 16, device="meta")
    spec = describe(model.run, x)
    cost = tiled_cost(spec, size)
    measured = remat3d.measure(model, x, device="meta")
    assert cost.forward_flops + cost.backward_flops == measured.flops
    untiled = remat3d.measure(_Untiled(model), x, device="meta")
    assert cost.untiled_forward_flops + cost.untiled_backward_flops == untiled.flops
    assert cost.kept_bytes == 2 * 16**3 * 4


class _Untiled(nn.Module):
    def __init__(self, tiled: _Tiled) -> None:
        super().__init__()
        self.tiled = tiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tiled.run(x)


def test_cost_grows_as_tiles_shrink() -> None:
    with torch.device("meta"):
        stage = _Tiled(_Stage(), (8, 8, 8))
    spec = describe(stage.run, torch.empty(1, 2, 32, 32, 32, device="meta"))
    big, small = tiled_cost(spec, (16, 16, 16)), tiled_cost(spec, (4, 4, 4))
    assert small.extra_flops > big.extra_flops > 0
    assert small.tile_peak_bytes < big.tile_peak_bytes

"""Stashed passes (NOTE [ Stashed passes ]): a tiled run keeps its normalisations' inputs
whole while the passes that read them run, and computes each op about once forward.

Exact as tiles always are (against the untiled float64 step), the same bits whether the
stash is on the device or in host memory, fewer convolution FLOPs, and on meta a host
stash is booked as host memory, a device stash as device memory.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat3d
from remat3d.errors import TilingError
from remat3d.planspec import Plan, PlanError, Region
from remat3d.runtime.tiling import tile
from remat3d.runtime.tiling.tiled import TiledRun
from tests.tiling.test_fused import FUSED, TinyUNet, _step, assert_same_step
from tests.tiling.test_norms import TOL64, _block, _tiled_step


@pytest.mark.parametrize("stash", ["device", "host"])
@pytest.mark.parametrize("norm", ["instance", "instance-affine-running-eps-momentum",
                                  "group-affine-eps", "batch", "batch-cumulative"])
@pytest.mark.parametrize("act", ["leakyrelu-inplace", "none"])
def test_stashed_run_equals_the_untiled_step(norm: str, act: str, stash: str) -> None:
    torch.manual_seed(0)
    block = _block(norm, act).double()
    x = torch.randn(2, 2, 10, 12, 7, dtype=torch.float64)
    reference = _tiled_step(copy.deepcopy(block), x, None)
    for tile_size in ((10, 6, 7), (4, 3, 5)):
        got = _tiled_step(copy.deepcopy(block), x, tile_size, stash)
        assert_same_step(reference, got, TOL64)
        for name, value in reference[1].items():  # running statistics updated once
            assert torch.allclose(got[1][name], value, rtol=TOL64, atol=TOL64), (name, stash)


def test_host_and_device_stashes_give_the_same_bits() -> None:
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        block = _block("instance-affine", "leakyrelu-inplace")
        x = torch.randn(1, 2, 12, 10, 9)
        device = _tiled_step(copy.deepcopy(block), x, (5, 4, 4), "device")
        host = _tiled_step(copy.deepcopy(block), x, (5, 4, 4), "host")
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(device[0], host[0])
    assert all(torch.equal(device[1][k], host[1][k]) for k in device[1])


class _ConvFlops(TorchDispatchMode):
    """Output voxels x channels of every convolution forward (a FLOP proxy)."""

    def __init__(self) -> None:
        super().__init__()
        self.forward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.convolution.default:
            self.forward += out.numel()
        return out


def test_a_stash_runs_each_convolution_about_once_forward() -> None:
    """Two normalisations: without a stash the first convolution runs in three passes and
    the second in two; with one, each runs once (its halo aside)."""
    torch.manual_seed(0)
    block = _block("instance-affine", "leakyrelu-inplace").double()
    x = torch.randn(1, 2, 12, 12, 12, dtype=torch.float64)
    counts = {}
    for stash in (None, "device", "host", "whole"):
        counter = _ConvFlops()
        with counter, torch.no_grad():
            if stash == "whole":
                block(x)
            else:
                tile(block, x, tile=12, stash=stash)  # one tile: no halo
        counts[stash] = counter.forward
    assert counts["device"] == counts["host"] == counts["whole"]
    assert counts[None] > 2 * counts["whole"]


class _Residual(nn.Module):
    """ResEnc's block: conv-norm-act-conv-norm, plus the input, then act; and a
    normalisation whose input is written in place (not stashed: rule 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv3d(3, 3, 3, padding=1), nn.InstanceNorm3d(3, affine=True)
        self.conv2, self.norm2 = nn.Conv3d(3, 3, 3, padding=1), nn.GroupNorm(3, 3)
        self.conv3, self.norm3 = nn.Conv3d(3, 3, 3, padding=1), nn.InstanceNorm3d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.leaky_relu(self.norm1(self.conv1(x)), inplace=True)
        y = torch.relu(self.norm2(self.conv2(y)) + x)
        z = self.conv3(y)
        z.add_(1.0)  # the normalisation reads a tensor written in place
        return self.norm3(z) + y


def test_residual_and_inplace_inputs_are_exact() -> None:
    torch.manual_seed(0)
    block = _Residual().double()
    x = torch.randn(1, 3, 9, 11, 10, dtype=torch.float64)
    run = TiledRun(block, [x], 4, stash="device")
    assert sorted(run.stash_nodes) == [0, 1]  # norm3's input is written in place
    reference = _tiled_step(copy.deepcopy(block), x, None)
    for stash in ("device", "host"):
        assert_same_step(reference, _tiled_step(copy.deepcopy(block), x, 4, stash), TOL64)


def test_a_stashed_reader_of_fused_outputs_is_exact() -> None:
    """The stash of a run applies to the fused producers it computes too."""
    torch.manual_seed(0)
    net = TinyUNet().double()
    stashed = [dataclasses.replace(r, stash="host" if r.module == "up" else "device")
               for r in FUSED]
    tiled = remat3d.apply(copy.deepcopy(net), Plan(regions=stashed))
    x = torch.randn(1, 1, 16, 14, 12, dtype=torch.float64)
    assert_same_step(_step(net, x), _step(tiled, x), 1e-12)


def test_meta_books_a_host_stash_on_the_host_and_a_device_stash_on_the_device() -> None:
    from remat3d.instrument.tracker import MemoryTracker

    stem = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True),
                         nn.ReLU(), nn.Conv3d(4, 4, 3, padding=1)).to("meta")
    x = torch.empty(1, 1, 32, 32, 32, device="meta")
    peaks, hosts = {}, {}
    for stash in (None, "device", "host"):
        with torch.no_grad(), MemoryTracker("meta") as tracker:
            y = tile(stem, x, tile=8, stash=stash)
            del y
        peaks[stash], hosts[stash] = tracker.peak_bytes, tracker.host_peak_bytes
    norm_input = 4 * 32**3 * 4  # 4 channels, fp32
    assert hosts[None] == hosts["device"] == 0
    assert hosts["host"] == norm_input
    assert peaks["host"] <= peaks[None]
    assert peaks["device"] >= peaks[None] + norm_input // 2  # less the tiles' own tensors


def test_stash_needs_a_tiled_region_and_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanError, match="stash"):
        Plan(regions=[Region("stem", stash="host")]).check()
    with pytest.raises(PlanError, match="stash"):
        Plan(regions=[Region("stem", decision="tile", tile=[4], stash="disk")]).check()
    with pytest.raises(TilingError, match="stash"):
        tile(nn.Conv3d(1, 1, 3, padding=1), torch.randn(1, 1, 4, 4, 4), tile=2, stash="gpu")
    plan = Plan(regions=[Region("stem", decision="tile", tile=[4], stash="host")])
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").regions[0].stash == "host"
    assert "stash on host" in plan.summary()


def test_a_partial_stash_keeps_only_the_normalisations_asked_for() -> None:
    """``stash_norms``: only those normalisations' inputs are stashed (the others'
    passes recompute from the run's inputs); exact as every stash is, and its forward
    runs between no stash and the full one."""
    torch.manual_seed(0)
    block = _Residual().double()
    x = torch.randn(1, 3, 9, 11, 10, dtype=torch.float64)
    assert sorted(TiledRun(block, [x], 4, stash="device", stash_norms=[1]).stash_nodes) == [1]
    # norm3's input is written in place: asked for, still not stashed (rule 3)
    assert sorted(TiledRun(block, [x], 4, stash="device", stash_norms=[0, 2]).stash_nodes) \
        == [0]
    reference = _tiled_step(copy.deepcopy(block), x, None)
    for norms in ([0], [1], [1, 0]):
        got = _tiled_step(copy.deepcopy(block), x, 4, "device", stash_norms=norms)
        assert_same_step(reference, got, TOL64)
    counts = {}
    for norms in (None, [1], "all"):
        counter = _ConvFlops()
        with counter, torch.no_grad():
            if norms is None:
                tile(block, x, tile=11)
            else:
                tile(block, x, tile=11, stash="device",
                     stash_norms=None if norms == "all" else norms)
        counts[str(norms)] = counter.forward
    assert counts["None"] > counts["[1]"] > counts["all"]
    with pytest.raises(TilingError, match="stash_norms"):
        TiledRun(block, [x], 4, stash="device", stash_norms=[3])
    with pytest.raises(TilingError, match="stash_norms"):
        tile(block, x, tile=4, stash_norms=[0])


def test_stash_norms_needs_a_stash_and_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlanError, match="stash_norms"):
        Plan(regions=[Region("stem", decision="tile", tile=[4], stash_norms=[0])])
    with pytest.raises(PlanError, match="stash_norms"):
        Plan(regions=[Region("stem", decision="tile", tile=[4], stash="device",
                             stash_norms=[-1])])
    plan = Plan(regions=[Region("stem", decision="tile", tile=[4], stash="device",
                                stash_norms=[2])])
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").regions[0].stash_norms == [2]
    assert "stash on device (normalisations 2)" in plan.summary()


def test_a_partially_stashed_plan_region_is_exact() -> None:
    torch.manual_seed(0)
    net = TinyUNet().double()
    regions = [dataclasses.replace(r, stash="device", stash_norms=[1]) if r.module == "head"
               else r for r in FUSED]
    tiled = remat3d.apply(copy.deepcopy(net), Plan(regions=regions))
    x = torch.randn(1, 1, 16, 14, 12, dtype=torch.float64)
    assert_same_step(_step(net, x), _step(tiled, x), 1e-12)

"""Host-resident tiled outputs (NOTE [ Host-resident tiled outputs ]): exact, and on meta
booked as host memory rather than device memory."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import remat3d
from remat3d.instrument.tracker import MemoryTracker
from remat3d.planspec import Plan, PlanError, Region
from remat3d.runtime.tiling.host import is_host

from .test_fused import FUSED, HOST, TinyUNet, _step, assert_same_step

# (the host plan against the untiled step: test_fused.py, with the fused plan)
STORED = [Region("stem", decision="tile", tile=[6, 7, 5]), *FUSED[1:]]


def test_host_output_changes_no_bit_of_the_tiled_step() -> None:
    """On the CPU the host path copies every slice in and every gradient out, and gives
    the very bits the same tiles give with the skip on the device."""
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        net = TinyUNet()
        stored, host = copy.deepcopy(net), copy.deepcopy(net)
        remat3d.apply(stored, Plan(regions=STORED))
        remat3d.apply(host, Plan(regions=HOST))
        x = torch.randn(1, 1, 14, 12, 10)
        (out_a, g_a), (out_b, g_b) = _step(stored, x), _step(host, x)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(out_a, out_b)
    assert g_a.keys() == g_b.keys()
    assert all(torch.equal(g_a[k], g_b[k]) for k in g_a), [
        k for k in g_a if not torch.equal(g_a[k], g_b[k])]


def test_tile_by_hand_reads_and_writes_host_tensors() -> None:
    torch.manual_seed(0)
    stem = nn.Sequential(nn.Conv3d(1, 3, 3, padding=1), nn.InstanceNorm3d(3), nn.ReLU())
    down = nn.Conv3d(3, 3, 3, stride=2, padding=1)
    x = torch.randn(1, 1, 10, 9, 8, dtype=torch.float64, requires_grad=True)
    stem, down = stem.double(), down.double()

    def step(host: bool) -> list[torch.Tensor]:
        for p in [*stem.parameters(), *down.parameters()]:
            p.grad = None
        x.grad = None
        s = remat3d.tile(stem, x, tile=4, host=host)
        assert is_host(s) == host
        d = remat3d.tile(down, s, tile=3)
        loss = (d * d).sum() + (remat3d.tile(torch.tanh, s, tile=5) ** 2).sum()
        loss.backward()
        return [x.grad.clone(), *(p.grad.clone() for p in [*stem.parameters(),
                                                            *down.parameters()])]

    on_device, on_host = step(False), step(True)
    assert all(torch.equal(a, b) for a, b in zip(on_device, on_host))


def test_untiled_reader_gets_a_device_copy() -> None:
    torch.manual_seed(0)
    net = TinyUNet().double()
    tiled = copy.deepcopy(net)
    # 'down' is not tiled: it reads a device copy of the host skip
    remat3d.apply(tiled, Plan(regions=[HOST[0], FUSED[2], FUSED[3]]))
    x = torch.randn(1, 1, 12, 12, 12, dtype=torch.float64)
    assert_same_step(_step(net, x), _step(tiled, x), 1e-12)


def test_meta_step_books_the_host_output_as_host_memory() -> None:
    torch.manual_seed(0)
    x = torch.empty(1, 1, 32, 32, 32, device="meta")
    peaks, hosts = {}, {}
    for name, regions in (("stored", STORED), ("host", HOST)):
        net = TinyUNet().to("meta")
        bigger = [dataclasses.replace(r, tile=[8] if r.module == "down" else [16])
                  for r in regions]  # fewer tiles: a faster test
        remat3d.apply(net, Plan(regions=bigger))
        m = remat3d.measure(net, x, device="meta")
        peaks[name], hosts[name] = m.peak_bytes, m.host_bytes
    skip = 4 * 32**3 * 4  # 4 channels, fp32
    assert hosts["stored"] == 0
    assert hosts["host"] >= 2 * skip  # the skip and its gradient
    # the device no longer holds the skip, nor its gradient while the readers' backward runs
    assert peaks["host"] <= peaks["stored"] - 1.5 * skip


def test_tracker_books_host_placements_and_host_only_ops_on_the_host() -> None:
    from remat3d.instrument.state import placement

    with MemoryTracker("meta") as tracker:
        with placement("host"):
            a = torch.empty(256, device="meta")          # 1 KiB on the host
        b = a * 2                                          # reads only host: host
        with placement("device"):
            c = a.clone()                                  # a copy to the device
        d = c + a                                          # mixes: device
        assert tracker.live() == 2 * 1024
        assert tracker.ledger.live_bytes["cpu"] == 2 * 1024
    assert tracker.host_peak_bytes == 2 * 1024 and tracker.peak_bytes == 2 * 1024
    del a, b, c, d


def test_host_needs_an_unfused_tiled_region_and_round_trips() -> None:
    with pytest.raises(PlanError, match="host applies to tiled regions"):
        Plan(regions=[Region("m", host=True)])
    with pytest.raises(PlanError, match="host applies to tiled regions"):
        Plan(regions=[Region("m", decision="tile", tile=[4], fuse=True, host=True)])
    plan = Plan(regions=HOST, verified_host_bytes=123)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "output on host" in plan.summary()
    data = plan.to_dict()
    for region in data["regions"]:
        del region["host"]  # a plan written before 'host' existed
    del data["verified_host_bytes"]
    assert not any(r.host for r in Plan.from_dict(data).regions)


@pytest.mark.slow
@pytest.mark.parametrize("fuse", ["host", "chain+host"])
def test_nnunet_layouts_with_host_outputs_equal_the_untiled_step(fuse: str) -> None:
    """The planner's host layouts on MONAI's DynUNet (two levels tiled: the skip and the
    half-resolution map on the host), in float64 on the CPU."""
    from remat3d import zoo
    from remat3d.planner.stages import build_stages
    from remat3d.planner.tiled_plans import layout_regions
    from remat3d.planner.tiling import layouts

    shape = (1, 1, 64, 64, 64)  # the least that leaves the bottleneck more than one voxel
    torch.manual_seed(0)
    net = zoo.build_model("nnunet", spatial_size=shape[2:])
    prof = remat3d.profile(net, shape, device="meta")
    net = net.double()
    stages = build_stages(prof.graph)
    layout = next(lay for lay in layouts(prof.graph, stages, [True] * len(stages.stages),
                                         tiles=(32,), host=True)
                  if lay.depth == 2 and lay.fuse == fuse)
    regions = layout_regions(stages, layout)
    assert sum(r.host for r in regions) >= 2
    tiled = copy.deepcopy(net)
    remat3d.apply(tiled, Plan(regions=regions))
    x = torch.randn(shape, dtype=torch.float64)
    assert_same_step(_step(net, x), _step(tiled, x), 1e-9)

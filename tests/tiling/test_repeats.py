"""Repeated tiles on meta are booked, not run (NOTE [ Repeats on meta ] in
``instrument/tracker.py``): what a tiled step measures is the same with and without.

Peaks, their breakdown and the module at the peak, every FLOP count, host memory and the
whole timeline (op, phase and live bytes of every event) are compared on tiled plans:
every kind of normalisation (batch statistics gathered over tiles, backward sums), fused
regions, host-resident outputs, a tile that does not divide the volume, and a plan the
planner chooses.
"""

from __future__ import annotations

import pytest
import torch

import remat3d
import remat3d.measurement
from remat3d.instrument.step import meta_copy, prepare_step, run_step
from remat3d.planspec import Plan, Region
from tests.tiling.test_norms import NORM_NAMES, _dynunet


def _measured(model, plan, shape, replays, amp=None):
    copy_ = remat3d.apply(meta_copy(model), plan)
    setup = prepare_step(copy_, (torch.empty(shape, device="meta"),), "meta", amp, None)
    tracker = run_step(setup, replays=replays)
    try:
        return {
            "peak": tracker.peak_bytes,
            "breakdown": tracker.peak_breakdown(),
            "at": tracker.peak_modules(),
            "flops": dict(tracker.flops),
            "host": tracker.host_peak_bytes,
            "timeline": [(e.op, e.phase, e.live_before, e.live_after)
                         for e in tracker.timeline],
        }
    finally:
        tracker.close()


def _same_with_and_without(model, plan, shape, amp=None):
    ran = _measured(model, plan, shape, replays=False, amp=amp)
    booked = _measured(model, plan, shape, replays=True, amp=amp)
    assert booked == ran
    return ran


@pytest.mark.parametrize("norm", ["instance", "group-affine", "batch"])
def test_a_tiled_step_measures_the_same_with_repeats_booked(norm):
    net = _dynunet(NORM_NAMES[norm], torch.float32)
    shape = (1, 1, 16, 16, 16)
    # 4 x 4 tiles (9 shapes), host-resident or fused; tiles that do not divide the volume
    for tile, host in (([16, 4, 4], False), ([16, 4, 4], True), ([16, 6, 5], False)):
        plan = Plan(regions=[
            Region("input_block", decision="tile", tile=tile, fuse=not host, host=host),
            Region("downsamples.0", decision="tile", tile=[t // 2 for t in tile]),
            Region("upsamples.1", decision="tile", tile=tile, host=host)])
        ran = _same_with_and_without(net, plan, shape)
        assert ran["flops"]["recompute"] > 0


def test_under_autocast_and_for_the_plan_the_planner_chooses():
    net = _dynunet(NORM_NAMES["instance"], torch.float32)
    shape = (1, 1, 32, 32, 32)
    plan = remat3d.plan(net, shape, budget="0.5x", graph=False)
    assert plan.tiled, plan.summary()
    _same_with_and_without(net, plan, shape)
    tiles = Plan(regions=[Region("input_block", decision="tile", tile=[32, 8, 8], fuse=True),
                          Region("upsamples.1", decision="tile", tile=[32, 8, 8])],
                 amp="bf16")
    _same_with_and_without(net, tiles, shape, amp="bf16")


def test_repeats_are_booked_where_measure_runs_and_save_work(monkeypatch):
    # what plans are verified with books repeats; the same numbers either way, and the
    # tiles it books are ops that did not run
    net = _dynunet(NORM_NAMES["instance"], torch.float32)
    plan = Plan(regions=[Region("input_block", decision="tile", tile=[32, 8, 8])])
    shape = (1, 1, 32, 32, 32)
    counts = {}
    for replays in (False, True):
        monkeypatch.setattr(remat3d.measurement, "_REPLAYS", replays)
        ops = []
        monkeypatch.setattr(remat3d.runtime.tiling.tiled.TiledRun, "run_tile", _counting(ops))
        m = remat3d.measure(remat3d.apply(meta_copy(net), plan),
                            torch.empty(shape, device="meta"), device="meta")
        counts[replays] = (len(ops), m.peak_bytes, m.flops)
    assert counts[True][1:] == counts[False][1:]
    assert counts[True][0] < counts[False][0] * 0.75  # 16 tiles a pass, 9 shapes


def _counting(calls):
    original = remat3d.runtime.tiling.tiled.TiledRun.run_tile

    def run_tile(self, k, *args, **kwargs):
        calls.append(k)
        return original(self, k, *args, **kwargs)

    return run_tile

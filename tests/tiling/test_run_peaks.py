"""What each tiled run held (``Measurement.tiled_peaks``, ``MemoryTracker.window``): the
planner's room for what only one run holds (its stashes, its working set run whole)."""

from __future__ import annotations

import torch

import remat3d
from remat3d.instrument.step import meta_copy
from remat3d.instrument.tracker import MemoryTracker
from remat3d.planspec import Plan, Region
from tests.tiling.test_fused import TinyUNet

SHAPE = (1, 1, 32, 32, 32)


def test_each_tiled_run_reports_what_its_passes_held() -> None:
    plan = Plan(regions=[Region("stem", decision="tile", tile=[16] * 3),
                         Region("down", decision="tile", tile=[8] * 3),
                         Region("up", decision="tile", tile=[16] * 3, fuse=True),
                         Region("head", decision="tile", tile=[16] * 3)])
    net = meta_copy(TinyUNet())
    remat3d.apply(net, plan)
    m = remat3d.measure(net, SHAPE, device="meta")
    # "up" is fused: it runs inside the head's run, booked there
    assert set(m.tiled_peaks) == {"stem", "down", "head"}  # the regions' labels
    for label, parts in m.tiled_peaks.items():
        # every run has normalisations (the head's through the fused "up"): sums passes
        assert set(parts) == {"forward", "sums", "final"}, label
        assert all(0 < v <= m.peak_bytes for v in parts.values())
    # the step's peak is reached inside one of them, in backward
    assert max(max(parts.values()) for parts in m.tiled_peaks.values()) == m.peak_bytes
    # the backward's final pass holds the whole input gradient the forward passes do not
    stem = m.tiled_peaks["stem"]
    assert stem["final"] > stem["forward"]


def test_a_window_is_what_was_live_while_it_ran() -> None:
    with MemoryTracker("meta") as tracker:
        a = torch.empty(1000, device="meta")
        with tracker.window("w", "one"):
            b = torch.empty(500, device="meta")
            del b
        with tracker.window("w", "one"):
            pass
        with tracker.window("w", "two"):
            c = torch.empty(2000, device="meta")
        del a, c
    assert tracker.window_peaks() == {"w": {"one": 6000, "two": 12000}}

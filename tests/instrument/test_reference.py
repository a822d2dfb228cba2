"""The tracker against an independent measure (the CPU allocator) for every zoo preset."""

from __future__ import annotations

import pytest

from remat3d import zoo
from remat3d.bench.tracker_report import validate_preset

SLOW = {"swinunetr"}  # about a minute of CPU; run with -m slow


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in zoo.preset_names()])
def test_tracker_matches_allocator_and_flops_match_flop_counter(name):
    row = validate_preset(name)
    assert row.peak_error <= 0.02, row
    assert row.tracker_flops == row.flop_counter_flops
    # scratch inside kernels can only add to what lives at op boundaries
    assert row.allocator_peak_with_scratch >= row.allocator_peak

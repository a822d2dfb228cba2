"""``remat3d bench graph-tiles``: its table rows, on a small case."""

from __future__ import annotations

import pytest

from remat3d.bench import graph_tiles_report as report


def test_cases_parse():
    case = report._Case.parse("nnunetv2:512:bf16:24GiB")
    assert (case.model, case.size, case.amp, case.budget) == ("nnunetv2", 512, "bf16", "24GiB")
    assert report._Case.parse("unet:64:none:1GiB").amp is None


@pytest.mark.slow
def test_a_row_names_the_tiled_plan_or_the_smallest_peak(capsys):
    pytest.importorskip("dynamic_network_architectures")
    report.main(["--cases", "nnunetv2:64:none:0.25x"])
    out = capsys.readouterr().out
    row = out.strip().splitlines()[-1]
    assert row.startswith("| nnunetv2 64³ fp32 | 0.25x |")
    assert "grid(s), tile" in row or "infeasible: smallest" in row

"""``remat3d.bench.cuda_check`` on CPU: the same code the GPU check runs, at 16³."""

from __future__ import annotations

import json
import time

import pytest
import torch

import remat3d
from remat3d import zoo
from remat3d.bench.cuda_check import CaseTimeout, _time_limit, exactness_row, main, markdown
from remat3d.errors import InfeasibleBudgetError


@pytest.mark.parametrize("how", ["blocks:recompute", "blocks:offload",
                                 "blocks:save-compute-heavy"])
def test_exactness_row_compares_a_planned_step_bitwise(how: str) -> None:
    row = exactness_row("segresnet", 16, how, None, "cpu")
    assert row["regions"] > 0 and row["bitwise_equal"], row
    assert row["max_rel_grad_diff"] == 0.0


# -m slow: 30 s of planning at 64^3; the rows and the report's parts are tested above
@pytest.mark.slow
def test_main_measures_plans_and_writes_the_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    shape = (1, 1, 16, 16, 16)
    model = zoo.build_model("segresnet", spatial_size=shape[2:])
    try:
        remat3d.plan(model, shape, budget=1, tile=False)
    except InfeasibleBudgetError as exc:
        plan = remat3d.plan(model, shape, budget=exc.smallest_feasible_bytes, tile=False)
    plan.save(tmp_path / "p.json")
    out = tmp_path / "out"
    main(["--device", "cpu", "--repeats", "1", "--unplanned", "segresnet:1x1x16x16x16:none",
          "--plan", f"segresnet:{tmp_path / 'p.json'}", "--out", str(out)])
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["unplanned", "planned"]
    assert not any("error" in r for r in rows), rows
    unplanned, planned = rows
    # the tracker's step on CPU is the meta step the plan was verified at, within what CPU
    # kernels allocate otherwise (43 KB here; on an H200 within 25 KB, docs/gpu.md)
    assert planned["tracker_peak"] == pytest.approx(planned["verified_peak"], rel=0.01)
    assert planned["tracker_peak"] < unplanned["tracker_peak"]
    assert planned["seconds"] > 0 and planned["allocator_peak"] is None  # CPU: no allocator
    report = (out / "report.md").read_text()
    assert "p.json" in report and "| segresnet | 1x1x16x16x16 | None | none |" in report


def test_a_case_past_its_time_is_stopped() -> None:
    start = time.monotonic()
    with pytest.raises(CaseTimeout), _time_limit(0.2):
        while time.monotonic() - start < 10:  # without the limit: no exception, a failure
            torch.ones(8).sum()
    assert time.monotonic() - start < 5


def test_the_report_names_a_failed_case_in_place_of_its_numbers() -> None:
    rows = [{"kind": "planned", "preset": "nnunet", "plan": "p.json", "shape": [],
             "amp": None, "error": "TypeError: no"}]
    report = markdown(rows, "header")
    assert "| nnunet |  | None | p.json | failed: TypeError: no |" in report
    assert report.count("failed") == 1 and "exactness" not in report


def test_one_step_cases_time_the_warm_up_and_may_leave_out_the_tracker() -> None:
    from remat3d.bench.cuda_check import unplanned_row

    row = unplanned_row("segresnet", [1, 1, 16, 16, 16], None, "cpu", 0, track=False)
    assert row["seconds_all"] == [row["warmup_s"]] and row["timed_steps"] == 0
    assert row["tracker_peak"] is None and row["verified_peak"] > 0
    report = markdown([row], "header")
    assert "| segresnet | 1x1x16x16x16 | None | none | 0 | no |" in report
    assert " — | — | — | 1.00 |" in report  # no tracker, no allocator on CPU: no ratio


def test_a_negative_repeat_count_is_one_clear_error(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--repeats", "-1", "--out", str(tmp_path)])
    assert "--repeats -1" in capsys.readouterr().err

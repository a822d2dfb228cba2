"""remat3d bench: a tiny suite end to end (CLI included), the schema, the baselines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import remat3d
from remat3d.bench import BENCH_SCHEMA, load_results, validate_results
from remat3d.bench.baselines import (
    install_block_checkpoints,
    install_checkpoint_sequential,
)
from remat3d.bench.compiled import budget_context, compiled_step, measure_cast_step
from remat3d.cli import app
from remat3d.errors import Remat3dError
from remat3d.instrument.reference import allocator_measure
from remat3d.instrument.step import prepare_step

TINY_NET = str(Path(__file__).with_name("tiny_net.py"))
REQUIRED = ("model", "input_shape", "amp", "method", "budget_bytes", "peak_bytes",
            "saved_bytes", "flops", "recompute_flops", "step_time_ratio", "plan_seconds",
            "grads_equal", "machine", "date", "versions")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = CliRunner().invoke(app, ["bench", "--suite", "tiny", "--models", TINY_NET,
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_tiny_suite_writes_valid_results_report_and_plots(tiny):
    out, output = tiny
    data = json.loads((out / "results.json").read_text())
    assert data["schema"] == BENCH_SCHEMA and data["suite"] == "tiny"
    records = load_results(out / "results.json")
    for raw in data["records"]:
        assert set(REQUIRED) <= raw.keys()
    methods = {(r.tier, r.method) for r in records if r.status == "ok"}
    for method in ("none", "torch-blocks", "checkpoint-sequential", "remat3d:blocks",
                   "remat3d:optimal"):
        assert ("meta", method) in methods and ("cpu", method) in methods
    for r in records:
        if r.tier == "cpu" and r.status == "ok":
            # exactness: every method's gradients equal the unplanned step's bitwise
            assert r.grads_equal is True, r
            assert r.step_time_ratio is not None and r.step_time_ratio > 0
            # torch's checkpoint updates BatchNorm statistics again when it recomputes
            # (pytorch 96136); remat3d's regions update them once
            torch_checkpoint = r.method in ("torch-blocks", "checkpoint-sequential")
            assert r.buffers_equal is not torch_checkpoint, r
        if r.method.startswith("remat3d:optimal") and r.status == "ok":
            assert r.peak_bytes <= r.budget_bytes, (r.tier, r.setting, r.note)  # a promise
            assert r.plan_seconds is not None
    report = (out / "report.md").read_text()
    assert "Headline" in report and "Equal peak" in report and "grads equal" in report
    assert (out / "overhead-curves.png").stat().st_size > 0
    assert (out / "peak-by-size.png").stat().st_size > 0
    assert "records in" in output
    assert not list(out.glob(".*tmp*"))  # nothing half-written left


def test_blocks_baseline_in_torch_equals_remat3d_blocks(tiny):
    out, _ = tiny
    records = [r for r in load_results(out / "results.json") if r.status == "ok"]
    for tier in ("meta", "cpu"):
        torch_blocks = [r for r in records if r.method == "torch-blocks" and r.tier == tier]
        ours = [r for r in records if r.method == "remat3d:blocks" and r.tier == tier]
        for a, b in zip(torch_blocks, ours):
            assert (a.peak_bytes, a.flops) == (b.peak_bytes, b.flops)


def test_blocks_suite_plans_optimal_at_per_block_checkpointings_peak(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--suite", "blocks", "--models", TINY_NET,
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    records = load_results(tmp_path / "results.json")
    (blocks,) = [r for r in records if r.method == "torch-blocks"]
    at = {r.method: r for r in records if r.setting == f"peak of torch-blocks {blocks.setting}"}
    assert set(at) == {"remat3d:optimal", "remat3d:modules"}
    for r in at.values():
        assert r.status == "ok" and r.peak_bytes <= r.budget_bytes == blocks.peak_bytes
        assert r.recompute_flops <= blocks.recompute_flops
    assert at["remat3d:optimal"].note.startswith("graph plan")  # chosen by optimal itself
    assert at["remat3d:modules"].note.endswith("regions")
    report = (tmp_path / "report.md").read_text()
    assert "## At per-block checkpointing's peak" in report and "| graph |" in report


def test_schema_rejects_broken_documents(tiny):
    out, _ = tiny
    data = json.loads((out / "results.json").read_text())
    validate_results(data)
    with pytest.raises(Remat3dError, match="schema"):
        validate_results({**data, "schema": "remat3d.bench/0"})
    broken = json.loads(json.dumps(data))
    del broken["records"][0]["peak_bytes"]
    with pytest.raises(Remat3dError, match="peak_bytes"):
        validate_results(broken)
    broken = json.loads(json.dumps(data))
    broken["records"][0]["status"] = "fine"
    with pytest.raises(Remat3dError, match="status"):
        validate_results(broken)


@pytest.mark.parametrize("args, message", [
    (["--suite", "huge"], "Unknown bench suite"),
    (["--models", "nnunett"], "Did you mean 'nnunet'"),
    (["--sizes", "12a"], "--sizes"),
    (["--budgets", "-1x"], "budget"),
])
def test_bad_options_are_one_line_exit_2(tmp_path, args, message):
    result = CliRunner().invoke(app, ["bench", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "results.json").exists()


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU()),
        nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 4, 1)),
        nn.Conv3d(4, 1, 1))


def test_compile_budget_is_measured_not_eager():
    shape = (1, 1, 16, 16, 16)
    _, keep = compiled_step(_net().to("meta"), shape, "meta", None, 1.0)
    compiled, recompute = compiled_step(_net(), shape, "cpu", None, 0.0)
    # dynamo falling back to eager would give the same figures for both budgets
    assert recompute.saved_bytes < keep.saved_bytes
    assert recompute.flops > keep.flops and keep.graphs == recompute.graphs == 1
    # the compiled step's tracker peak is the CPU allocator's at op boundaries
    with budget_context(0.0):
        allocator = allocator_measure(prepare_step(compiled, [torch.randn(shape)], "cpu",
                                                   None, None))
    assert allocator.peak_bytes == recompute.peak_bytes


def test_explicit_casts_match_meta_autocast():
    shape = (1, 1, 16, 16, 16)
    eager = measure_cast_step(_net().to("meta"), shape, "meta", "bf16")
    reference = remat3d.measure(_net().to("meta"), shape, device="meta", amp="bf16")
    assert (eager.peak_bytes, eager.saved_bytes) == (reference.peak_bytes,
                                                     reference.saved_bytes)


def test_checkpoint_sequential_lowers_saved_bytes_or_is_not_applicable():
    x = torch.randn(1, 1, 8, 8, 8)
    plain = remat3d.measure(_net(), x)
    net = _net()
    assert install_checkpoint_sequential(net, 2) == 1
    assert remat3d.measure(net, x).saved_bytes < plain.saved_bytes
    assert install_checkpoint_sequential(nn.Conv3d(1, 1, 1), 2) == 0
    blocks = _net()
    assert install_block_checkpoints(blocks, ["0", "1"]) == 2
    assert remat3d.measure(blocks, x).saved_bytes < plain.saved_bytes


def test_budget_rows_name_the_smallest_where_no_plan_fits():
    """``remat3d bench tiling --budgets``: the planning time of every budget comes from
    it, an infeasible one's (the search for the smallest the error names) included."""
    from remat3d.bench.tiling_report import budget_rows

    infeasible, fits = budget_rows("unet", ["1KiB", "1GiB"], size=32)
    assert infeasible["smallest_bytes"] > 1024 and infeasible["seconds"] > 0
    assert "peak_bytes" not in infeasible
    assert 0 < fits["peak_bytes"] <= 2**30 and fits["flops"] == 1.0


def test_equal_peak_rows_give_both_graph_objectives_at_compiles_peaks():
    from remat3d.bench.records import Record
    from remat3d.bench.report import equal_peak_rows

    def record(method, setting, peak, recompute):
        return Record(model="m", input_shape=[1, 1, 8, 8, 8], amp="none", method=method,
                      tier="meta", setting=setting, peak_bytes=peak, recompute_flops=recompute)

    at = "peak of compile memory_budget=0.5"
    rows = equal_peak_rows([
        record("none", "", 100, 0), record("compile", "memory_budget=0.5", 80, 10),
        record("remat3d:optimal", at, 79, 6), record("remat3d:graph", at, 79, 4),
        record("remat3d:graph:flops", at, 80, 2)])
    assert len(rows) == 1  # the graph rows are remat3d's, not baselines of their own
    row = rows[0]
    assert (row["ratio"], row["graph_ratio"], row["graph_flops_ratio"]) == (0.6, 0.4, 0.2)
    assert row["graph_flops"].method == "remat3d:graph:flops"

"""The command line: tables for people, JSON for machines, one-line errors."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from remat3d.cli import app

runner = CliRunner()


def test_help_lists_profile():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "profile" in result.output
    result = runner.invoke(app, ["profile", "--help"])
    assert result.exit_code == 0 and "--input" in result.output and "--json" in result.output


def test_profile_preset_prints_tables_and_writes_json(tmp_path):
    out = tmp_path / "prof.json"
    result = runner.invoke(app, ["profile", "nnunet", "--input", "1x1x64x64x64",
                                 "--amp", "bf16", "--json", str(out)])
    assert result.exit_code == 0, result.output
    for text in ("peak", "saved", "Top 12 modules", "resolution level", "64x64x64"):
        assert text in result.output
    data = json.loads(out.read_text())
    assert data["amp"] == "bf16" and data["input_shapes"] == [[1, 1, 64, 64, 64]]
    assert data["peak_bytes"] > data["saved_bytes"] > 0


def test_profile_json_to_stdout():
    result = runner.invoke(app, ["profile", "segresnet", "--input", "1x1x16x16x16",
                                 "--json", "-"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["nodes"]


def test_profile_class_spec_with_kwargs():
    result = runner.invoke(app, ["profile", "torch.nn:Conv3d", "--input", "1x1x8x8x8",
                                 "--model-kwargs",
                                 '{"in_channels": 1, "out_channels": 2, "kernel_size": 3}'])
    assert result.exit_code == 0, result.output
    assert "Conv3d" in result.output


def test_profile_model_file(tmp_path):
    spec = tmp_path / "net.py"
    spec.write_text("import torch\n\ndef build_model(width=4):\n"
                    "    return torch.nn.Sequential(torch.nn.Conv3d(1, width, 3), "
                    "torch.nn.ReLU())\n")
    result = runner.invoke(app, ["profile", str(spec), "--input", "1x1x8x8x8",
                                 "--model-kwargs", "width: 8"])
    assert result.exit_code == 0, result.output
    assert "1x8x6x6x6" in result.output


@pytest.mark.parametrize("args, message", [
    (["profile", "nnuet"], "Did you mean 'nnunet'"),
    (["profile", "nnunet", "--input", "1x1xfoo"], "Cannot read '1x1xfoo' as an input shape"),
    (["profile", "nnunet", "--input", "1x1x100x128x128"], "Pad to 1x1x128x128x128"),
    (["profile", "no_such_pkg.mod:Net"], "Cannot import module 'no_such_pkg.mod'"),
    (["profile", "nnunet", "--amp", "fp8", "--input", "1x1x64x64x64"], "none, bf16, fp16"),
    (["profile", "nnunet", "--model-kwargs", "[1, 2]"], "mapping"),
    (["plan", "basicunet", "--input", "1x1x32x32x32", "--budget", "1GiB", "--offload",
      "--host-budget", "lots"], "Cannot read 'lots' as a byte size"),
    # issue 19 point 5
    (["plan", "basicunet", "--input", "1x1x32x32x32", "--budget", "1e400"],
     "larger than any memory"),
    (["plan", "basicunet", "--input", "1x1x32x32x32", "--budget", "0.5"],
     "did you mean '0.5x'"),
    (["profile", "os:system", "--model-kwargs", '{"command": "echo pwned"}'],
     "must name an nn.Module class"),
    (["profile", "monai.networks.nets:SegResNet", "--model-kwargs",
      '{"blocks_down": [1, 2, 2, 4, 4, 4]}', "--input", "1x1x8x8x8"],
     "SegResNet's forward failed on a 1x1x8x8x8 float32 input: RuntimeError"),
    (["profile", "unet", "--model-kwargs",
      '{"strides": [2, 2, 2, 2, 2], "channels": [4, 8, 16, 32, 64, 128]}',
      "--input", "1x1x48x48x48"], "divisible by 32 .* Pad to 1x1x64x64x64"),
])
def test_user_errors_are_one_clear_line(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "error:" in text and re.search(message, text), text
    assert "Traceback" not in result.output


def test_a_preset_with_other_strides_takes_the_sizes_its_network_takes():
    """issue 19 point 5: the preset's default divisor (16) refused a legal 40³ for a UNet
    with three strides."""
    result = runner.invoke(app, ["profile", "unet", "--model-kwargs",
                                 '{"strides": [2, 2, 2], "channels": [4, 8, 16, 32]}',
                                 "--input", "1x1x40x40x40"])
    assert result.exit_code == 0, result.output


def test_plan_command_writes_plan_and_plot(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    result = runner.invoke(app, ["plan", "basicunet", "--input", "1x1x32x32x32",
                                 "--budget", "0.9x", "--out", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "verified" in result.output and png.stat().st_size > 10_000
    from remat3d import Plan

    plan = Plan.load(out)
    assert plan.verified_peak_bytes <= plan.budget_bytes


def test_plan_command_plans_the_graph(tmp_path):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "basicunet", "--input", "1x1x32x32x32",
                                 "--budget", "0.8x", "--graph", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "recomputed in backward" in " ".join(result.output.split())
    from remat3d import Plan

    plan = Plan.load(out)
    assert plan.graph_recompute and plan.verified_peak_bytes <= plan.budget_bytes
    # where: a row per module whose forward runs what the plan recomputes
    assert plan.graph_modules and "ops recomputed" in result.output
    for module, ops in plan.recomputed_where():
        assert module.split(".")[-1] in result.output
    result = runner.invoke(app, ["plan", "basicunet", "--input", "1x1x32x32x32",
                                 "--budget", "0.6x", "--graph", "--offload"])
    assert result.exit_code == 2 and "Graph plans do not take offload" in result.output


def test_plan_command_plans_for_the_fewest_flops(tmp_path):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "basicunet", "--input", "1x1x32x32x32",
                                 "--budget", "0.8x", "--graph", "--objective", "flops",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    from remat3d import Plan

    assert Plan.load(out).objective == "flops"
    result = runner.invoke(app, ["plan", "basicunet", "--input", "1x1x32x32x32",
                                 "--budget", "0.8x", "--objective", "memory"])
    assert result.exit_code == 2 and "objective='memory' is not one of" in result.output
    assert "Traceback" not in result.output


def test_plan_command_plans_for_compilation(tmp_path):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "basicunet", "--input", "1x1x32x32x32",
                                 "--budget", "0.9x", "--no-tile", "--compiled", "--out",
                                 str(out)])
    assert result.exit_code == 0, result.output
    from remat3d import Plan

    plan = Plan.load(out)  # a graph plan, compiled by inductor when applied
    assert plan.graph_recompute and plan.graph_backend == "inductor"
    assert "compiled by inductor" in result.output
    result = runner.invoke(app, ["plan", "basicunet", "--input", "1x1x32x32x32",
                                 "--budget", "0.9x", "--no-tile", "--compiled",
                                 "--no-graph", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)  # recompute regions, for torch.compile to capture
    assert not plan.rebuild_saved and plan.graph_recompute is None and plan.regions
    result = runner.invoke(app, ["plan", "basicunet", "--input", "1x1x32x32x32",
                                 "--budget", "0.9x", "--compiled", "--offload"])
    assert result.exit_code == 2 and "does not offload" in result.output


@pytest.mark.slow  # 30-45 s: the planner's own tiling test covers it by default
def test_plan_command_tiles_below_the_recomputation_floor():
    import remat3d
    from remat3d import zoo
    from remat3d.errors import InfeasibleBudgetError

    with pytest.raises(InfeasibleBudgetError) as info:
        remat3d.plan(zoo.build_model("basicunet"), (1, 1, 32, 32, 32), budget=1)
    smallest = str(info.value.smallest_feasible_bytes)
    result = runner.invoke(app, ["plan", "basicunet", "--input", "1x1x32x32x32",
                                 "--budget", smallest])
    assert result.exit_code == 0, result.output
    assert "tile" in result.output and "extra +" in result.output
    result = runner.invoke(app, ["plan", "basicunet", "--input", "1x1x32x32x32",
                                 "--budget", smallest, "--no-tile"])
    assert result.exit_code == 2 and "--tile" in result.output


def test_plan_command_infeasible_budget_is_one_line():
    result = runner.invoke(app, ["plan", "basicunet", "--input", "1x1x32x32x32",
                                 "--budget", "1MB", "--no-tile"])
    assert result.exit_code == 2
    assert "smallest feasible budget" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_error_messages_are_printed_as_text_not_markup(capsys) -> None:  # type: ignore[no-untyped-def]
    """Brackets in a message reach the user: rich would drop ``[demo]`` as a markup tag
    (a wrong install command) and raise on ``[/x]``."""
    import typer

    from remat3d.cli.common import user_errors
    from remat3d.errors import Remat3dError

    def command() -> None:
        raise Remat3dError("Install it with: pip install 'remat3d[demo]' (see [/docs])")

    with pytest.raises(typer.Exit):
        user_errors(command)()
    err = capsys.readouterr().err
    assert "pip install 'remat3d[demo]' (see [/docs])" in " ".join(err.split())


@pytest.mark.parametrize("report", ["tiling", "reversible", "tracker", "gpu"])
def test_bench_report_subcommands_hand_their_options_over(report: str) -> None:
    result = runner.invoke(app, ["bench", report, "--help"])
    assert result.exit_code == 0, result.output
    assert f"remat3d bench {report}" in result.output  # the report's own argparse usage


def test_bench_without_out_or_subcommand_says_what_to_give() -> None:
    result = runner.invoke(app, ["bench", "--suite", "tiny"])
    assert result.exit_code == 2
    assert "--out" in result.output and "tiling" in result.output


def test_planning_shows_the_librarys_progress_and_leaves_logging_as_it_was():
    """`remat3d plan` shows what the planner is doing (its INFO records, from the
    `remat3d` logger) in the spinner while it works; afterwards, and after an error, the
    logger has the handlers and level it had."""
    import logging

    import torch

    import remat3d
    from remat3d.cli.common import _StatusHandler, progress

    updates: list[str] = []

    class Status:
        def update(self, text: str) -> None:
            updates.append(text)

    handler = _StatusHandler(Status(), "planning x")
    handler.handle(logging.LogRecord("remat3d.planning", logging.INFO, __file__, 1,
                                     "verifying a candidate plan on meta: %d regions", (3,),
                                     None))
    assert re.fullmatch(r"planning x · \d+ s · verifying a candidate plan on meta: 3 regions",
                        updates[-1])

    logger = logging.getLogger("remat3d")
    before = (list(logger.handlers), logger.level)
    with pytest.raises(RuntimeError), progress("planning y"):
        assert logger.getEffectiveLevel() <= logging.INFO
        raise RuntimeError("interrupted")
    assert (list(logger.handlers), logger.level) == before

    # what the planner says while it works: the unplanned step, the module search, each
    # verified candidate
    net = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Conv3d(4, 4, 3, padding=1), torch.nn.GroupNorm(2, 4),
        torch.nn.Conv3d(4, 4, 1)) for _ in range(4)])
    said: list[str] = []
    listener = logging.Handler(logging.INFO)
    listener.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(listener)
    logger.setLevel(logging.INFO)
    try:
        remat3d.plan(net, (1, 4, 16, 16, 16), budget="0.6x", graph=False)
    finally:
        logger.removeHandler(listener)
        logger.setLevel(before[1])
    assert said[0] == "measuring the unplanned step on meta"
    assert any(m.startswith("searching module plans") for m in said)
    assert any(m.startswith("verifying a candidate plan on meta") for m in said)

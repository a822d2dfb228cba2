"""`remat3d train` and `remat3d demo` on the command line: results for people, one red line
and exit status 2 for every bad input, never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from remat3d.cli import app
from tests.data.volumes import blob_case, write_dataset, write_volume

runner = CliRunner()
UNET = {"channels": [4, 8, 16], "strides": [2, 2], "num_res_units": 1, "out_channels": 3}


def config(tmp_path, **values):
    settings = {"model": "unet", "model_kwargs": UNET, "data": "data/dataset.json",
                "epochs": 1, "memory_budget": "0.8x", "strategy": "blocks",
                "output_dir": str(tmp_path / "run"), "progress": False, **values}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


@pytest.fixture()
def data(tmp_path):
    write_dataset(tmp_path / "data", cases=2, validation=1, shape=(20, 20, 16))
    return tmp_path


def test_train_runs_and_reports(data):
    # a path longer than the terminal is wide: it is printed whole, never broken over lines
    # (CI's deeper checkout once broke 'model.pt' in two), so it can be copied as it is
    out = data / ("a-long-folder-name-" * 6) / "out"
    result = runner.invoke(app, ["train", str(config(data)), f"--output_dir={out}",
                                 "--epochs=2"])
    assert result.exit_code == 0, result.output
    for text in ("plan for 1x1x20x20x16", "validation Dice", "2 epochs, 4 optimizer steps",
                 "measured step peak", str(out / "model.pt"), str(out / "log.jsonl")):
        assert text in result.output, text
    assert (out / "model.pt").is_file() and (out / "state.pt").is_file()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def corrupt(kind, root):
    images = root / "data" / "imagesTr"
    if kind == "truncated":
        raw = (images / "case0.nii.gz").read_bytes()
        (images / "case0.nii.gz").write_bytes(raw[: len(raw) // 3])
    elif kind == "nan":
        image, _ = blob_case((20, 20, 16), 0)
        image[3, 3, 3] = np.nan
        write_volume(images / "case0.nii.gz", image)
    elif kind == "shape":
        image, _ = blob_case((20, 20, 14), 0)
        write_volume(images / "case0.nii.gz", image)
    elif kind == "affine":
        image, _ = blob_case((20, 20, 16), 0)
        write_volume(images / "case0.nii.gz", image, np.diag([3.0, 2.0, 2.0, 1.0]))
    elif kind == "channels":
        image, _ = blob_case((20, 20, 16), 0)
        write_volume(images / "case0.nii.gz", np.stack([image, image], axis=-1))
    elif kind == "small":
        image, label = blob_case((3, 20, 16), 0)  # the UNET takes 8 at least
        write_volume(images / "case0.nii.gz", image)
        write_volume(root / "data" / "labelsTr" / "case0.nii.gz", label)
    elif kind == "empty":
        (root / "data" / "dataset.json").write_text('{"training": []}')
    elif kind == "renamed":  # a text file under a NIfTI name
        (images / "case0.nii.gz").write_text("patient notes, not an image\n" * 20)


@pytest.mark.parametrize("kind, message", [
    ("truncated", r"Cannot read .*case0\.nii\.gz.*truncated"),
    ("nan", r"case0\.nii\.gz' has 1 NaN/Inf voxel"),
    ("shape", r"label .*case0\.nii\.gz' has shape \(20, 20, 16\) but its image"),
    ("affine", r"case0\.nii\.gz' .* different affines"),
    ("channels", r"case0.nii.gz.\) has 2 channel\(s\) but the model takes 1"),
    ("small", r"case0.*3x20x16 voxels.*at least 8"),
    ("empty", r"lists no training cases"),
    # issue 19 point 5: MONAI's advice to install reader libraries, cut off mid-URL
    ("renamed", (r"case0\.nii\.gz' as an image: no image reader recognises its contents\. "
                 r"The file may be truncated, or not a NIfTI file")),
])
def test_bad_data_is_one_line_before_training(data, kind, message):
    import re

    corrupt(kind, data)
    result = runner.invoke(app, ["train", str(config(data))])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "error:" in result.output
    text = " ".join(result.output.split())
    assert re.search(message, text), result.output
    assert "install" not in text and "https://" not in text
    assert not (data / "run" / "state.pt").exists()  # refused before training started


@pytest.mark.parametrize("extra, message", [
    (["--epoch=2"], "Unknown setting 'epoch'"),
    (["--amp=fp8"], "amp='fp8' is invalid"),
    (["--pretrained=missing.pt"], "missing.pt' do not exist"),
    (["--model=nosuchnet"], "Unknown model preset 'nosuchnet'"),
    (["--memory_budget=1KB"], "does not even hold the optimizer state"),
    (["--memory_budget=1e400"], "1e400"),
    (["--memory_budget=0.5"], "did you mean '0.5x'"),
    (["--freeze=[encoder.*]"], "'encoder.*' matches no parameter"),
    (["stray"], "expected --key=value"),
])
def test_bad_settings_are_one_line(data, extra, message):
    result = runner.invoke(app, ["train", str(config(data)), *extra])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert not (data / "run").exists()  # nothing written for a run that cannot start
    assert message in " ".join(result.output.split()), result.output


def test_a_new_run_refuses_a_folder_holding_a_run(data):
    """issue 19 point 3: a second `train` into a finished run's folder overwrote it."""
    cfg = str(config(data))
    assert runner.invoke(app, ["train", cfg]).exit_code == 0
    weights = (data / "run" / "model.pt").read_bytes()
    log = (data / "run" / "log.jsonl").read_text()
    again = runner.invoke(app, ["train", cfg])
    assert again.exit_code == 2 and "Traceback" not in again.output
    text = " ".join(again.output.split())
    assert "already holds a run" in text and "--resume" in text and "--overwrite" in text
    assert (data / "run" / "model.pt").read_bytes() == weights
    assert (data / "run" / "log.jsonl").read_text() == log
    assert runner.invoke(app, ["train", cfg, "--overwrite"]).exit_code == 0


def test_the_interrupt_hint_repeats_the_overrides(data, monkeypatch):
    """issue 19 point 3: the Ctrl-C hint dropped --key=value, so following it said
    "Nothing to resume" (another output_dir)."""
    import remat3d.train

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(remat3d.train, "train", interrupted)
    out = data / "elsewhere dir"
    result = runner.invoke(app, ["train", str(config(data)), f"--output_dir={out}",
                                 "--epochs=2"])
    assert result.exit_code == 130
    hint = " ".join(result.output.split())
    assert f"'--output_dir={out}' --epochs=2 --resume" in hint, hint


def test_paths_in_the_settings_file_are_relative_to_it(data, monkeypatch, tmp_path_factory):
    """issue 19 point 3: output_dir resolved against the current directory while data
    resolved against the file (docs/training.md: every path is relative to the file)."""
    from remat3d.train import load_settings

    path = config(data, output_dir="runs/a", lr="1e-3")
    cwd = tmp_path_factory.mktemp("elsewhere")
    monkeypatch.chdir(cwd)
    settings = load_settings(path)
    assert settings.output_dir == str(data / "runs" / "a")
    assert settings.data == str(data / "data" / "dataset.json")
    assert settings.lr == 1e-3  # YAML reads 1e-3 as text: accepted as the number
    flag = load_settings(path, ["--output_dir=runs/b"])
    assert flag.output_dir == "runs/b"  # a flag's path is the shell's: from here


def test_a_preset_with_other_strides_pads_to_its_networks_divisor(data):
    """issue 19 point 5: the preset's default divisor (16 for unet) padded these 20x20x16
    volumes to 32³ whatever the strides; the divisor now comes from the network built
    (three strides: 8)."""
    result = runner.invoke(app, ["train", str(config(data)), "--epochs=1",
                                 "--model_kwargs.strides=[2,2,2]",
                                 "--model_kwargs.channels=[4,4,4,4]"])
    assert result.exit_code == 0, result.output
    assert "plan for 1x1x24x24x16" in result.output


def test_resume_without_a_run(data):
    result = runner.invoke(app, ["train", str(config(data)), "--resume"])
    assert result.exit_code == 2 and "Nothing to resume" in result.output


# The killed run: the real CLI in a process that SIGKILLs itself right after the training
# state of optimizer step 3 (mid-epoch) is on disk. Deterministic, unlike polling the state
# file from outside (a loaded machine could miss every save before the run ended).
_KILLED_AFTER_SAVE = """
import os, signal, sys
import remat3d.train.fit as fit
from remat3d.cli import main
written = fit.save_state
def save_then_die(folder, state):
    written(folder, state)
    if state["step"] >= 3:
        os.kill(os.getpid(), signal.SIGKILL)
fit.save_state = save_then_die
sys.argv = ["remat3d", *sys.argv[1:]]
main()
"""


def test_killed_process_resumes_to_the_same_weights(data):
    """A real kill (SIGKILL) mid-run, then --resume, against an uninterrupted run."""
    cfg = config(data, epochs=3, save_every=1)
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    command = [sys.executable, "-m", "remat3d", "train", str(cfg)]
    whole = subprocess.run([*command, f"--output_dir={data / 'whole'}"], env=env,
                           capture_output=True, text=True, timeout=600, check=False)
    assert whole.returncode == 0, whole.stderr

    killed_dir = data / "killed"
    killed = subprocess.run([sys.executable, "-c", _KILLED_AFTER_SAVE, "train", str(cfg),
                             f"--output_dir={killed_dir}"], env=env, capture_output=True,
                            text=True, timeout=600, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    saved = torch.load(killed_dir / "state.pt", weights_only=True)
    assert saved["step"] == 3 and saved["epoch"] == 1 and saved["position"] == 1
    assert not (killed_dir / "model.pt").exists()  # the run did not finish
    resumed = subprocess.run([*command, f"--output_dir={killed_dir}", "--resume"], env=env,
                             capture_output=True, text=True, timeout=600, check=False)
    assert resumed.returncode == 0, resumed.stderr
    a = torch.load(data / "whole" / "model.pt", weights_only=True)
    b = torch.load(killed_dir / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_demo_small(tmp_path):
    from remat3d.train.demo import run_demo

    result = run_demo(tmp_path / "demo", pretrain_epochs=1, finetune_epochs=1, spacing=6.0,
                      budget="0.8x", progress=False, say=lambda m: None)
    assert result.gradients_equal, result.gradient_check
    assert result.peak_planned < result.peak_unplanned
    assert result.figure.is_file() and result.figure.stat().st_size > 10_000
    assert 0 <= result.dice_before <= 1 and 0 <= result.dice_after <= 1
    assert "recompute" in result.plan_summary


@pytest.mark.slow
def test_demo_command_defaults(tmp_path):
    """The README's main job, as shipped (a few minutes on 2 CPU cores)."""
    result = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo")])
    assert result.exit_code == 0, result.output
    for text in ("remat3d plan", "no checkpointing", "bitwise equal", "Dice", "demo.png"):
        assert text in result.output, text

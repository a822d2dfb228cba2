"""torchrun with 2 CPU processes (gloo): DDP and FSDP2 steps equal one process accumulating
the same two volumes, bit for bit; FSDP2 recomputation adds no all-gather; a run saved with
2 processes resumes with 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.data.volumes import write_dataset

UNET = {"channels": [4, 8, 16], "strides": [2, 2], "num_res_units": 1, "out_channels": 3,
        "norm": "instance"}  # no BatchNorm: DDP keeps rank 0's running statistics (NOTE)
HERE = Path(__file__).parent
OUTPUTS: dict[Path, str] = {}  # each run's standard output, by its output folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    write_dataset(root / "data", cases=4, validation=1, shape=(20, 20, 16))
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": "unet", "model_kwargs": UNET, "data": "data/dataset.json", "epochs": 2,
        "memory_budget": "0.8x", "strategy": "blocks", "progress": False, "seed": 3}))
    single = run(root, [sys.executable, "-m", "remat3d"], config, "single", "--accumulate=2")
    return root, config, single


def rank_env() -> dict[str, str]:
    # (PYTHONFAULTHANDLER: a rank that dies of a signal prints every thread's stack)
    return {**os.environ, "PYTHONPATH": str(HERE.parents[1]), "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1"}


def run(root, launcher, config, name, *extra):
    result = subprocess.run([*launcher, "train", str(config), f"--output_dir={root / name}",
                             *extra], env=rank_env(), capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    OUTPUTS[root / name] = result.stdout + result.stderr
    return root / name


def torchrun(processes: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={processes}", "-m", "remat3d"]


def step_losses(folder):
    return [r["loss"] for r in map(json.loads, (folder / "log.jsonl").read_text().splitlines())
            if r["event"] == "step"]


# ddp with -m slow (17 s): DDP runs by default in the other tests here (resume with
# another world size), FSDP2 here
@pytest.mark.parametrize("mode", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_two_processes_equal_one_accumulating_process(setup, mode):
    root, config, single = setup
    out = run(root, torchrun(), config, mode, f"--distributed={mode}")
    a = torch.load(single / "model.pt", weights_only=True)
    b = torch.load(out / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # each logged step is the mean over both ranks = the mean of the two micro-batches
    one = step_losses(single)
    assert step_losses(out) == [(one[i] + one[i + 1]) / 2 for i in range(0, len(one), 2)]
    state = torch.load(out / "state.pt", weights_only=True)
    assert state["world_size"] == 2 and state["step"] == 4
    assert not (out / "log.jsonl.tmp").exists()


def test_resume_with_another_world_size(setup):
    root, config, _ = setup
    out = run(root, torchrun(), config, "resize", "--distributed=fsdp", "--epochs=1")
    saved = torch.load(out / "state.pt", weights_only=True)
    assert saved["epoch"] == 1 and saved["step"] == 2
    run(root, [sys.executable, "-m", "remat3d"], config, "resize", "--epochs=2", "--resume")
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert [r["epoch"] for r in steps] == [1, 1, 2, 2, 2, 2]  # 2 global steps, then 4 alone
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]


def test_fsdp_recomputation_adds_no_all_gather(setup):
    root, config, _ = setup
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(HERE / "fsdp_collectives.py"), str(config)],
        env=rank_env(), capture_output=True, text=True, timeout=600, check=False, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts["regions"] > 0 and counts["plain"] > 0
    assert counts["planned"] == counts["plain"]


# -m slow (30 s: two more runs); the trainer's graph plans run by default in
# tests/train/test_train.py and the demo, DDP's module plans above
@pytest.mark.slow
def test_ddp_with_a_graph_plan_equals_one_accumulating_process(setup, tmp_path):
    """``optimal`` gives the trainer a graph plan (the step's aten graph, its loss the
    trainer's Dice+CE); under DDP its backward feeds DDP's gradient hooks like any other
    step: two processes equal one accumulating the same volumes, bit for bit."""
    root, config, _ = setup
    optimal = tmp_path / "optimal.yaml"
    optimal.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()),
                                       "strategy": "optimal", "memory_budget": "0.9x",
                                       "data": str(root / "data" / "dataset.json")}))
    single = run(tmp_path, [sys.executable, "-m", "remat3d"], optimal, "single",
                 "--accumulate=2")
    logs = tmp_path / "ranks"  # each rank's output, teed to files by torchrun
    launcher = torchrun()
    launcher[-2:-2] = [f"--log-dir={logs}", "--tee=3"]
    out = run(tmp_path, launcher, optimal, "ddp", "--distributed=ddp")
    assert "a graph plan" in " ".join(OUTPUTS[single].split())
    (rank0,) = logs.glob("**/attempt_0/0/stdout.log")
    assert "a graph plan" in " ".join(rank0.read_text().split())  # DDP ran one too
    a = torch.load(single / "model.pt", weights_only=True)
    b = torch.load(out / "model.pt", weights_only=True)
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert step_losses(out) == [(x + y) / 2 for x, y in
                                zip(step_losses(single)[::2], step_losses(single)[1::2])]


def left_behind(root, config, name, *args):
    """What ``tests/train/run_threads.py`` reports for each rank of a 2-process run."""
    out = root / name
    result = subprocess.run(
        [*torchrun()[:-2], str(HERE / "run_threads.py"), str(config), str(out), *args],
        env=rank_env(), capture_output=True, text=True, timeout=600, check=False, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"threads-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_a_finished_run_ends_its_process_group_threads(setup, mode):
    """FSDP2 keeps its process group alive in DTensor's caches; ``train()`` clears them so
    destroying the group ends gloo's threads before the interpreter shuts down (a rank
    once died at exit with SIGABRT after a finished run). DDP's must end too."""
    root, config, _ = setup
    for rank in left_behind(root, config, f"threads-{mode}", mode):
        assert rank["error"] is None and not rank["initialized"]
        assert not [name for name in rank["threads"] if "gloo" in name], rank


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_a_run_that_fails_to_set_up_leaves_no_process_group(setup):
    # FSDP2 refuses fp16 after joining the group: the error, and nothing left behind
    root, config, _ = setup
    for rank in left_behind(root, config, "threads-failed", "fsdp", "--amp=fp16"):
        assert rank["error"] == "SettingsError" and not rank["initialized"]
        assert not [name for name in rank["threads"] if "gloo" in name], rank

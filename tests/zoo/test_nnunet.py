"""Models from nnU-Net v2's artefacts (``zoo/nnunet.py``, issue 21): a tiny raw dataset
planned and preprocessed by nnU-Net's own code; the network remat3d builds from the plans
is the one nnU-Net's trainer builds, and a checkpoint saved by nnU-Net's trainer builds
that network with its weights."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remat3d.errors import ModelSpecError
from remat3d.zoo import build_model

pytest.importorskip("nnunetv2")

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def nnunet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nnU-Net's folders after planning and preprocessing, its trainer's network and a
    checkpoint (tests/zoo/nnunet_dataset.py, in a process of its own: nnU-Net reads its
    folders from the environment when first imported)."""
    root = tmp_path_factory.mktemp("nnunet")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "tests.zoo.nnunet_dataset", str(root)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root


def _plans(root: Path) -> Path:
    return root / "nnUNet_preprocessed" / "Dataset001_Tiny" / "nnUNetPlans.json"


def test_the_plans_build_the_network_nnunets_trainer_builds(nnunet: Path) -> None:
    trainer = json.loads((nnunet / "trainer.json").read_text())
    net = build_model(f"nnunetv2:{_plans(nnunet)}:3d_fullres")
    assert f"{type(net).__module__}.{type(net).__qualname__}" == trainer["class"]
    assert {k: list(v.shape) for k, v in net.state_dict().items()} == trainer["state_dict"]
    assert net.encoder.stages[0][0].convs[0].conv.in_channels == 2  # the dataset's channels
    assert net.decoder.seg_layers[-1].out_channels == 3              # its labels
    assert not net.decoder.deep_supervision  # one output, for remat3d's training
    deep = build_model(f"nnunetv2:{_plans(nnunet)}:3d_fullres", {"deep_supervision": True})
    assert deep.decoder.deep_supervision


def test_a_checkpoint_builds_its_network_with_its_weights(nnunet: Path) -> None:
    checkpoint = nnunet / "checkpoint_final.pth"
    net = build_model(str(checkpoint))
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["network_weights"]
    state = net.state_dict()
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in state)
    # on meta (how remat3d plans): the same network, no weights read into memory
    meta = build_model(str(checkpoint), device="meta")
    assert {k: v.shape for k, v in meta.state_dict().items()} == \
        {k: v.shape for k, v in saved.items()}


def test_a_new_label_set_gets_a_new_head_and_is_reported(nnunet: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    checkpoint = nnunet / "checkpoint_final.pth"
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["network_weights"]
    with caplog.at_level(logging.WARNING):
        net = build_model(str(checkpoint), {"out_channels": 5})
    state = net.state_dict()
    heads = [k for k in state if k.startswith("decoder.seg_layers.")]
    assert heads and all(state[k].shape[0] == 5 for k in heads)
    assert all(torch.equal(state[k], saved[k]) for k in state if k not in heads)
    assert "kept as initialised" in caplog.text and "seg_layers" in caplog.text


def test_bad_nnunet_specs_are_one_clear_error(nnunet: Path, tmp_path: Path) -> None:
    plans = _plans(nnunet)
    with pytest.raises(ModelSpecError, match="no configuration '3d_lowres_typo'"):
        build_model(f"nnunetv2:{plans}:3d_lowres_typo")
    with pytest.raises(ModelSpecError, match="does not exist"):
        build_model(f"nnunetv2:{tmp_path / 'nnUNetPlans.json'}:3d_fullres")
    with pytest.raises(ModelSpecError, match="nnunetv2:PLANS_JSON:CONFIGURATION"):
        build_model("nnunetv2:3d_fullres")
    with pytest.raises(ModelSpecError, match="do not apply to an nnU-Net v2 model"):
        build_model(f"nnunetv2:{plans}:3d_fullres", {"n_stages": 3})
    # a plans file naming something other than a network building block is refused
    bad = tmp_path / "evil"
    bad.mkdir()
    content = json.loads(plans.read_text())
    content["configurations"]["3d_fullres"]["architecture"]["network_class_name"] = "os.system"
    (bad / "nnUNetPlans.json").write_text(json.dumps(content))
    (bad / "dataset.json").write_text((plans.parent / "dataset.json").read_text())
    with pytest.raises(ModelSpecError, match="'os.system' is not a torch.nn.Module class"):
        build_model(f"nnunetv2:{bad / 'nnUNetPlans.json'}:3d_fullres")
    # plans naming a network that is not part of the installed nnU-Net: one line naming
    # the class and how to supply it, not nnU-Net's or the import's traceback
    supply = "not part of the installed nnU-Net v2 or dynamic-network-architectures"
    old = json.loads(plans.read_text())
    configuration = old["configurations"]["3d_fullres"]
    del configuration["architecture"]  # the format before the architecture block
    configuration["UNet_class_name"] = "neUNet"
    (bad / "nnUNetPlans.json").write_text(json.dumps(old))
    with pytest.raises(ModelSpecError, match="network class 'neUNet'") as err:
        build_model(f"nnunetv2:{bad / 'nnUNetPlans.json'}:3d_fullres")
    assert supply in str(err.value)
    fork = "nnunetv2.nets.ResEncUNetWithClass.ResidualEncoderUNetWithClassifier"
    content["configurations"]["3d_fullres"]["architecture"]["network_class_name"] = fork
    (bad / "nnUNetPlans.json").write_text(json.dumps(content))
    with pytest.raises(ModelSpecError, match=f"'{fork}' names no class") as err:
        build_model(f"nnunetv2:{bad / 'nnUNetPlans.json'}:3d_fullres")
    assert supply in str(err.value)
    # a fork's module that fails as it is imported (a torchvision built for another torch)
    (tmp_path / "brokenfork").mkdir()
    (tmp_path / "brokenfork" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    content["configurations"]["3d_fullres"]["architecture"]["network_class_name"] = \
        "brokenfork.nets.ResEncUNetWithClassifier"
    (bad / "nnUNetPlans.json").write_text(json.dumps(content))
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ModelSpecError, match="could not be imported .RuntimeError: "
                           "operator torchvision::nms does not exist") as err:
            build_model(f"nnunetv2:{bad / 'nnUNetPlans.json'}:3d_fullres")
    finally:
        sys.path.remove(str(tmp_path))
    assert supply in str(err.value)
    # plain weights are not a model spec
    torch.save({"weight": torch.zeros(2)}, tmp_path / "plain.pth")
    with pytest.raises(ModelSpecError, match="not an nnU-Net v2 checkpoint"):
        build_model(str(tmp_path / "plain.pth"))


def test_the_cli_plans_a_model_from_nnunet_plans(nnunet: Path) -> None:
    from typer.testing import CliRunner

    from remat3d.cli import app

    result = CliRunner().invoke(app, ["plan", f"nnunetv2:{_plans(nnunet)}:3d_fullres",
                                      "--input", "1x2x32x32x32", "--budget", "0.8x"])
    assert result.exit_code == 0, result.output
    assert "verified" in result.output


def test_a_checkpoint_fine_tunes_on_its_raw_dataset_under_a_budget(nnunet: Path,
                                                                  tmp_path: Path) -> None:
    """The network and weights from nnU-Net's checkpoint alone, the data nnU-Net's raw
    dataset (two channels stacked in order, labels 0-2), whole volumes under a budget that
    forces a plan."""
    import yaml
    from typer.testing import CliRunner

    from remat3d.cli import app

    settings = {"model": str(nnunet / "checkpoint_final.pth"),
                "data": str(nnunet / "nnUNet_raw" / "Dataset001_Tiny"),
                "epochs": 1, "val_fraction": 0.25, "memory_budget": "0.9x",
                "output_dir": str(tmp_path / "run"), "progress": False}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(settings))
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "plan for 1x2x32x32x32" in text and "measured step peak" in text, text
    trained = torch.load(tmp_path / "run" / "model.pt", map_location="cpu", weights_only=True)
    saved = torch.load(nnunet / "checkpoint_final.pth", map_location="cpu",
                       weights_only=False)["network_weights"]
    assert trained.keys() == saved.keys()
    assert any(not torch.equal(trained[k], saved[k]) for k in saved)  # it trained


def test_an_nnunet_raw_dataset_is_read_as_nnunet_lays_it_out(nnunet: Path,
                                                              tmp_path: Path) -> None:
    import shutil

    from remat3d.data.datalist import read_datalist
    from remat3d.errors import DataError

    raw = nnunet / "nnUNet_raw" / "Dataset001_Tiny"
    listed = read_datalist(raw)
    assert [c.name for c in listed.training] == [f"case{i:03d}" for i in range(4)]
    assert [p.name for p in listed.training[0].images] == ["case000_0000.nii.gz",
                                                          "case000_0001.nii.gz"]
    assert listed.labels == {"0": "background", "1": "outer", "2": "inner"}
    copy = tmp_path / "Dataset002_Regions"
    shutil.copytree(raw, copy)
    meta = json.loads((copy / "dataset.json").read_text())
    meta["labels"] = {"background": 0, "whole": [1, 2], "core": 2}
    meta["regions_class_order"] = [1, 2]
    (copy / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="region-based labels"):
        read_datalist(copy)
    meta["labels"] = {"background": 0, "outer": 1, "inner": 2}
    del meta["regions_class_order"]
    (copy / "dataset.json").write_text(json.dumps(meta))
    (copy / "imagesTr" / "case001_0001.nii.gz").unlink()
    with pytest.raises(DataError, match="case 'case001' lacks case001_0001.nii.gz"):
        read_datalist(copy)


def test_nnunets_trainer_trains_whole_volumes_under_a_budget(nnunet: Path) -> None:
    """``remat3d nnunet train`` (``remat3d.train.nnunet``): nnU-Net's trainer, one short CPU
    epoch on the whole volumes of the preprocessed dataset, planned under a budget that
    needs a plan; nnU-Net's usual outputs, a checkpoint its own predictor can load."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "nnUNet_n_proc_DA": "0",
           **{name: str(nnunet / name) for name in ("nnUNet_raw", "nnUNet_preprocessed",
                                                    "nnUNet_results")}}
    result = subprocess.run(
        [sys.executable, "-m", "remat3d", "nnunet", "train", "1", "3d_fullres", "all",
         "--budget", "0.9x", "--device", "cpu", "--epochs", "1",
         "--iterations-per-epoch", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    fold = (nnunet / "nnUNet_results" / "Dataset001_Tiny"
            / "nnUNetTrainerRemat3d__nnUNetPlans__3d_fullres" / "fold_all")
    for name in ("checkpoint_final.pth", "progress.png", "debug.json",
                 "validation/summary.json"):
        assert (fold / name).is_file(), name
    log = "".join(p.read_text() for p in fold.glob("training_log_*.txt"))
    assert "remat3d: whole volumes: patch 32x32x32" in log
    assert "remat3d: remat3d plan:" in log and "torch.compile off" in log
    checkpoint = torch.load(fold / "checkpoint_final.pth", map_location="cpu",
                            weights_only=False)
    assert checkpoint["trainer_name"] == "nnUNetTrainer"  # nnUNetv2_predict finds it
    assert build_model(str(fold / "checkpoint_final.pth")).state_dict().keys() == \
        checkpoint["network_weights"].keys()


def _compiled_trainer(root: Path, budget: str, backend: str) -> tuple[dict, str]:
    result = subprocess.run(
        [sys.executable, "-m", "tests.zoo.nnunet_compiled", str(root), budget, backend],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stdout


@pytest.mark.parametrize("budget", ["1.2x", "0.9x"])
def test_where_nnunet_compiles_the_trainer_plans_for_the_compiled_step(
        nnunet: Path, budget: str) -> None:
    """nnU-Net compiles on CUDA by default (``tests/zoo/nnunet_compiled.py`` answers as
    there): a budget that recomputation reaches keeps the network compiled with a plan
    for compiled steps (a graph plan whose graphs remat3d compiles with inductor; torch's
    compile, here ``aot_eager``, leaves the planned step to it), gradients within
    inductor's rounding of the unplanned eager network's; one only tiling reaches runs it
    eagerly with the tiled plan, and the log says why (train/nnunet.py rule 3)."""
    result, log = _compiled_trainer(nnunet, budget, "aot_eager")
    if budget == "1.2x":  # above the unplanned step less the momentum: recompute suffices
        assert result["compiled"] and not result["tiled"], result
        assert result["graph_backend"] == "inductor", result
        assert "torch.compile on (nnU-Net's choice)" in log
        assert result["gradient_difference"] < 1e-2, result  # inductor's own rounding
    else:
        assert not result["compiled"] and result["tiled"]
        assert "torch.compile off: no plan for a compiled step fits" in log
        # tiled: fp32 summation order; float64 exactness is tests/tiling/test_norms.py's
        assert result["gradient_difference"] < 1e-2


@pytest.mark.slow
def test_the_trainers_compiled_step_runs_under_inductor(nnunet: Path) -> None:
    result, _ = _compiled_trainer(nnunet, "1.2x", "inductor")
    assert result["compiled"] and result["graph_backend"] == "inductor"
    assert result["gradient_difference"] < 1e-2  # inductor's own rounding, not the plan's

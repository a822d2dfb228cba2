"""MONAI bundles as model specs (``zoo/bundle.py``, issue 21 item 2): a bundle folder with a
SegResNet ``network_def`` and saved weights builds that network with those weights, as a
folder or a zip, and trains with ``remat3d train``."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from remat3d.cli import app
from remat3d.errors import ModelSpecError
from remat3d.zoo import build_model
from tests.data.volumes import write_dataset

NETWORK = {"_target_": "SegResNet", "spatial_dims": 3, "in_channels": 1,
           "out_channels": "@num_classes", "init_filters": 4, "blocks_down": [1, 1],
           "blocks_up": [1], "norm": ["GROUP", {"num_groups": 2}]}


@pytest.fixture()
def bundle(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    from monai.networks.nets import SegResNet

    root = tmp_path / "seg_bundle"
    (root / "configs").mkdir(parents=True)
    (root / "models").mkdir()
    (root / "configs" / "metadata.json").write_text(json.dumps({"version": "0.1.0"}))
    (root / "configs" / "inference.json").write_text(json.dumps(
        {"num_classes": 2, "network_def": NETWORK, "network": "$@network_def.to('cpu')"}))
    torch.manual_seed(1)
    net = SegResNet(spatial_dims=3, in_channels=1, out_channels=2, init_filters=4,
                    blocks_down=(1, 1), blocks_up=(1,), norm=("GROUP", {"num_groups": 2}))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    torch.save(state, root / "models" / "model.pt")
    return root, state


def test_a_bundle_builds_its_network_with_its_weights(bundle) -> None:  # type: ignore[no-untyped-def]
    root, state = bundle
    net = build_model(str(root))
    assert type(net).__name__ == "SegResNet"
    got = net.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in got)
    # zipped, as bundles are downloaded
    archive = shutil.make_archive(str(root.parent / "seg_bundle"), "zip", root.parent,
                                  root.name)
    zipped = build_model(archive).state_dict()
    assert all(torch.equal(zipped[k], state[k]) for k in state)


def test_model_kwargs_change_the_head_and_what_is_left_is_reported(
        bundle, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    root, state = bundle
    with caplog.at_level(logging.WARNING):
        net = build_model(str(root), {"out_channels": 5})
    got = net.state_dict()
    assert got["conv_final.2.conv.weight"].shape[0] == 5
    assert "kept as initialised" in caplog.text and "conv_final" in caplog.text
    assert all(torch.equal(got[k], state[k]) for k in state if not k.startswith("conv_final"))


def test_a_bundle_trains_with_remat3d_train(bundle, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, _ = bundle
    write_dataset(tmp_path / "data", cases=2, validation=1, shape=(16, 16, 16))
    settings = {"model": str(root), "model_kwargs": {"out_channels": 3},  # a new head
                "data": str(tmp_path / "data" / "dataset.json"),
                "epochs": 1, "memory_budget": "0.9x", "output_dir": str(tmp_path / "run"),
                "progress": False}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(settings))
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "model.pt").is_file()


def test_a_broken_bundle_is_one_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "broken"
    (root / "configs").mkdir(parents=True)
    with pytest.raises(ModelSpecError, match="no configs/train or configs/inference"):
        build_model(str(root))
    (root / "configs" / "inference.json").write_text(json.dumps({"device": "cpu"}))
    with pytest.raises(ModelSpecError, match="defines network_def"):
        build_model(str(root))
    (root / "configs" / "inference.json").write_text(json.dumps(
        {"network_def": {"_target_": "SegResNet", "spatial_dims": 3, "no_such_arg": 1}}))
    with pytest.raises(ModelSpecError, match="building network_def from inference.json"):
        build_model(str(root))


def _scripts_bundle(root: Path, channels: int) -> Path:
    """A bundle whose network is its own code, ``scripts/networks/tiny.py`` (as the model
    zoo's UNesT bundle names ``scripts.networks.unest_base_patch_4.UNesT``)."""
    (root / "configs").mkdir(parents=True)
    (root / "scripts" / "networks").mkdir(parents=True)
    (root / "scripts" / "__init__.py").write_text("")
    (root / "scripts" / "networks" / "__init__.py").write_text("")
    (root / "scripts" / "networks" / "tiny.py").write_text(
        "import torch\n\n\nclass Tiny(torch.nn.Sequential):\n"
        "    def __init__(self, out_channels):\n"
        f"        super().__init__(torch.nn.Conv3d(1, {channels}, 3, padding=1),\n"
        f"                         torch.nn.Conv3d({channels}, out_channels, 1))\n")
    (root / "configs" / "inference.json").write_text(json.dumps(
        {"network_def": {"_target_": "scripts.networks.tiny.Tiny", "out_channels": 2}}))
    return root


def test_a_bundle_builds_a_network_of_its_own_scripts_and_leaves_no_import_state(
        tmp_path: Path) -> None:
    import sys

    path, modules = list(sys.path), set(sys.modules)
    first = build_model(str(_scripts_bundle(tmp_path / "a", channels=3)))
    # another bundle's scripts package of the same name is its own, not the first's
    second = build_model(str(_scripts_bundle(tmp_path / "b", channels=5)))
    assert type(first).__name__ == type(second).__name__ == "Tiny"
    assert first[0].out_channels == 3 and second[0].out_channels == 5
    assert sys.path == path and set(sys.modules) == modules


def test_a_bundle_for_another_monai_release_names_both_releases(tmp_path: Path) -> None:
    import monai

    root = tmp_path / "old"
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "metadata.json").write_text(json.dumps({"monai_version": "1.4.0"}))
    # SwinUNETR(img_size=...) is gone since MONAI 1.5
    (root / "configs" / "inference.json").write_text(json.dumps(
        {"network_def": {"_target_": "SwinUNETR", "img_size": [96, 96, 96], "in_channels": 1,
                         "out_channels": 14, "feature_size": 48}}))
    with pytest.raises(ModelSpecError) as err:
        build_model(str(root))
    message = str(err.value)
    assert "building network_def" in message
    assert "written for MONAI 1.4.0" in message and f"MONAI {monai.__version__} is " \
        "installed" in message

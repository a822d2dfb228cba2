"""``remat3d.monai.WholeVolumeInferer`` (issue 55, acceptance 4): a MONAI bundle whose
``inference.json`` names it instead of ``SlidingWindowInferer`` runs MONAI's own bundle
inference end to end (NIfTI in, NIfTI labels out), and the labels are the network's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from monai.inferers import Inferer, SlidingWindowInferer
from monai.networks.nets import SegResNet

from remat3d.errors import BudgetError, InputShapeError
from remat3d.monai import WholeVolumeInferer
from tests.data.volumes import blob_case, write_volume

SHAPE = (32, 32, 32)
NETWORK = {"_target_": "SegResNet", "spatial_dims": 3, "in_channels": 1, "out_channels": 3,
           "init_filters": 4, "blocks_down": [1, 1], "blocks_up": [1],
           "norm": ["GROUP", {"num_groups": 2}]}

# a model-zoo inference.json (spleen_ct_segmentation's layout), the inferer swapped
INFERENCE = {
    "imports": ["$import glob", "$import os"],
    "bundle_root": ".",
    "output_dir": "$@bundle_root + '/eval'",
    "dataset_dir": "/no/such/dir",
    "datalist": "$list(sorted(glob.glob(@dataset_dir + '/*.nii.gz')))",
    "device": "$torch.device('cpu')",
    "network_def": NETWORK,
    "network": "$@network_def.to(@device)",
    "preprocessing": {"_target_": "Compose", "transforms": [
        {"_target_": "LoadImaged", "keys": "image"},
        {"_target_": "EnsureChannelFirstd", "keys": "image"},
        {"_target_": "ScaleIntensityd", "keys": "image"},
        {"_target_": "EnsureTyped", "keys": "image"}]},
    "dataset": {"_target_": "Dataset", "data": "$[{'image': i} for i in @datalist]",
                "transform": "@preprocessing"},
    "dataloader": {"_target_": "DataLoader", "dataset": "@dataset", "batch_size": 1,
                   "shuffle": False, "num_workers": 0},
    "inferer": {"_target_": "remat3d.monai.WholeVolumeInferer"},
    "postprocessing": {"_target_": "Compose", "transforms": [
        {"_target_": "Activationsd", "keys": "pred", "softmax": True},
        {"_target_": "AsDiscreted", "keys": "pred", "argmax": True},
        {"_target_": "SaveImaged", "keys": "pred", "output_dir": "@output_dir",
         "output_dtype": "$numpy.uint8", "resample": False, "separate_folder": False,
         "squeeze_end_dims": True}]},
    "handlers": [{"_target_": "CheckpointLoader",
                  "load_path": "$@bundle_root + '/models/model.pt'",
                  "load_dict": {"model": "@network"}}],
    "evaluator": {"_target_": "SupervisedEvaluator", "device": "@device",
                  "val_data_loader": "@dataloader", "network": "@network",
                  "inferer": "@inferer", "postprocessing": "@postprocessing",
                  "val_handlers": "@handlers", "amp": False},
    "initialize": ["$monai.utils.set_determinism(seed=0)"],
    "run": ["$@evaluator.run()"],
}


def _network() -> SegResNet:
    torch.manual_seed(3)
    kwargs = {k: v for k, v in NETWORK.items() if k != "_target_"}
    return SegResNet(**{**kwargs, "norm": tuple(kwargs["norm"])})


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bundles") / "seg_bundle"
    (root / "configs").mkdir(parents=True)
    (root / "models").mkdir()
    (root / "configs" / "metadata.json").write_text(json.dumps(
        {"version": "0.1.0", "network_data_format": {
            "inputs": {"image": {"type": "image", "num_channels": 1}},
            "outputs": {"pred": {"type": "image", "num_channels": 3}}}}))
    (root / "configs" / "inference.json").write_text(json.dumps(INFERENCE))
    torch.save(_network().state_dict(), root / "models" / "model.pt")
    image, _ = blob_case(SHAPE, seed=0)
    write_volume(root.parent / "images" / "case0.nii.gz", image)
    return root


def _reference(image_path: Path) -> torch.Tensor:
    """The network's own forward (eval, no gradients) on the bundle's pre-processed input:
    logits (C, D, H, W)."""
    from monai.transforms import Compose, EnsureChannelFirst, LoadImage, ScaleIntensity

    image = Compose([LoadImage(image_only=True), EnsureChannelFirst(), ScaleIntensity()])(
        str(image_path))
    net = _network().eval()
    with torch.no_grad():
        return net(image.as_tensor()[None])[0]


def _labels_match(written: np.ndarray, logits: torch.Tensor, tolerance: float) -> None:
    """Labels equal the reference argmax except where its two top logits lie within
    ``tolerance`` (a tie the tiled rounding may break the other way)."""
    expected = logits.argmax(0).numpy()
    top2 = logits.topk(2, dim=0).values
    tie = (top2[0] - top2[1]).numpy() <= tolerance
    assert written.shape == expected.shape
    assert np.array_equal(written[~tie], expected[~tie])


def _run(bundle: Path, output_dir: Path, **override: object) -> np.ndarray:
    import nibabel as nib
    from monai.bundle import run

    run(run_id="run", init_id="initialize",
        meta_file=str(bundle / "configs" / "metadata.json"),
        config_file=str(bundle / "configs" / "inference.json"),
        bundle_root=str(bundle), dataset_dir=str(bundle.parent / "images"),
        output_dir=str(output_dir), **override)
    (written,) = sorted(output_dir.glob("*.nii.gz"))
    return np.asarray(nib.load(written).dataobj)


def test_monai_bundle_run_with_the_inferer_writes_the_networks_labels(
        bundle: Path, tmp_path: Path) -> None:
    written = _run(bundle, tmp_path / "eval")
    logits = _reference(bundle.parent / "images" / "case0.nii.gz")
    # untiled (the default budget on a CPU): the network's own forward, bit for bit
    assert np.array_equal(written, logits.argmax(0).numpy())


def test_a_budget_that_tiles_gives_the_same_labels(bundle: Path, tmp_path: Path) -> None:
    from monai.bundle import ConfigWorkflow

    workflow = ConfigWorkflow(
        config_file=str(bundle / "configs" / "inference.json"),
        meta_file=str(bundle / "configs" / "metadata.json"), workflow_type="infer",
        bundle_root=str(bundle), dataset_dir=str(bundle.parent / "images"),
        output_dir=str(tmp_path / "eval"), **{"inferer#budget": "0.9x"})
    workflow.initialize()
    workflow.run()
    workflow.finalize()
    import nibabel as nib

    (path,) = sorted((tmp_path / "eval").glob("*.nii.gz"))
    written = np.asarray(nib.load(path).dataobj)
    inferer = workflow.parser.get_parsed_content("inferer")
    network = workflow.parser.get_parsed_content("network")
    (plan,) = inferer._plans[network].values()
    assert any(step.tiled(plan.capture.graph) for step in plan.plan.steps)
    _labels_match(written, _reference(bundle.parent / "images" / "case0.nii.gz"), 1e-4)


def test_it_returns_what_sliding_window_inferer_returns() -> None:
    net = _network().eval()
    x = MetaTensor(torch.randn(1, 1, *SHAPE), affine=torch.diag(torch.tensor([2., 2, 2, 1])))
    x.is_batch = True
    ours = WholeVolumeInferer(budget="0.9x")(x, net)
    theirs = SlidingWindowInferer(roi_size=SHAPE)(x, net)  # one window: the whole volume
    assert isinstance(ours, MetaTensor) and ours.is_batch
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert torch.equal(ours.affine, theirs.affine)
    torch.testing.assert_close(ours.as_tensor(), theirs.as_tensor(), rtol=1e-4, atol=1e-5)
    labels = WholeVolumeInferer(output="labels")(x.as_tensor(), net)
    assert labels.shape == (1, 1, *SHAPE) and labels.dtype == torch.uint8
    assert torch.equal(labels[:, 0], theirs.as_tensor().argmax(1).to(torch.uint8))


def test_it_plans_once_per_shape() -> None:
    net = _network().eval()
    inferer = WholeVolumeInferer()
    for _ in range(2):
        inferer(torch.randn(1, 1, 16, 16, 16), net)
    inferer(torch.randn(1, 1, 16, 16, 8), net)
    assert len(inferer._plans[net]) == 2


def test_it_is_a_monai_inferer() -> None:
    assert isinstance(WholeVolumeInferer(), Inferer)


def test_a_bad_budget_is_one_clear_error() -> None:
    with pytest.raises(BudgetError, match=r"WholeVolumeInferer\(budget='lots'\).*12GiB"):
        WholeVolumeInferer(budget="lots")


def test_an_indivisible_volume_names_the_fix_and_divisible_by_pads_and_crops() -> None:
    net = _network().eval()
    x = torch.randn(1, 1, 17, 16, 15)
    with pytest.raises(InputShapeError, match="divisible_by"):
        WholeVolumeInferer()(x, net)
    out = WholeVolumeInferer(divisible_by=2)(x, net)
    padded = torch.nn.functional.pad(x, [0, 1, 0, 0, 0, 1])  # half before, the rest after
    with torch.no_grad():
        expected = net(padded)[:, :, :17, :, :15]
    assert out.shape == (1, 3, 17, 16, 15)
    torch.testing.assert_close(out, expected)


def test_import_remat3d_does_not_import_monai() -> None:
    import subprocess
    import sys

    code = "import sys, remat3d\nassert 'monai' not in sys.modules and 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False, timeout=120)
    assert result.returncode == 0, result.stderr

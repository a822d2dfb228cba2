"""``remat3d predict`` on image files (``infer/volumes.py``): the training run's network,
weights and preprocessing; outputs on the input's own voxel grid that equal the untiled
forward of the prepared volume; one red line and nothing written for every bad input."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from remat3d import zoo
from remat3d.cli import app
from remat3d.data import Case, Preprocessing, load_case, pad_to_divisor
from remat3d.errors import DataError, InputShapeError
from remat3d.infer.volumes import cases_from_inputs
from remat3d.train.settings import TrainSettings
from tests.data.volumes import blob_case, write_volume

runner = CliRunner()
UNET = {"channels": [4, 8, 16], "strides": [2, 2], "num_res_units": 1, "out_channels": 3}
# not RAS: axes permuted and flipped, anisotropic voxels, an offset
AFFINE = np.array([[-2.0, 0, 0, 10], [0, 0, 1.5, -3], [0, 2.5, 0, 7], [0, 0, 0, 1]])
SHAPE = (18, 23, 17)  # no edge divisible by the network's 4: padded, then cropped back


def _run_folder(root: Path, **settings: object) -> Path:
    """What ``remat3d train`` leaves: settings.yaml and model.pt."""
    run = root / "run"
    run.mkdir(parents=True)
    values = TrainSettings(model="unet", model_kwargs=UNET, data="data/dataset.json",
                           intensity="ct", ct_window=[-50.0, 150.0], **settings).to_dict()
    (run / "settings.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    torch.manual_seed(0)
    torch.save(zoo.build_model("unet", UNET).state_dict(), run / "model.pt")
    return run


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    for i in range(2):
        image, _ = blob_case(SHAPE, i)
        write_volume(tmp_path / "in" / f"case{i}.nii.gz", image, AFFINE)
    return _run_folder(tmp_path)


def _reference(run: Path, image: Path) -> np.ndarray:
    """Softmax of the plain forward (eval, untiled) on the volume as training prepares it,
    cropped to the prepared grid: (C, D, H, W) in RAS."""
    net = zoo.build_model("unet", UNET).eval()
    net.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    prep = Preprocessing(intensity="ct", ct_window=(-50.0, 150.0))
    volume = load_case(Case("c", (image,), None), prep)
    x, shape = pad_to_divisor(volume.image[None], 4)
    with torch.no_grad():
        probs = torch.softmax(net(x), dim=1)[0]
    return probs[:, :shape[0], :shape[1], :shape[2]].numpy()


def _in_ras(path: Path) -> np.ndarray:
    """A written NIfTI reoriented to RAS by nibabel (not MONAI): channel first."""
    data = np.asarray(nib.as_closest_canonical(nib.load(str(path))).dataobj)
    return data[None] if data.ndim == 3 else np.moveaxis(data, -1, 0)


def test_predictions_are_the_whole_volume_forward_on_the_inputs_grid(run: Path) -> None:
    """Tiled under 0.9x of the untiled forward's peak: probabilities equal the plain
    forward's up to their float16 rounding, labels its argmax but for near-ties; both on the
    input's grid with its affine."""
    root = run.parent
    inputs = [str(root / "in" / f"case{i}.nii.gz") for i in range(2)]
    result = runner.invoke(app, ["predict", str(run), *inputs, "-o", str(root / "probs"),
                                 "--budget", "0.9x", "--output", "probabilities"])
    assert result.exit_code == 0, result.output
    assert "2 prediction(s)" in result.output and "device peak" in result.output
    assert " 0 tiled steps" not in result.output and "tiled steps" in result.output
    result = runner.invoke(app, ["predict", str(run), *inputs, "-o", str(root / "labels"),
                                 "--budget", "0.9x"])
    assert result.exit_code == 0, result.output
    for i in range(2):
        name = f"case{i}.nii.gz"
        reference = _reference(run, root / "in" / name)
        for folder in ("probs", "labels"):
            written = nib.load(str(root / folder / name))
            assert written.shape[:3] == SHAPE
            np.testing.assert_allclose(written.affine, AFFINE)
        probs = _in_ras(root / "probs" / name)
        # float16 probabilities: within half a float16 step below 1 (2^-11) of the forward's
        np.testing.assert_allclose(probs, reference, atol=2.0**-11, rtol=0)
        labels = _in_ras(root / "labels" / name)[0]
        assert nib.load(str(root / "labels" / name)).get_data_dtype() == np.uint8
        top2 = np.sort(reference, axis=0)[-2:]
        clear = top2[1] - top2[0] > 1e-5
        assert clear.mean() > 0.99
        assert (labels == reference.argmax(0))[clear].all()
    assert not [p for p in (root / "labels").iterdir() if p.name.startswith(".")]


def test_resampled_predictions_go_back_to_the_inputs_grid(tmp_path: Path) -> None:
    """With a spacing the volume is resampled for the network and its labels back: the
    output has the input's shape and affine; at the input's own spacing resampling is the
    identity and the labels equal those of no resampling."""
    affine = np.diag([2.0, 2.0, 2.0, 1.0])
    image, _ = blob_case((20, 20, 16), 3)
    source = write_volume(tmp_path / "in" / "ct.nii.gz", image, affine)
    outs = {}
    for spacing in (None, "2,2,2", "1.5,1.7,2.5"):
        run = _run_folder(tmp_path / str(spacing))
        out = tmp_path / "out" / str(spacing)
        extra = ["--spacing", spacing] if spacing else []
        result = runner.invoke(app, ["predict", str(run), str(source), "-o", str(out), *extra])
        assert result.exit_code == 0, result.output
        written = nib.load(str(out / "ct.nii.gz"))
        assert written.shape == (20, 20, 16)
        np.testing.assert_allclose(written.affine, affine)
        outs[spacing] = np.asarray(written.dataobj)
    assert np.array_equal(outs[None], outs["2,2,2"])
    assert (outs[None] == outs["1.5,1.7,2.5"]).mean() > 0.8  # same anatomy, other grid


def test_cases_group_channels_and_name_outputs(tmp_path: Path) -> None:
    image, _ = blob_case((8, 8, 8), 0)
    files = [write_volume(tmp_path / f"p{i}_{c:04d}.nii.gz", image) for i in (1, 2)
             for c in (0, 1)]
    cases = cases_from_inputs(files, 2, tmp_path / "out")
    assert [c.name for c in cases] == ["p1", "p2"]
    assert cases[0].images == tuple(files[:2])
    assert cases[1].output == tmp_path / "out" / "p2.nii.gz"
    with pytest.raises(InputShapeError, match="has only 1"):
        cases_from_inputs(files[:3], 2, tmp_path / "out")
    with pytest.raises(DataError, match="Two cases would write"):
        cases_from_inputs([files[0], files[0]], 1, tmp_path / "out")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="neither a NIfTI file"):
        cases_from_inputs([tmp_path / "notes.txt"], 1, tmp_path / "out")


def _fails(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["predict", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("case", ["exists", "out-is-file", "truncated", "budget", "tiny",
                                  "no-weights", "channels", "output-kind"])
def test_bad_input_is_one_line_and_nothing_is_written(run: Path, case: str) -> None:
    root = run.parent
    source = root / "in" / "case0.nii.gz"
    out = root / "out"
    args = [str(run), str(source), "-o", str(out)]
    if case == "exists":
        out.mkdir()
        (out / "case0.nii.gz").write_bytes(b"earlier")
        _fails(args, "exists; remove it")
        assert (out / "case0.nii.gz").read_bytes() == b"earlier"
        return
    if case == "out-is-file":
        out.write_text("x")
        _fails(args, "is a file")
        return
    if case == "truncated":
        raw = source.read_bytes()
        source.write_bytes(raw[: len(raw) // 3])
        _fails(args, "Cannot read")
    elif case == "budget":
        _fails([*args, "--budget", "0.05x"], "smallest feasible budget")
    elif case == "tiny":
        write_volume(source, np.zeros((1, 20, 20), np.float32), AFFINE)
        _fails(args, "padding would more than double")
    elif case == "no-weights":
        _fails(["unet", str(source), "-o", str(out)], "untrained weights")
    elif case == "channels":
        _fails(["unet", str(source), str(source), "-o", str(out), "--weights",
                str(run / "model.pt"), "--model-kwargs", '{"in_channels": 2}'],
               "do not fit")
        _fails([str(run), str(source), "-o", str(out), "--model-kwargs", "{}"],
               "--model-kwargs is for a model spec")
    elif case == "output-kind":
        _fails([*args, "--output", "logits"], "--output must be labels or probabilities")
    assert not out.exists() or not list(out.iterdir())

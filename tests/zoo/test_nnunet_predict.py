"""``remat3d nnunet predict`` (``remat3d.infer.nnunet``): nnUNetv2_predict's job with the
whole padded case as its one window. Its outputs are nnU-Net's own predictor's with the
patch size set to that padded case (``tests/zoo/nnunet_reference.py``): the same files,
the same probabilities (bit for bit untiled; within a float16 step of the logits tiled)
and labels; errors are one line; no case is half written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("nnunetv2")

ROOT = Path(__file__).parents[2]
DATASET, MODEL = "Dataset001_Tiny", "nnUNetTrainer__nnUNetPlans__3d_fullres"
CASES = ["case000", "odd900"]
FILES = {"dataset.json", "plans.json", "predict_from_raw_data_args.json",
         *(f"{case}{ending}" for case in CASES for ending in (".nii.gz", ".npz", ".pkl"))}


@pytest.fixture(scope="module")
def nnunet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """nnU-Net's folders and a model trained by nnU-Net's trainer (fold all), as in
    test_nnunet.py (tests/zoo/nnunet_dataset.py, in a process of its own)."""
    root = tmp_path_factory.mktemp("nnunet")
    result = subprocess.run([sys.executable, "-m", "tests.zoo.nnunet_dataset", str(root)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def images(nnunet: Path) -> Path:
    """A training case as it is (32^3, the patch size) and one of 36x30x33 (padded to
    40x32x40: above the patch size on two axes, not a multiple of the divisor 8)."""
    import nibabel as nib

    raw = nnunet / "nnUNet_raw" / DATASET / "imagesTr"
    folder = nnunet / "images"
    folder.mkdir()
    for channel in range(2):
        name = f"_{channel:04d}.nii.gz"
        shutil.copy(raw / f"case000{name}", folder / f"case000{name}")
        image = np.asarray(nib.load(raw / f"case001{name}").dataobj)
        image = np.pad(image, ((2, 2), (0, 0), (0, 1)), mode="reflect")[:, 1:31, :]
        nib.save(nib.Nifti1Image(image.astype(np.float32), np.eye(4)), folder / f"odd900{name}")
    return folder


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **{
        name: str(root / name) for name in ("nnUNet_raw", "nnUNet_preprocessed",
                                            "nnUNet_results")}}


def _predict(root: Path, images: Path, output: Path, *options: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "remat3d", "nnunet", "predict", "-i", str(images), "-o",
         str(output), "-d", "1", "-c", "3d_fullres", "-f", "all", "--save_probabilities",
         "--device", "cpu", *options],
        cwd=ROOT, env=_env(root), capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return " ".join(result.stdout.split())


def _reference(root: Path, images: Path, output: Path, *options: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tests.zoo.nnunet_reference",
         str(root / "nnUNet_results" / DATASET / MODEL), "all", str(images), str(output),
         *options],
        cwd=ROOT, env=_env(root), capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _compare(ours: Path, theirs: Path) -> tuple[float, int]:
    """The largest difference of the probabilities (.npz) and the labels that differ
    (CASE.nii.gz) where the reference's top two classes are further apart than that."""
    import SimpleITK as sitk

    assert {p.name for p in ours.iterdir()} == FILES
    assert {p.name for p in theirs.iterdir()} == FILES
    largest, mismatches = 0.0, 0
    for case in CASES:
        p = np.load(ours / f"{case}.npz")["probabilities"]
        q = np.load(theirs / f"{case}.npz")["probabilities"]
        assert p.shape == q.shape and p.dtype == q.dtype
        difference = float(np.abs(p - q).max())
        largest = max(largest, difference)
        a, b = (sitk.GetArrayFromImage(sitk.ReadImage(str(f / f"{case}.nii.gz")))
                for f in (ours, theirs))
        assert a.shape == b.shape == q.shape[1:]
        top = np.sort(q, axis=0)
        clear = top[-1] - top[-2] > 2 * difference  # not a near tie
        mismatches += int(((a != b) & clear).sum())
    return largest, mismatches


@pytest.fixture(scope="module")
def reference(nnunet: Path, images: Path) -> Path:
    output = nnunet / "reference"
    _reference(nnunet, images, output)
    return output


@pytest.fixture(scope="module")
def untiled(nnunet: Path, images: Path) -> tuple[Path, str]:
    output = nnunet / "untiled"
    return output, _predict(nnunet, images, output, "--disable_tta", "--budget", "1.0x")


def test_untiled_predictions_are_nnunets_own_bit_for_bit(
        untiled: tuple[Path, str], reference: Path) -> None:
    output, log = untiled
    assert "case000: 32x32x32 as 32x32x32, 0 tiled steps" in log, log
    assert "odd900: 33x30x36 as 40x32x40, 0 tiled steps" in log, log
    difference, mismatches = _compare(output, reference)
    assert difference <= 1e-6 and mismatches == 0, (difference, mismatches)


def test_tiled_predictions_are_nnunets_own_within_a_float16_step(
        nnunet: Path, images: Path, reference: Path) -> None:
    """Tiled, the float32 logits differ by rounding (about 1e-5); nnU-Net holds them in
    float16, whose step (2^-8 at 4-8) a few voxels cross: about 5e-4 in probability."""
    output = nnunet / "tiled"
    log = _predict(nnunet, images, output, "--disable_tta", "--budget", "0.9x")
    assert re.search(r"case000: 32x32x32 as 32x32x32, [1-9]\d* tiled steps", log), log
    assert re.search(r"odd900: 33x30x36 as 40x32x40, [1-9]\d* tiled steps", log), log
    difference, mismatches = _compare(output, reference)
    assert difference <= 2e-3 and mismatches == 0, (difference, mismatches)


@pytest.fixture(scope="module")
def reference_mirrored(nnunet: Path, images: Path) -> Path:
    output = nnunet / "reference_mirrored"
    _reference(nnunet, images, output, "--tta")
    return output


@pytest.mark.parametrize("budget", [
    "1.0x", pytest.param("0.9x", marks=pytest.mark.slow)])  # tiled: 8 tiled forwards a case
def test_mirroring_is_nnunets(nnunet: Path, images: Path, reference_mirrored: Path,
                              budget: str) -> None:
    """Test-time mirroring on (nnU-Net's default): the 8 flips of the whole case, summed
    and averaged in nnU-Net's order: bit for bit untiled."""
    output = nnunet / f"mirrored_{budget}"
    log = _predict(nnunet, images, output, "--budget", budget)
    tiled = budget != "1.0x"
    steps = re.search(r"32x32x32 as 32x32x32, (\d+) tiled steps", log)
    assert steps and (int(steps.group(1)) > 0) == tiled, log
    difference, mismatches = _compare(output, reference_mirrored)
    assert difference <= (2e-3 if tiled else 1e-6) and mismatches == 0, (difference,
                                                                           mismatches)


# in this process: what fails before predicting, or predicts in a second or two


@pytest.fixture
def results(nnunet: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """nnU-Net's results folder, as nnU-Net would have read it from nnUNet_results."""
    import nnunetv2.paths

    folder = nnunet / "nnUNet_results"
    monkeypatch.setattr(nnunetv2.paths, "nnUNet_results", str(folder))
    return folder


def _cli(*arguments: str) -> tuple[int, str]:
    from typer.testing import CliRunner

    from remat3d.cli import app

    result = CliRunner().invoke(app, ["nnunet", "predict", "-d", DATASET, "-c", "3d_fullres",
                                      "--device", "cpu", "--disable_tta", *arguments])
    return result.exit_code, " ".join(result.output.split())


def test_mistakes_are_one_line_each(results: Path, images: Path, tmp_path: Path) -> None:
    model = results / DATASET / MODEL
    out = str(tmp_path / "out")
    (tmp_path / "file").write_text("")
    one_channel = tmp_path / "one_channel"
    one_channel.mkdir()
    shutil.copy(images / "case000_0000.nii.gz", one_channel)
    (tmp_path / "empty").mkdir()
    cases = {
        ("-i", str(images), "-o", str(tmp_path / "file")):
            f"The output folder {tmp_path / 'file'} is a file",
        ("-i", str(images), "-o", out, "-f", "3"):
            f"No fold folder for fold 3: {model / 'fold_3' / 'checkpoint_final.pth'} does "
            "not exist. Folds with checkpoint_final.pth: all (-f).",
        ("-i", str(images), "-o", out, "-chk", "checkpoint_typo.pth"):
            f"No fold in {model} has checkpoint_typo.pth",
        ("-i", str(images), "-o", out, "-tr", "nnUNetTrainerTypo"):
            f"holds {MODEL}: pick one with -tr, -p and -c.",
        ("-i", str(one_channel), "-o", out):
            "Case 'case000' in " + str(one_channel) + " has case000_0000.nii.gz; the model "
            "takes 2 channels, one file each: case000_0000.nii.gz, case000_0001.nii.gz.",
        ("-i", str(tmp_path / "empty"), "-o", out): "holds no images named CASE_0000.nii.gz",
        ("-i", str(tmp_path / "missing"), "-o", out): "does not exist",
    }
    for arguments, message in cases.items():
        code, output = _cli(*arguments)
        assert code == 2 and output.startswith("error:") and message in output, output
        assert "Traceback" not in output
    assert not (tmp_path / "out").exists()  # nothing written before the checks pass


def test_a_budget_below_the_smallest_plan_writes_no_case(results: Path, images: Path,
                                                        tmp_path: Path) -> None:
    code, output = _cli("-i", str(images), "-o", str(tmp_path / "out"), "--budget", "1KiB")
    assert code == 2 and "the smallest feasible budget is" in output, output
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "dataset.json", "plans.json", "predict_from_raw_data_args.json"}


def test_nnunet_missing_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "nnunetv2" else find_spec(name, *a))
    code, output = _cli("-i", str(tmp_path), "-o", str(tmp_path / "out"))
    assert code == 2 and "pip install 'remat3d[nnunet]'" in output, output


def test_a_failed_export_leaves_no_file_of_its_case(results: Path, images: Path,
                                                    tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import nnunetv2.inference.export_prediction as export

    from remat3d.infer.nnunet import predict_nnunet

    def partial(logits: object, properties: object, configuration: object, plans: object,
                dataset: object, truncated: str, probabilities: bool) -> None:
        Path(truncated + ".npz").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(export, "export_prediction_from_logits", partial)
    with pytest.raises(OSError, match="disk full"):
        predict_nnunet(images, tmp_path, DATASET, "3d_fullres", use_mirroring=False,
                       device="cpu", save_probabilities=True)
    assert {p.name for p in tmp_path.iterdir()} == {
        "dataset.json", "plans.json", "predict_from_raw_data_args.json"}


def test_existing_outputs_are_overwritten_unless_continuing(
        results: Path, images: Path, untiled: tuple[Path, str], tmp_path: Path) -> None:
    """As nnUNetv2_predict: existing cases are predicted again, except with
    --continue_prediction, which skips each case whose files are all there."""
    from remat3d.infer.nnunet import predict_nnunet

    output = tmp_path / "out"
    shutil.copytree(untiled[0], output)
    (output / "odd900.npz").unlink()
    (output / "case000.nii.gz").write_bytes(b"stale")
    continued = predict_nnunet(images, output, DATASET, "3d_fullres", use_mirroring=False,
                               device="cpu", save_probabilities=True,
                               continue_prediction=True)
    assert continued.skipped == ["case000"] and [c.case for c in continued.cases] == ["odd900"]
    assert (output / "case000.nii.gz").read_bytes() == b"stale"
    assert {p.name for p in output.iterdir()} == FILES
    # this process may run torch on fewer threads than the subprocess that made `untiled`
    # (tests/conftest.py), which changes convolutions' rounding: within a float16 step
    np.testing.assert_allclose(np.load(output / "odd900.npz")["probabilities"],
                               np.load(untiled[0] / "odd900.npz")["probabilities"],
                               atol=2.0**-10, rtol=0)
    again = predict_nnunet(images, output, DATASET, "3d_fullres", use_mirroring=False,
                           device="cpu")
    assert [c.case for c in again.cases] == CASES and not again.skipped
    import SimpleITK as sitk

    a, b = (sitk.GetArrayFromImage(sitk.ReadImage(str(f / "case000.nii.gz")))
            for f in (output, untiled[0]))
    assert (a != b).mean() <= 1e-3  # predicted again, not the stale bytes; near-ties aside


def test_the_default_trainer_is_remat3ds_where_it_trained(results: Path,
                                                         tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    import nnunetv2.paths

    from remat3d.infer.nnunet import find_model_folder

    monkeypatch.setattr(nnunetv2.paths, "nnUNet_results", str(tmp_path))
    plain = tmp_path / DATASET / MODEL
    plain.mkdir(parents=True)
    assert find_model_folder(DATASET, "3d_fullres") == plain
    remat3d = tmp_path / DATASET / "nnUNetTrainerRemat3d__nnUNetPlans__3d_fullres"
    remat3d.mkdir()
    assert find_model_folder(DATASET, "3d_fullres") == remat3d
    assert find_model_folder(DATASET, "3d_fullres", trainer="nnUNetTrainer") == plain

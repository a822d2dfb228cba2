"""nnU-Net v2's prediction on whole volumes: ``remat3d nnunet predict -i IN -o OUT -d DATASET
-c CONFIGURATION``.

What ``nnUNetv2_predict`` does, in one process, with one change: the network runs once on
each whole preprocessed case (:func:`remat3d.predict`, tiled under the device budget where
it must be) instead of on overlapping patch-sized windows. Everything else is nnU-Net's own
code: the model folder and its checkpoints, the preprocessing (cropping, resampling,
normalisation), test-time mirroring, the average over folds and the export (resampling back
to the original spacing, transposition, ``CASE.nii.gz``, ``--save_probabilities``'s
``.npz``/``.pkl``).

NOTE [ One window ]
The result is what nnU-Net's own predictor gives with its patch size set to the padded case
(one window; with one window its Gaussian weighting cancels, up to float16 rounding):

1. Each case is padded as nnU-Net's sliding window pads it (``pad_nd_image``: zeros, the
   content centred), to at least the configuration's patch size, then up to a multiple of
   the network's divisor (the product of its strides per axis), and cropped back after.
2. Mirroring flips the whole padded case on each of the checkpoint's allowed axes and
   combination of them, predicts, flips back and averages, as nnU-Net does per window.
3. The logits are then held in float16, as nnU-Net's sliding window holds them, and folds
   are summed and divided in float16 as nnU-Net does. Untiled, the outputs are nnU-Net's
   bit for bit; tiled, the float32 logits differ by rounding (about 1e-5), which float16
   can turn into one float16 step.

NOTE [ No half-written case ]
Each case is exported by nnU-Net into a hidden folder inside the output folder and its
files are then moved into place one by one (``os.replace``, atomic on one file system),
the segmentation last: a case's ``CASE.nii.gz`` exists only once its ``.npz`` and
``.pkl`` do, and a failure leaves none of its files behind (the hidden folder is removed).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import math
import os
import pickle
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor
from torch._dynamo import OptimizedModule  # what nnU-Net compiles its network into

from remat3d.errors import DataError, Remat3dError, WeightsError, quoted
from remat3d.predicting import PredictionPlan, plan_prediction, predict
from remat3d.units import format_shape

__all__ = ["CasePrediction", "NnUNetPrediction", "WholeVolumePredictor", "find_model_folder",
           "predict_nnunet"]

logger = logging.getLogger(__name__)

REMAT3D_TRAINER = "nnUNetTrainerRemat3d"  # what ``remat3d nnunet train`` writes


@dataclass
class CasePrediction:
    """One case written: its shapes and the plan that ran it."""

    case: str
    shape: tuple[int, ...]          # the preprocessed case (channels, spatial)
    padded_shape: tuple[int, ...]   # what the network ran on
    tiled_steps: int
    plan_summary: str


@dataclass
class NnUNetPrediction:
    """What :func:`predict_nnunet` did."""

    model_folder: Path
    folds: list[str]
    output_folder: Path
    cases: list[CasePrediction] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already predicted (continue)


class WholeVolumePredictor(nnUNetPredictor):  # nnU-Net's naming of its predictor's parts
    """nnU-Net's predictor whose sliding window is one window: the whole padded case, run
    by :func:`remat3d.predict` under ``budget`` (NOTE [ One window ])."""

    def __init__(self, *, budget: str | int | None = None, amp: str | None = None,
                 use_mirroring: bool = True, device: torch.device | None = None) -> None:
        device = torch.device("cpu") if device is None else device
        # nnU-Net's constructor prints a note on every device but CUDA; the library logs
        note = io.StringIO()
        with contextlib.redirect_stdout(note):
            super().__init__(tile_step_size=1.0, use_gaussian=False,
                             use_mirroring=use_mirroring,
                             perform_everything_on_device=device.type == "cuda",
                             device=device, verbose=False, allow_tqdm=False)
        if note.getvalue().strip():
            logger.debug("nnU-Net: %s", note.getvalue().strip())
        self.budget, self.amp = budget, amp
        self.prediction_plans: dict[tuple[int, ...], PredictionPlan] = {}  # by padded shape
        self.last_plan: PredictionPlan | None = None

    def divisor(self) -> list[int]:
        """The network's total downsampling per axis: what each spatial size must divide."""
        manager = self.configuration_manager
        strides = manager.network_arch_init_kwargs.get("strides") or \
            manager.pool_op_kernel_sizes
        axes = len(manager.patch_size)
        return [math.prod(int(s[axis]) for s in strides) for axis in range(axes)]

    def _plan(self, network: torch.nn.Module, shape: tuple[int, ...]) -> PredictionPlan:
        plan = self.prediction_plans.get(shape)
        if plan is None:
            plan = plan_prediction(network, shape, budget=self.budget, amp=self.amp,
                                   output="logits", device=self.device)
            logger.info("%s", plan.summary())
            self.prediction_plans[shape] = plan
        self.last_plan = plan
        return plan

    @torch.inference_mode()
    def predict_sliding_window_return_logits(self, input_image: torch.Tensor) -> torch.Tensor:
        """The whole case's logits (float16, on the CPU), mirrored where nnU-Net mirrors."""
        from acvl_utils.cropping_and_padding.padding import pad_nd_image

        network = self.network
        if isinstance(network, OptimizedModule):  # remat3d traces the module itself
            network = network._orig_mod
        network = network.to(self.device)
        data, revert = pad_nd_image(input_image, self.configuration_manager.patch_size,
                                    "constant", {"value": 0}, True, self.divisor())
        plan = self._plan(network, tuple(data.shape))
        axes = [a + 1 for a in self.allowed_mirroring_axes or ()] if self.use_mirroring \
            else []
        flips = [()] + [c for n in range(len(axes)) for c in itertools.combinations(axes, n + 1)]
        logits: torch.Tensor | None = None
        for flip in flips:  # summed on the CPU: the device holds one forward at a time
            x = torch.flip(data, flip) if flip else data
            y = predict(network, x, plan=plan).to("cpu", torch.float32)
            y = torch.flip(y, flip) if flip else y
            logits = y if logits is None else logits.add_(y)
        assert logits is not None
        if len(flips) > 1:
            logits /= len(flips)
        return logits.half()[(slice(None), *revert[1:])]


def find_model_folder(dataset: str, configuration: str, *, trainer: str | None = None,
                      plans: str = "nnUNetPlans") -> Path:
    """``nnUNet_results/DATASET/TRAINER__PLANS__CONFIGURATION``, as nnUNetv2_predict finds
    it; ``trainer`` None: :data:`REMAT3D_TRAINER`'s folder where ``remat3d nnunet train``
    made one, else ``nnUNetTrainer``'s (nnU-Net's default)."""
    from nnunetv2.paths import nnUNet_results
    from nnunetv2.utilities.dataset_name_id_conversion import maybe_convert_to_dataset_name

    if nnUNet_results is None:
        raise Remat3dError("nnU-Net's folders are not set: export nnUNet_results (and "
                           "nnUNet_raw, nnUNet_preprocessed) as for nnUNetv2_predict.")
    try:
        name = maybe_convert_to_dataset_name(dataset)
    except (RuntimeError, ValueError) as exc:
        raise DataError(f"No nnU-Net dataset {dataset!r}: {quoted(exc)} Give the dataset's "
                        "ID or its DatasetXXX_Name.") from None
    base = Path(nnUNet_results) / name
    candidates = [trainer] if trainer else [REMAT3D_TRAINER, "nnUNetTrainer"]
    for candidate in candidates:
        folder = base / f"{candidate}__{plans}__{configuration}"
        if folder.is_dir():
            return folder
    found = sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
    raise DataError(
        f"No trained model in {base / f'{candidates[0]}__{plans}__{configuration}'}"
        + (f" (nor {base / f'nnUNetTrainer__{plans}__{configuration}'})" if not trainer
           else "")
        + (f"; {base} holds {', '.join(found)}: pick one with -tr, -p and -c." if found
           else f"; {base} has no trained models: train one first (remat3d nnunet train or "
                "nnUNetv2_train)."))


def _folds(model_folder: Path, folds: list[str] | None, checkpoint: str) -> list[str]:
    """The folds asked for, each checked; None: every fold_N with the checkpoint (nnU-Net's
    auto-detection), else fold_all."""
    found = sorted(p.parent.name[len("fold_"):]
                   for p in model_folder.glob(f"fold_*/{checkpoint}"))
    numbered = sorted((f for f in found if f.isdigit()), key=int)
    if not folds:
        if numbered or "all" in found:
            return numbered or ["all"]
        raise DataError(f"No fold in {model_folder} has {checkpoint} (looked for "
                        f"fold_*/{checkpoint}): train a fold first, or name another "
                        "checkpoint with -chk.")
    for fold in folds:
        if fold != "all" and not fold.isdigit():
            raise DataError(f"Fold must be a number or all, got {fold!r}.")
        path = model_folder / f"fold_{fold}" / checkpoint
        if not path.is_file():
            what = "checkpoint" if path.parent.is_dir() else "fold folder"
            have = (f"Folds with {checkpoint}: {', '.join(found)} (-f)." if found else
                    f"No fold in {model_folder} has {checkpoint}.")
            raise DataError(f"No {what} for fold {fold}: {path} does not exist. {have}")
    return list(folds)


def _cases(input_folder: Path, file_ending: str, channels: int) -> dict[str, list[Path]]:
    """Case name -> its images (``CASE_0000`` ... one per channel), nnU-Net's naming; every
    case checked to have exactly the model's channels."""
    if not input_folder.is_dir():
        raise DataError(f"The input folder {input_folder} "
                        + ("is a file" if input_folder.exists() else "does not exist")
                        + ": give a folder of images named CASE_0000" + file_ending + ".")
    pattern = re.compile(r"(.+)_(\d{4})" + re.escape(file_ending))
    cases: dict[str, dict[int, Path]] = {}
    for path in sorted(input_folder.iterdir()):
        match = pattern.fullmatch(path.name)
        if match and path.is_file():
            cases.setdefault(match[1], {})[int(match[2])] = path
    if not cases:
        raise DataError(f"The input folder {input_folder} holds no images named "
                        f"CASE_0000{file_ending} (nnU-Net's naming: CASE_XXXX{file_ending}, "
                        "one file per channel).")
    for case, images in cases.items():
        if sorted(images) != list(range(channels)):
            expected = ", ".join(f"{case}_{c:04d}{file_ending}" for c in range(channels))
            got = ", ".join(p.name for _, p in sorted(images.items()))
            raise DataError(f"Case {case!r} in {input_folder} has {got}; the model takes "
                            f"{channels} channel{'s' * (channels != 1)}, one file each: "
                            f"{expected}.")
    return {case: [images[c] for c in range(channels)] for case, images in cases.items()}


def _write_json(content: Any, path: Path, *, sort_keys: bool = True) -> None:
    """nnU-Net's ``save_json``, through a temporary file."""
    from batchgenerators.utilities.file_and_folder_operations import save_json

    temporary = path.with_name(f".{path.name}.tmp")
    save_json(content, str(temporary), sort_keys=sort_keys)
    os.replace(temporary, path)


def _export(predictor: WholeVolumePredictor, logits: torch.Tensor, properties: dict,
            output_folder: Path, case: str, save_probabilities: bool) -> None:
    """nnU-Net's export of one case, moved into place (NOTE [ No half-written case ])."""
    from nnunetv2.inference.export_prediction import export_prediction_from_logits

    staging = Path(tempfile.mkdtemp(prefix=f".remat3d-{case}-", dir=output_folder))
    try:
        export_prediction_from_logits(logits, properties, predictor.configuration_manager,
                                      predictor.plans_manager, predictor.dataset_json,
                                      str(staging / case), save_probabilities)
        segmentation = case + predictor.dataset_json["file_ending"]
        names = sorted(p.name for p in staging.iterdir() if p.name != segmentation)
        for name in [*names, segmentation]:
            os.replace(staging / name, output_folder / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        where = torch.device(device)
    except RuntimeError:
        raise Remat3dError(f"Unknown device {device!r}: give cuda, cpu or auto.") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise Remat3dError(f"Device {device!r} asked for, and there is no CUDA device here: "
                           "give --device cpu (or auto).")
    return where


def predict_nnunet(input_folder: str | Path, output_folder: str | Path, dataset: str,
                   configuration: str, *, folds: list[str] | None = None,
                   trainer: str | None = None, plans: str = "nnUNetPlans",
                   checkpoint: str = "checkpoint_final.pth", save_probabilities: bool = False,
                   use_mirroring: bool = True, budget: str | int | None = "auto",
                   amp: str | None = "auto", device: str = "auto",
                   continue_prediction: bool = False) -> NnUNetPrediction:
    """nnUNetv2_predict's job on whole volumes (module docstring): every case in
    ``input_folder`` predicted and written to ``output_folder`` as nnU-Net writes it.

    ``budget``: the forward's device memory (``"8GiB"``, ``"0.5x"``, ``"auto"``: the CUDA
    device's free memory; on the CPU, the untiled forward). ``amp`` ``"auto"``: float16
    autocast on CUDA, as nnU-Net's predictor, none on the CPU. Existing outputs are
    overwritten, as nnUNetv2_predict does; ``continue_prediction`` skips the cases already
    written (nnUNetv2_predict's ``--continue_prediction``).
    """
    input_folder, output_folder = Path(input_folder), Path(output_folder)
    if output_folder.exists() and not output_folder.is_dir():
        raise DataError(f"The output folder {output_folder} is a file: give a folder (it is "
                        "made if it does not exist).")
    where = _device(device)
    if amp == "auto":
        amp = "fp16" if where.type == "cuda" else None
    if budget == "auto" and where.type != "cuda":
        budget = None  # no device to fit: the untiled forward
    model_folder = find_model_folder(dataset, configuration, trainer=trainer, plans=plans)
    chosen = _folds(model_folder, folds, checkpoint)
    predictor = WholeVolumePredictor(budget=budget, amp=amp, use_mirroring=use_mirroring,
                                     device=where)
    try:
        predictor.initialize_from_trained_model_folder(
            str(model_folder), tuple(f if f == "all" else int(f) for f in chosen), checkpoint)
    except (OSError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as exc:
        raise WeightsError(f"nnU-Net could not load the model in {model_folder} (folds "
                           f"{', '.join(chosen)}, {checkpoint}): {quoted(exc)}") from None
    manager = predictor.configuration_manager
    if manager.previous_stage_name is not None or len(manager.patch_size) != 3:
        raise Remat3dError(f"Configuration {configuration!r} is "
                           + ("a cascade's second stage" if manager.previous_stage_name
                              else "2D") + ": remat3d nnunet predict runs single-stage 3D "
                           "configurations (3d_fullres, 3d_lowres); use nnUNetv2_predict.")
    dataset_json = predictor.dataset_json
    channels = len(dataset_json.get("channel_names", dataset_json.get("modality", {})))
    cases = _cases(input_folder, dataset_json["file_ending"], channels)
    output_folder.mkdir(parents=True, exist_ok=True)
    result = NnUNetPrediction(model_folder, chosen, output_folder)
    # what nnUNetv2_predict writes beside the predictions (its sequential path's arguments)
    _write_json({"list_of_lists_or_source_folder": str(input_folder),
                 "output_folder_or_list_of_truncated_output_files": str(output_folder),
                 "save_probabilities": save_probabilities,
                 "overwrite": not continue_prediction,
                 "folder_with_segs_from_prev_stage": None,
                 "remat3d": {"model_folder": str(model_folder), "folds": chosen,
                             "checkpoint": checkpoint, "use_mirroring": use_mirroring,
                             "budget": budget, "amp": amp, "device": str(where)}},
                output_folder / "predict_from_raw_data_args.json")
    _write_json(dataset_json, output_folder / "dataset.json", sort_keys=False)
    _write_json(predictor.plans_manager.plans, output_folder / "plans.json", sort_keys=False)
    preprocessor = manager.preprocessor_class(verbose=False)
    for case, images in cases.items():
        done = (output_folder / f"{case}{dataset_json['file_ending']}").is_file() and (
            not save_probabilities or (output_folder / f"{case}.npz").is_file())
        if continue_prediction and done:
            result.skipped.append(case)
            continue
        data, _, properties = preprocessor.run_case([str(p) for p in images], None,
                                                    predictor.plans_manager, manager,
                                                    dataset_json)
        if data.shape[0] != channels:  # e.g. a file holding several channels
            raise DataError(f"Case {case!r} has {data.shape[0]} channels after reading "
                            f"{', '.join(p.name for p in images)}; the model takes "
                            f"{channels}: one channel per file.")
        logger.info("%s: %s", case, format_shape(data.shape))
        logits = predictor.predict_logits_from_preprocessed_data(
            torch.from_numpy(np.ascontiguousarray(data)).float())
        _export(predictor, logits, properties, output_folder, case, save_probabilities)
        plan = predictor.last_plan
        assert plan is not None
        result.cases.append(CasePrediction(
            case, tuple(data.shape), plan.shape[1:],
            plan.tiled_steps, plan.summary()))
        logger.info("%s written", case)
    return result

"""Run in a subprocess by test_nnunet_predict.py (nnU-Net reads its folders from environment
variables when first imported): nnU-Net v2's own predictor, one window per case.

    python -m tests.zoo.nnunet_reference MODEL_FOLDER FOLD INPUT_FOLDER OUTPUT_FOLDER [--tta]

For each case in INPUT_FOLDER, nnU-Net's ``nnUNetPredictor`` (its sequential path, on the
CPU) with the configuration's patch size set to the preprocessed case padded as remat3d
pads it (to at least the patch size, then to a multiple of the network's divisor): one
window covers the case. ``use_gaussian=False``: with one window the Gaussian weighting
divides out, except for its float16 rounding, which would only blur the comparison.
Writes CASE.nii.gz, CASE.npz and CASE.pkl, as nnUNetv2_predict --save_probabilities.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path


def main(model: str, fold: str, input_folder: Path, output_folder: Path, tta: bool) -> None:
    import torch
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor

    predictor = nnUNetPredictor(tile_step_size=0.5, use_gaussian=False, use_mirroring=tta,
                                perform_everything_on_device=False,
                                device=torch.device("cpu"), allow_tqdm=False)
    predictor.initialize_from_trained_model_folder(model, (fold,), "checkpoint_final.pth")
    manager = predictor.configuration_manager
    patch = list(manager.patch_size)
    strides = manager.network_arch_init_kwargs["strides"]
    divisor = [math.prod(s[axis] for s in strides) for axis in range(3)]
    ending = predictor.dataset_json["file_ending"]
    output_folder.mkdir(parents=True, exist_ok=True)
    cases = sorted({p.name[:-len(ending) - 5] for p in input_folder.glob(f"*{ending}")})
    for case in cases:
        images = sorted(str(p) for p in input_folder.glob(f"{case}_????{ending}"))
        data, _, _ = manager.preprocessor_class().run_case(
            images, None, predictor.plans_manager, manager, predictor.dataset_json)
        manager.configuration["patch_size"] = [
            math.ceil(max(n, p) / d) * d for n, p, d in zip(data.shape[1:], patch, divisor)]
        predictor.predict_from_files_sequential([images], [str(output_folder / case)],
                                                save_probabilities=True, overwrite=True)
        print(case, manager.patch_size)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]),
         "--tta" in sys.argv[5:])

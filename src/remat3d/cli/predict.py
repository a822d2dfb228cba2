"""``remat3d predict``: whole-volume prediction on image files within a device budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from remat3d.cli.common import console
from remat3d.errors import Remat3dError, SettingsError, WeightsError

__all__ = ["predict_command"]

_RUN_FILES = ("settings.yaml", "model.pt")
_INPUTS = typer.Argument(  # a list default: one shared instance (ruff B008)
    ..., help=(
    "NIfTI files or DICOM series folders; a network of C channels takes each case's "
    "channels as C consecutive files (case_0000.nii.gz case_0001.nii.gz) or one 4-D "
    "file."))


def predict_command(
    model: str = typer.Argument(..., help=(
        "A training run folder of remat3d train (its settings.yaml and model.pt: network, "
        "weights and preprocessing), or a model spec (zoo preset, package.module:Class, "
        ".py file, MONAI bundle, nnU-Net checkpoint) with --weights where it has none.")),
    inputs: list[str] = _INPUTS,
    out: str = typer.Option(..., "--out", "-o", help=(
        "Output folder: CASE.nii.gz per case, on the input's voxel grid.")),
    budget: str = typer.Option("auto", "--budget", "-b", help=(
        "Device memory: 8GiB, 0.5x (of the untiled forward), or auto (the device's free "
        "memory; on CPU, no limit).")),
    amp: str = typer.Option(None, "--amp", help=(
        "none, bf16 or fp16 (autocast); default: the run's, else none.")),
    output: str = typer.Option("labels", "--output", help=(
        "labels (argmax, uint8) or probabilities (softmax, one channel per class along "
        "the 4th axis, float32).")),
    weights: str = typer.Option(None, "--weights", "-w", help=(
        "Weights (.pt/.pth/.ckpt/.safetensors); default: the run's model.pt.")),
    model_kwargs: str = typer.Option(None, "--model-kwargs", help=(
        "Constructor keyword arguments (JSON/YAML/file), for a model spec.")),
    intensity: str = typer.Option(None, "--intensity", help=(
        "ct (window to [0, 1]), mr (z-score) or none; default: the run's, else none.")),
    ct_window: str = typer.Option(None, "--ct-window", help="LOW,HIGH in HU for ct."),
    spacing: str = typer.Option(None, "--spacing", help=(
        "Resample to X,Y,Z mm before predicting (back after); default: the run's.")),
    device: str = typer.Option("auto", "--device", help="cuda, cpu, or auto."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing outputs."),
) -> None:
    """Predict on whole volumes, exactly the network's whole-volume forward, tiled where
    the device budget needs it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from remat3d.data.volumes import Preprocessing
    from remat3d.infer.volumes import cases_from_inputs, predict_case
    from remat3d.train.trainer import model_geometry, resolve_device
    from remat3d.units import format_bytes, parse_amp

    if output not in ("labels", "probabilities"):
        raise Remat3dError(f"--output must be labels or probabilities, not {output!r}.")
    where = resolve_device(device)
    net, spec, kwargs, run = _model(model, Path(weights) if weights else None, model_kwargs)
    prep = _preprocessing(run.preprocessing() if run else Preprocessing(), intensity,
                          ct_window, spacing)
    amp_ = parse_amp(amp if amp is not None else run.amp if run else "none")
    geometry = model_geometry(spec, kwargs, net, run.divisible_by if run else None)
    cases = cases_from_inputs([Path(p) for p in inputs], geometry.in_channels, Path(out),
                              overwrite=overwrite)
    net = net.to(where).eval()
    limit = None if budget == "auto" and where.type == "cpu" else budget
    plans: dict[tuple[int, ...], Any] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("steps"))
    with Progress(*columns, console=console, transient=False) as bar:
        for case in cases:
            task = bar.add_task(escape(case.name), total=None)
            ran = predict_case(
                case, net, geometry, prep, budget=limit, amp=amp_, output=output,
                device=where, plans=plans,
                progress=lambda done, total, task=task: bar.update(task, completed=done,
                                                                   total=total))
            bar.update(task, description=f"{escape(case.name)} · {ran.tiled_steps} tiled "
                                         f"steps · device peak "
                                         f"{format_bytes(ran.verified_peak_bytes)}")
    console.print(f"{len(cases)} prediction(s) in {escape(out)}", highlight=False,
                  soft_wrap=True)


def _model(model: str, weights: Path | None, model_kwargs: str | None,
           ) -> tuple[Any, str, dict[str, Any], Any]:
    """The network with its weights, its spec and kwargs, and a run's settings (or
    ``None``)."""
    from remat3d import zoo
    from remat3d.train.settings import load_settings
    from remat3d.train.weights import load_pretrained

    folder = Path(model)
    run = None
    if folder.is_dir() and (folder / "settings.yaml").is_file():
        missing = [n for n in _RUN_FILES if not (folder / n).is_file()]
        if missing and weights is None:
            raise SettingsError(f"The run folder {str(folder)!r} has no {missing[0]}: the "
                                "run saved no weights yet. Give --weights.")
        if model_kwargs:
            raise SettingsError("--model-kwargs is for a model spec; a run folder's network "
                                "is the one its settings.yaml built.")
        run = load_settings(folder / "settings.yaml")
        spec, kwargs = run.model, dict(run.model_kwargs)
        weights = weights or folder / "model.pt"
    else:
        spec, kwargs = model, zoo.parse_model_kwargs(model_kwargs)
    net = zoo.build_model(spec, kwargs)
    if weights is None:
        if not _carries_weights(spec):
            raise WeightsError(
                f"{spec} builds a network with untrained weights. Give --weights, or a "
                "training run folder (remat3d train's output_dir).")
        return net, spec, kwargs, run
    report = load_pretrained(net, weights)
    if report.missing or report.mismatched:
        bad = report.missing[:3] or list(report.mismatched)[:3]
        raise WeightsError(
            f"The weights {str(weights)!r} do not fit {spec}: "
            f"{len(report.missing)} tensor(s) missing, {len(report.mismatched)} of another "
            f"shape (e.g. {', '.join(bad)}). Predict with the network they were trained as "
            "(its model kwargs).")
    return net, spec, kwargs, run


def _carries_weights(spec: str) -> bool:
    """A MONAI bundle or an nnU-Net checkpoint brings its trained weights."""
    from remat3d.zoo.bundle import is_bundle

    return is_bundle(spec) or spec.lower().endswith((".pth", ".pt", ".ckpt"))


def _preprocessing(base: Any, intensity: str | None, ct_window: str | None,
                   spacing: str | None) -> Any:
    """``base`` (the run's preprocessing, or the defaults) with the options given on top."""
    import dataclasses

    def numbers(text: str, count: int, option: str) -> tuple[float, ...]:
        try:
            values = tuple(float(v) for v in text.replace("x", ",").split(","))
        except ValueError:
            values = ()
        if len(values) != count:
            raise SettingsError(f"{option} takes {count} numbers separated by commas, got "
                                f"{text!r}.")
        return values

    given: dict[str, Any] = {}
    if intensity:
        given["intensity"] = intensity
    if ct_window:
        given["ct_window"] = numbers(ct_window, 2, "--ct-window")
    if spacing:
        given["spacing"] = numbers(spacing, 3, "--spacing")
    return dataclasses.replace(base, **given)

"""Model specs: a preset, ``package.module:Class``, a ``.py`` file with ``build_model()``,
nnU-Net v2's artefacts (``nnunetv2:PLANS_JSON:CONFIGURATION``, a checkpoint ``.pth``:
``zoo/nnunet.py``), or a MONAI bundle folder or ``.zip`` (``zoo/bundle.py``); constructor
kwargs from JSON/YAML text or a file.

What a spec may execute: a preset runs remat3d's and MONAI's code; ``package.module:Class``
imports that module (its import-time code runs, as with ``import``) and calls the class,
which must be an ``nn.Module`` subclass (never another callable: ``os:system`` is refused);
a ``.py`` file is run as Python code, so only name files you trust; nnU-Net's artefacts
run nnU-Net's code and import the network building blocks their plans name (``nn.Module``
classes only), and a checkpoint is read with ``weights_only=True``; a MONAI bundle's configs
are code (MONAI evaluates their expressions and calls their targets): name only bundles you
trust.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat3d.errors import ModelSpecError
from remat3d.zoo.bundle import build_from_bundle, is_bundle
from remat3d.zoo.meta import build_on_meta
from remat3d.zoo.nnunet import (
    NNUNET_PREFIX,
    build_from_checkpoint,
    build_from_plans,
    parse_plans_spec,
)
from remat3d.zoo.presets import PRESETS, SpatialSize, get_preset

__all__ = ["build_model", "parse_model_kwargs"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- kwargs

_KWARGS_EXAMPLE = (
    'Write a mapping of constructor arguments, e.g. \'{"in_channels": 4, "out_channels": 3}\' '
    "(JSON), 'in_channels: 4' (YAML), or a path to a .json/.yaml/.yml file holding one."
)


def parse_model_kwargs(text: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """Model constructor kwargs from a mapping, a JSON or YAML string, or a .json/.yaml file.

    >>> parse_model_kwargs('{"out_channels": 3}')
    {'out_channels': 3}
    >>> parse_model_kwargs("out_channels: 3")
    {'out_channels': 3}
    """
    if text is None:
        return {}
    if isinstance(text, Mapping):
        value: Any = text
    else:
        source = os.fspath(text)
        if isinstance(text, os.PathLike) or source.lower().endswith((".json", ".yaml", ".yml")):
            path = Path(source).expanduser()
            if not path.is_file():
                raise ModelSpecError(f"Model kwargs file {str(path)!r} does not exist.")
            source = path.read_text(encoding="utf-8")
        value = _load_json_or_yaml(source)
        if value is None:  # an empty string or file
            return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ModelSpecError(
            f"Model kwargs must be a mapping of argument names to values, got "
            f"{type(value).__name__} {value!r}. {_KWARGS_EXAMPLE}"
        )
    return dict(value)


def _load_json_or_yaml(source: str) -> Any:
    # JSON first: PyYAML reads YAML 1.1, where e.g. 1e-5 is a string, not a float.
    try:
        return json.loads(source)
    except json.JSONDecodeError:
        pass
    import yaml

    try:
        return yaml.safe_load(source)
    except yaml.YAMLError as exc:
        raise ModelSpecError(f"Cannot parse model kwargs {source!r}: {exc}. {_KWARGS_EXAMPLE}")


# --------------------------------------------------------------------------- build


def build_model(
    spec: str | os.PathLike[str],
    model_kwargs: Mapping[str, Any] | str | None = None,
    spatial_size: SpatialSize | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Build the network named by ``spec`` (a preset, ``package.module:Class`` or a .py file).

    ``device="meta"`` builds without allocating parameter memory, so a model of any size is
    built in milliseconds for tracing; other devices build on the CPU and move the model.

    >>> build_model("torch.nn:Conv3d", '{"in_channels": 1, "out_channels": 2, '
    ...             '"kernel_size": 3}', device="meta").weight.shape
    torch.Size([2, 1, 3, 3, 3])
    """
    kwargs = parse_model_kwargs(model_kwargs)
    spec_text = os.fspath(spec)
    constructor, label = _resolve_constructor(spec_text, spatial_size)
    on_meta = device is not None and torch.device(device).type == "meta"
    logger.debug("building %s with %s on %s", label, kwargs, device or "cpu")
    try:
        if on_meta:
            model = build_on_meta(constructor, kwargs)
        else:
            model = constructor(**kwargs)
    except ModelSpecError:
        raise
    except (TypeError, ValueError) as exc:
        raise ModelSpecError(
            f"Building {label} with model kwargs {kwargs} failed: {type(exc).__name__}: {exc}. "
            "Check the argument names and values against its constructor."
        ) from exc
    if not isinstance(model, nn.Module):
        raise ModelSpecError(
            f"{label} returned a {type(model).__name__}, not a torch.nn.Module. The spec must "
            "name a module class or a function returning one."
        )
    if device is not None and not on_meta:
        model = model.to(device)
    return model


def _resolve_constructor(
    spec: str, spatial_size: SpatialSize | None
) -> tuple[Callable[..., Any], str]:
    """The callable a spec names and a label for messages."""
    if spec.strip().lower() in PRESETS:
        preset = PRESETS[spec.strip().lower()]

        def construct(**kwargs: Any) -> nn.Module:
            return preset.factory(spatial_size, **kwargs)

        return construct, f"preset {preset.name!r}"
    if spec.startswith(NNUNET_PREFIX):
        plans, configuration = parse_plans_spec(spec)

        def from_plans(**kwargs: Any) -> nn.Module:
            return build_from_plans(plans, configuration, **kwargs)

        return from_plans, f"nnU-Net v2 configuration {configuration!r} of {str(plans)!r}"
    if is_bundle(spec):
        def from_bundle(**kwargs: Any) -> nn.Module:
            return build_from_bundle(spec, **kwargs)

        return from_bundle, f"MONAI bundle {spec!r}"
    if spec.lower().endswith((".pth", ".pt", ".ckpt")):
        def from_checkpoint(**kwargs: Any) -> nn.Module:
            return build_from_checkpoint(spec, **kwargs)

        return from_checkpoint, f"nnU-Net v2 checkpoint {spec!r}"
    if spec.endswith(".py") or Path(spec).is_file():
        return _load_model_file(Path(spec).expanduser()), f"build_model() in {spec!r}"
    if ":" in spec:
        return _import_object(spec), f"{spec!r}"
    get_preset(spec)  # not a preset either: raises the unknown-preset error with a suggestion
    raise AssertionError("unreachable")


def _import_object(spec: str) -> Callable[..., Any]:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ModelSpecError(
            f"Cannot read model spec {spec!r}. Write 'package.module:Class', e.g. "
            "'monai.networks.nets:UNet'."
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelSpecError(
            f"Cannot import module {module_name!r} of model spec {spec!r}: {exc}. Check the "
            "spelling and that the package is installed in this environment."
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ModelSpecError(
                f"Module {module_name!r} has no attribute {attr_path!r} (model spec {spec!r})."
            )
        obj = getattr(obj, part)
    # Only module classes: a spec comes from the command line or a shared settings file,
    # and any other callable (os:system) would be called with the user's kwargs. Factories
    # go in a .py file with build_model(), which is explicitly code.
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        what = "class" if isinstance(obj, type) else type(obj).__name__
        raise ModelSpecError(
            f"{spec!r} is a {what} that is not a subclass of torch.nn.Module; a "
            "'package.module:Name' spec must name an nn.Module class. To build a model with "
            "a function, put it in a .py file as build_model() and give that file's path."
        )
    return obj


def _load_model_file(path: Path) -> Callable[..., Any]:
    if not path.is_file():
        raise ModelSpecError(f"Model file {str(path)!r} does not exist.")
    # A private, path-derived module name: two files both called model.py do not collide,
    # and nothing shadows a real package.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"_remat3d_model_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ModelSpecError(f"Cannot load {str(path)!r} as a Python module.")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # any error in user code: report it against the file
        del sys.modules[module_name]
        raise ModelSpecError(
            f"Running model file {str(path)!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    build = getattr(module, "build_model", None)
    if not callable(build):
        raise ModelSpecError(
            f"Model file {str(path)!r} defines no build_model() function. Add "
            "'def build_model(**kwargs) -> torch.nn.Module: ...' to it."
        )
    return build

"""Models from nnU-Net v2's own artefacts: a plans file and a configuration, or a checkpoint.

nnU-Net v2 writes what it trains in two places: ``nnUNet_preprocessed/DatasetXXX/``
holds ``nnUNetPlans.json`` (each configuration's ``architecture``: the network class, its
keyword arguments, and which of them name classes, ``_kw_requires_import``) beside the
dataset's ``dataset.json`` (channels and labels); ``nnUNet_results/.../fold_N/
checkpoint_final.pth`` holds the same plans, configuration and dataset JSON in
``init_args`` and the weights in ``network_weights``. The specs

- ``nnunetv2:PLANS_JSON:CONFIGURATION`` (``dataset.json`` beside the plans file), and
- a path to a checkpoint (``.pth`` holding ``init_args``)

build exactly the network nnU-Net's trainer builds (its own ``build_network_architecture``,
with ``get_network_from_plans`` and nnU-Net's weight initialisation), with one output
(deep supervision off; pass ``deep_supervision: true`` for nnU-Net's list of outputs). A
checkpoint's weights are loaded too. Model kwargs change the task: ``out_channels`` (or
``num_classes``) gives a new head, ``in_channels`` (or ``input_channels``) a new first
convolution; what could not be loaded is reported.

What a spec may execute: nnU-Net's code, and the classes the plans name, imported like a
``package.module:Class`` spec and refused unless they are ``nn.Module`` subclasses (a
plans file is data, but it names classes to import). A checkpoint is read with
``torch.load(weights_only=True)``, allowing only the few non-tensor types nnU-Net stores.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import pydoc
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat3d.errors import ModelSpecError, quoted
from remat3d.zoo.fitting import checkpoint_safe_globals, load_fitting

__all__ = ["NNUNET_PREFIX", "build_from_checkpoint", "build_from_plans",
           "is_nnunet_checkpoint", "parse_plans_spec",
           "read_nnunet_checkpoint"]

logger = logging.getLogger(__name__)

NNUNET_PREFIX = "nnunetv2:"
_EXTRA = "pip install 'remat3d[nnunet]'"


def _require_nnunet(what: str) -> None:
    import importlib.util

    if importlib.util.find_spec("nnunetv2") is None:
        raise ModelSpecError(f"{what} needs nnU-Net v2 ('nnunetv2'), which is not installed. "
                             f"Install it with: {_EXTRA}")
    os.environ.setdefault("nnUNet_compile", "f")  # (read by its trainer; we build eagerly)


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ModelSpecError(f"{what} {str(path)!r} does not exist.")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSpecError(f"Cannot read {what} {str(path)!r}: {exc}.") from None
    if not isinstance(value, dict):
        raise ModelSpecError(f"{what} {str(path)!r} holds a {type(value).__name__}, not a "
                             "JSON object.")
    return value


def parse_plans_spec(spec: str) -> tuple[Path, str]:
    """``nnunetv2:PLANS_JSON:CONFIGURATION`` -> (plans path, configuration).

    >>> parse_plans_spec("nnunetv2:/data/Dataset001/nnUNetPlans.json:3d_fullres")
    (PosixPath('/data/Dataset001/nnUNetPlans.json'), '3d_fullres')
    """
    body = spec[len(NNUNET_PREFIX):]
    plans, sep, configuration = body.rpartition(":")
    if not sep or not plans or not configuration:
        raise ModelSpecError(
            f"Cannot read model spec {spec!r}. Write 'nnunetv2:PLANS_JSON:CONFIGURATION', e.g. "
            "'nnunetv2:nnUNet_preprocessed/Dataset001_X/nnUNetPlans.json:3d_fullres'.")
    return Path(plans).expanduser(), configuration


_SUPPLY = ("It is not part of the installed nnU-Net v2 or dynamic-network-architectures: "
           "install the code that defines it (the fork or project these plans come from) "
           "in this environment, or build the network yourself and give it as a model spec "
           "(package.module:Class with model kwargs, or a .py file defining build_model()).")


def _in_architectures(name: str) -> Any:
    """The class nnU-Net finds for a network class name that does not import: one of that
    (last) name inside ``dynamic_network_architectures.architectures`` (modules there that
    fail to import, such as those needing a torchvision built for another torch, are
    passed over; nnU-Net's own search stops at them)."""
    import importlib
    import pkgutil

    from dynamic_network_architectures import architectures

    last = name.split(".")[-1]
    for info in pkgutil.walk_packages(architectures.__path__, architectures.__name__ + ".",
                                      onerror=lambda _name: None):
        try:
            module = importlib.import_module(info.name)
        except Exception as exc:  # noqa: BLE001 - any failure: not where the class is
            logger.debug("looking for %s: %s does not import (%s)", last, info.name, exc)
            continue
        found = getattr(module, last, None)
        if isinstance(found, type):
            return found
    return None


def _check_classes(architecture: Mapping[str, Any], where: str) -> None:
    """The classes a plans file names must be ``nn.Module`` subclasses (module docstring)."""
    names = [("network_class_name", architecture.get("network_class_name"))]
    kwargs = architecture.get("arch_kwargs") or {}
    names += [(key, kwargs.get(key)) for key in architecture.get("_kw_requires_import") or ()]
    for key, name in names:
        if name is None and key != "network_class_name":
            continue
        if not isinstance(name, str) or not name:
            raise ModelSpecError(f"{where}: {key} must name a class, got {name!r}.")
        try:
            obj = pydoc.locate(name)
        except pydoc.ErrorDuringImport as exc:  # the module defining it fails to import
            raise ModelSpecError(
                f"{where}: {key} {name!r} could not be imported ({exc.exc.__name__}: "
                f"{quoted(exc.value)}). {_SUPPLY}") from None
        if obj is None and key == "network_class_name":
            obj = _in_architectures(name)  # where nnU-Net looks when the path is stale
            if obj is None:
                raise ModelSpecError(f"{where}: {key} {name!r} names no class that "
                                     f"imports. {_SUPPLY}")
        if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
            raise ModelSpecError(
                f"{where}: {key} {name!r} is not a torch.nn.Module class"
                + (" (it does not import)" if obj is None else "")
                + "; a plans file may only name network building blocks.")


def _network(plans: dict[str, Any], configuration: str, dataset_json: dict[str, Any],
             kwargs: dict[str, Any], where: str, trainer: str | None = None) -> nn.Module:
    """What nnU-Net's trainer builds for ``configuration``, with the task changes in
    ``kwargs`` (module docstring)."""
    from nnunetv2.utilities.label_handling.label_handling import determine_num_input_channels
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    manager = PlansManager(plans)
    if configuration not in plans.get("configurations", {}):
        raise ModelSpecError(
            f"{where} has no configuration {configuration!r}; it has "
            f"{', '.join(map(repr, plans.get('configurations', {})))}.")
    try:
        config = manager.get_configuration(configuration)
    except RuntimeError:  # plans from before the architecture block, of a network nnU-Net
        # does not know how to describe (it knows PlainConvUNet and ResidualEncoderUNet)
        name = plans["configurations"][configuration].get("UNet_class_name")
        raise ModelSpecError(f"{where}: configuration {configuration!r} names the network "
                             f"class {name!r} (UNet_class_name, plans written before nnU-Net "
                             f"v2's architecture block). {_SUPPLY}") from None
    _check_classes(plans["configurations"][configuration].get("architecture")
                   or {"network_class_name": config.network_arch_class_name,
                       "arch_kwargs": config.network_arch_init_kwargs,
                       "_kw_requires_import": config.network_arch_init_kwargs_req_import},
                   where)
    unknown = set(kwargs) - {"in_channels", "input_channels", "out_channels", "num_classes",
                             "deep_supervision"}
    if unknown:
        raise ModelSpecError(
            f"Model kwargs {', '.join(sorted(unknown))} do not apply to an nnU-Net v2 model "
            f"({where}): the plans set the architecture. Accepted: in_channels, "
            "out_channels, deep_supervision.")
    try:
        inputs = determine_num_input_channels(manager, config, dataset_json)
        outputs = manager.get_label_manager(dataset_json).num_segmentation_heads
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelSpecError(f"{where}: its dataset.json does not say the channels and "
                             f"labels nnU-Net needs ({type(exc).__name__}: {exc}).") from None
    inputs = int(kwargs.get("in_channels", kwargs.get("input_channels", inputs)))
    outputs = int(kwargs.get("out_channels", kwargs.get("num_classes", outputs)))
    build = _trainer_class(trainer).build_network_architecture
    deep = bool(kwargs.get("deep_supervision", False))
    if "plans_manager" in inspect.signature(build).parameters:  # nnU-Net >= 2.6
        return build(manager, config, inputs, outputs, deep)
    return build(config.network_arch_class_name, config.network_arch_init_kwargs,
                 config.network_arch_init_kwargs_req_import, inputs, outputs, deep)


def _trainer_class(name: str | None) -> Any:
    """nnU-Net's trainer class of that name, looked up inside nnU-Net as its inference does
    (``nnUNetTrainer`` when none is named or it is not found there)."""
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

    if not name or name == "nnUNetTrainer":
        return nnUNetTrainer
    import nnunetv2
    from nnunetv2.utilities.find_class_by_name import recursive_find_python_class

    found = recursive_find_python_class(
        str(Path(nnunetv2.__path__[0]) / "training" / "nnUNetTrainer"), name,
        "nnunetv2.training.nnUNetTrainer")
    # (nnU-Net's own lookup also imports trainers from nnUNet_extTrainer's folder: code
    # that a checkpoint names, which a model spec does not run)
    if found is None:
        logger.warning("nnU-Net trainer %r is not part of nnunetv2; building its network "
                       "as nnUNetTrainer does", name)
        return nnUNetTrainer
    return found


def build_from_plans(plans_path: str | os.PathLike[str], configuration: str,
                     **kwargs: Any) -> nn.Module:
    """The network of ``configuration`` in an nnU-Net v2 plans file, with ``dataset.json``
    beside it (module docstring)."""
    _require_nnunet("An nnunetv2:PLANS:CONFIGURATION model spec")
    plans_path = Path(plans_path).expanduser()
    plans = _read_json(plans_path, "nnU-Net plans file")
    dataset_json = _read_json(plans_path.parent / "dataset.json",
                              "The dataset.json beside the plans file,")
    return _network(plans, configuration, dataset_json, kwargs, f"plans {str(plans_path)!r}")


# -- checkpoints ----------------------------------------------------------------------

def read_nnunet_checkpoint(path: str | os.PathLike[str]) -> Any:
    """An nnU-Net v2 checkpoint's content, read with ``weights_only=True`` and the types
    nnU-Net stores allowed (:func:`checkpoint_safe_globals`)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelSpecError(f"Checkpoint {str(path)!r} does not exist.")
    try:
        with torch.serialization.safe_globals(checkpoint_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file
        raise ModelSpecError(
            f"Cannot read checkpoint {str(path)!r}: {type(exc).__name__}: {quoted(exc)} "
            "An nnU-Net v2 checkpoint holds tensors, plain Python values and numpy "
            "scalars; this one holds something else or is damaged.") from None


def is_nnunet_checkpoint(content: Any) -> bool:
    return (isinstance(content, Mapping) and isinstance(content.get("init_args"), Mapping)
            and isinstance(content.get("network_weights"), Mapping))


def build_from_checkpoint(path: str | os.PathLike[str], **kwargs: Any) -> nn.Module:
    """The network an nnU-Net v2 checkpoint was trained as, with its weights (module
    docstring); tensors that do not fit a changed task are left as initialised and
    logged."""
    _require_nnunet("An nnU-Net v2 checkpoint as a model spec")
    where = f"checkpoint {str(path)!r}"
    content = read_nnunet_checkpoint(path)
    if not is_nnunet_checkpoint(content):
        keys = list(content)[:8] if isinstance(content, Mapping) else type(content).__name__
        raise ModelSpecError(
            f"{where} is not an nnU-Net v2 checkpoint (no 'init_args' with the plans and "
            f"'network_weights'; found {keys}). To load plain weights into a model, give "
            "it as pretrained: instead.")
    init = content["init_args"]
    try:
        plans, configuration, dataset_json = (init["plans"], init["configuration"],
                                              init["dataset_json"])
    except KeyError as exc:
        raise ModelSpecError(f"{where}: its init_args lack {exc}.") from None
    model = _network(dict(plans), str(configuration), dict(dataset_json), kwargs, where,
                     content.get("trainer_name"))
    load_fitting(model, {k.removeprefix("_orig_mod."): v
                         for k, v in content["network_weights"].items()}, where)
    return model

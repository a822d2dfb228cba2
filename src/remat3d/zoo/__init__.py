"""Model presets of the field's standard 3D networks (built through MONAI) and model specs.

A *model spec* is what the command line's ``--model`` takes:

- a preset name from :data:`PRESETS` (below);
- ``package.module:Class`` — imported, then called as ``Class(**model_kwargs)``;
- a path to a ``.py`` file that defines ``build_model(**model_kwargs) -> nn.Module``.

Every preset knows which input shapes it accepts. The rules, found by running each network
forward in training mode at batch size 1 with MONAI 1.6 (a BatchNorm or InstanceNorm layer
fails in training when it sees one value per channel, which sets ``min_size``):

=========  ======================================  =======  ========  ========================
preset     network and config source               divisor  min_size  why
=========  ======================================  =======  ========  ========================
nnunet     DynUNet as nnU-Net 3d_fullres (CT)      32       64        5 stride-2 stages; the
                                                                      2³ bottleneck needs >1
                                                                      voxel for InstanceNorm
unet       UNet of MONAI's spleen CT bundle        16       32        4 stride-2 stages;
                                                                      BatchNorm at 2³
basicunet  BasicUNet, MONAI defaults               1        32        pads internally, any
                                                                      size works; 4 poolings
segresnet  SegResNet, 16 filters                   8        8         3 stride-2 stages
swinunetr  SwinUNETR, feature_size 48              32       64        patch 2 + 4 mergings
unetr      UNETR, ViT-B/16, img_size = input       16       16        16³ patch embedding;
                                                                      built for one size only
resnet3d   MONAI resnet18, 2 classes               1        17        global pooling; BatchNorm
                                                                      after 2^4 downsampling
revunet    remat3d.nn.RevUNet (partially           8        16        3 stride-2 stages; the
           reversible, 16..128 channels)                              2³ bottleneck needs >1
                                                                      voxel for InstanceNorm
=========  ======================================  =======  ========  ========================

``min_size`` applies to every spatial edge: a simple sufficient rule (some anisotropic shapes
with one smaller edge also run). With batch size 2 or more, the BatchNorm models accept
smaller inputs too.

>>> check_input_shape("nnunet", (1, 1, 100, 128, 128))
Traceback (most recent call last):
...
remat3d.errors.InputShapeError: nnunet needs every spatial size divisible by 32 (2^5 \
downsamplings); got 1x1x100x128x128 (D=100 is not). Pad to 1x1x128x128x128.
>>> legal_shape("unet", (2, 1, 20, 40, 33))
(2, 1, 32, 48, 48)
>>> smallest_input_shape("segresnet")
(1, 1, 8, 8, 8)
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import importlib.util
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat3d.errors import InputShapeError, ModelSpecError
from remat3d.units import format_shape

__all__ = [
    "PRESETS",
    "Preset",
    "build_model",
    "check_input_shape",
    "get_preset",
    "legal_shape",
    "parse_model_kwargs",
    "preset_names",
    "smallest_input_shape",
]

logger = logging.getLogger(__name__)

SpatialSize = tuple[int, ...]


@dataclass(frozen=True)
class Preset:
    """A named, ready-to-build 3D network and the input shapes it accepts.

    ``factory(spatial_size, **kwargs)`` builds the network; ``kwargs`` override the preset's
    defaults. Only ``unetr`` uses ``spatial_size`` (its position embedding is sized to it).
    Every spatial edge of the input must be a multiple of ``divisor`` and at least ``min_size``
    (batch size 1, training mode); ``divisor_rule`` and ``min_size_rule`` say why, in words.
    """

    name: str
    description: str
    divisor: int
    min_size: int
    divisor_rule: str
    min_size_rule: str
    factory: Callable[..., nn.Module] = field(repr=False)
    in_channels: int = 1
    out_channels: int = 2
    task: str = "segmentation"  # or "classification": output (B, out_channels), no space


# --------------------------------------------------------------------------- factories
# MONAI is imported inside each factory so that `import remat3d` stays fast.


def _nnunet(spatial_size: SpatialSize | None = None, **kwargs: Any) -> nn.Module:
    from monai.networks.nets import DynUNet

    # nnU-Net's rule: filters double per stage from 32, capped at 320; the decoder's
    # transposed convolutions undo the encoder strides. Overriding `strides` keeps that rule.
    strides = list(kwargs.pop("strides", (1, 2, 2, 2, 2, 2)))
    config: dict[str, Any] = {
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 2,
        "kernel_size": [3] * len(strides),
        "strides": strides,
        "upsample_kernel_size": strides[1:],
        "filters": [min(32 * 2**i, 320) for i in range(len(strides))],
        "norm_name": ("INSTANCE", {"affine": True}),
        "act_name": ("leakyrelu", {"negative_slope": 0.01, "inplace": True}),
        "deep_supervision": False,
        "res_block": False,
    }
    return DynUNet(**{**config, **kwargs})


def _unet(spatial_size: SpatialSize | None = None, **kwargs: Any) -> nn.Module:
    from monai.networks.nets import UNet

    config = {
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 2,
        "channels": (16, 32, 64, 128, 256),
        "strides": (2, 2, 2, 2),
        "num_res_units": 2,
        "norm": "BATCH",
    }
    return UNet(**{**config, **kwargs})


def _basicunet(spatial_size: SpatialSize | None = None, **kwargs: Any) -> nn.Module:
    from monai.networks.nets import BasicUNet

    config = {
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 2,
        "features": (32, 32, 64, 128, 256, 32),
    }
    return BasicUNet(**{**config, **kwargs})


def _segresnet(spatial_size: SpatialSize | None = None, **kwargs: Any) -> nn.Module:
    from monai.networks.nets import SegResNet

    config = {
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 2,
        "init_filters": 16,
        "blocks_down": (1, 2, 2, 4),
        "blocks_up": (1, 1, 1),
    }
    return SegResNet(**{**config, **kwargs})


def _require_einops(preset: str) -> None:
    # MONAI imports einops lazily, so without it the model builds and then fails mid-forward.
    if importlib.util.find_spec("einops") is None:
        raise ModelSpecError(
            f"The {preset} preset needs the 'einops' package (MONAI's transformer blocks use "
            "it), which is not installed. Install it with: pip install einops"
        )


def _swinunetr(spatial_size: SpatialSize | None = None, **kwargs: Any) -> nn.Module:
    _require_einops("swinunetr")
    from monai.networks.nets import SwinUNETR

    # MONAI >= 1.5 dropped the img_size argument; the network takes any multiple of 32.
    config = {"spatial_dims": 3, "in_channels": 1, "out_channels": 2, "feature_size": 48}
    return SwinUNETR(**{**config, **kwargs})


def _unetr(spatial_size: SpatialSize | None = None, **kwargs: Any) -> nn.Module:
    _require_einops("unetr")
    from monai.networks.nets import UNETR

    if "img_size" not in kwargs:
        if spatial_size is None:
            raise ModelSpecError(
                "The unetr preset is built for one input size (its position embedding has one "
                "entry per 16³ patch). Pass spatial_size=(D, H, W), or img_size in the model "
                'kwargs, e.g. {"img_size": [96, 96, 96]}.'
            )
        kwargs["img_size"] = tuple(spatial_size)
    config = {
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 2,
        "feature_size": 16,
        "hidden_size": 768,
        "mlp_dim": 3072,
        "num_heads": 12,
    }
    return UNETR(**{**config, **kwargs})


def _resnet3d(spatial_size: SpatialSize | None = None, **kwargs: Any) -> nn.Module:
    from monai.networks.nets import resnet18

    # Accept the names every other preset uses as well as MONAI's own.
    if "in_channels" in kwargs:
        kwargs["n_input_channels"] = kwargs.pop("in_channels")
    if "out_channels" in kwargs:
        kwargs["num_classes"] = kwargs.pop("out_channels")
    config = {"spatial_dims": 3, "n_input_channels": 1, "num_classes": 2}
    return resnet18(**{**config, **kwargs})


def _revunet(spatial_size: SpatialSize | None = None, **kwargs: Any) -> nn.Module:
    from remat3d.nn.revunet import RevUNet

    # Partially reversible U-Net (Brügger et al. 2019): a reversible sequence of additive
    # couplings per level and path, plain strided / transposed convolutions between levels.
    config = {
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 2,
        "channels": (16, 32, 64, 128),
        "blocks": 2,
        "norm": ("instance", {"affine": True}),
    }
    return RevUNet(**{**config, **kwargs})


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "nnunet",
            "DynUNet configured like nnU-Net 3d_fullres for CT (32..320 filters, 6 stages, "
            "InstanceNorm, LeakyReLU); divisor 32, min 64.",
            divisor=32,
            min_size=64,
            divisor_rule="2^5 downsamplings",
            min_size_rule="the 2^5-downsampled bottleneck must hold more than one voxel for "
            "InstanceNorm in training",
            factory=_nnunet,
        ),
        Preset(
            "unet",
            "MONAI UNet as in the MONAI spleen CT segmentation bundle (16..256 channels, "
            "2 residual units, BatchNorm); divisor 16, min 32.",
            divisor=16,
            min_size=32,
            divisor_rule="2^4 downsamplings",
            min_size_rule="BatchNorm at the 2^4-downsampled bottleneck must see more than one "
            "value at batch size 1",
            factory=_unet,
        ),
        Preset(
            "basicunet",
            "MONAI BasicUNet with its default features (32, 32, 64, 128, 256, 32); any size "
            "from 32 (it pads skip connections itself).",
            divisor=1,
            min_size=32,
            divisor_rule="it pads odd sizes itself",
            min_size_rule="the bottleneck after 4 max-poolings must hold more than one voxel "
            "for InstanceNorm in training",
            factory=_basicunet,
        ),
        Preset(
            "segresnet",
            "MONAI SegResNet (init_filters 16, blocks_down (1, 2, 2, 4), blocks_up (1, 1, 1)), "
            "the BraTS configuration; divisor 8, min 8.",
            divisor=8,
            min_size=8,
            divisor_rule="2^3 downsamplings",
            min_size_rule="one voxel at the 2^3-downsampled bottleneck",
            factory=_segresnet,
        ),
        Preset(
            "swinunetr",
            "MONAI SwinUNETR with feature_size 48 (the BTCV / BraTS configuration); "
            "divisor 32, min 64.",
            divisor=32,
            min_size=64,
            divisor_rule="2^5 downsamplings: patch 2, then 4 patch mergings",
            min_size_rule="the 2^5-downsampled bottleneck must hold more than one voxel for "
            "InstanceNorm in training",
            factory=_swinunetr,
        ),
        Preset(
            "unetr",
            "MONAI UNETR (ViT-B/16: hidden 768, 12 heads; feature_size 16), built for one "
            "input size; divisor 16, min 16.",
            divisor=16,
            min_size=16,
            divisor_rule="16^3 patch embedding",
            min_size_rule="one 16^3 patch",
            factory=_unetr,
        ),
        Preset(
            "resnet3d",
            "MONAI 3D ResNet-18 classifier (1 input channel, 2 classes); any size from 17.",
            divisor=1,
            min_size=17,
            divisor_rule="global average pooling takes any size",
            min_size_rule="BatchNorm after the max-pool and 3 stride-2 stages "
            "must see more than one value at batch size 1",
            factory=_resnet3d,
            task="classification",
        ),
        Preset(
            "revunet",
            "Partially reversible 3D U-Net (remat3d.nn.RevUNet): channels (16, 32, 64, 128), "
            "2 additive couplings per level and path, InstanceNorm; divisor 8, min 16.",
            divisor=8,
            min_size=16,
            divisor_rule="2^3 downsamplings",
            min_size_rule="the 2^3-downsampled bottleneck must hold more than one voxel for "
            "InstanceNorm in training",
            factory=_revunet,
        ),
    )
}


# --------------------------------------------------------------------------- lookup


def preset_names() -> list[str]:
    """Names of the presets, in table order."""
    return list(PRESETS)


def get_preset(name: str | Preset) -> Preset:
    """The preset called ``name`` (case-insensitive); a :class:`Preset` is returned as is."""
    if isinstance(name, Preset):
        return name
    key = str(name).strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    close = difflib.get_close_matches(key, PRESETS, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ModelSpecError(
        f"Unknown model preset {name!r}.{hint} Available presets: {', '.join(PRESETS)}. "
        "Or pass 'package.module:Class' or a path to a .py file defining build_model()."
    )


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
            model = _build_on_meta(constructor, kwargs)
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
    if not callable(obj):
        raise ModelSpecError(
            f"{spec!r} is a {type(obj).__name__}, not a class or function; a model spec must "
            "name something that builds an nn.Module."
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


def _build_on_meta(constructor: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    # NOTE [ Building on meta ]
    # `with torch.device("meta")` makes every factory call allocate nothing. Some constructors
    # read a tensor back as a Python number while building (SwinUNETR calls .item() on a
    # torch.linspace of drop-path rates), which meta tensors cannot do. For those, build on
    # the CPU and move each parameter and buffer to meta as it is registered, so only one
    # parameter at a time is ever materialised.
    try:
        with torch.device("meta"):
            return constructor(**kwargs)
    except (RuntimeError, NotImplementedError) as exc:
        if "meta" not in str(exc):
            raise
        logger.debug("constructor needs real tensors (%s); registering parameters on meta", exc)
    with _parameters_on_meta():
        return constructor(**kwargs)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter and buffer registered while this is active moves to meta, through
    PyTorch's module registration hooks (removed on the way out, whatever happened)."""
    from torch.nn.modules.module import (
        register_module_buffer_registration_hook,
        register_module_parameter_registration_hook,
    )

    def to_meta_parameter(module: nn.Module, name: str, param: nn.Parameter | None
                          ) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    def to_meta_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None
                       ) -> torch.Tensor | None:
        return None if tensor is None or tensor.is_meta else tensor.to("meta")

    handles = [register_module_parameter_registration_hook(to_meta_parameter),
               register_module_buffer_registration_hook(to_meta_buffer)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------- shapes


def _legal_edge(preset: Preset, size: int) -> int:
    size = max(int(size), preset.min_size)
    return math.ceil(size / preset.divisor) * preset.divisor


def legal_shape(preset: str | Preset, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with each spatial edge (the last three) padded up to the nearest legal size."""
    preset = get_preset(preset)
    if len(shape) < 3:
        raise InputShapeError(
            f"An input shape needs three spatial sizes (D, H, W), got {format_shape(shape)}."
        )
    return tuple(int(s) for s in shape[:-3]) + tuple(_legal_edge(preset, s) for s in shape[-3:])


def smallest_input_shape(preset: str | Preset) -> tuple[int, int, int, int, int]:
    """``(1, in_channels, m, m, m)`` for the smallest legal edge ``m``."""
    preset = get_preset(preset)
    m = _legal_edge(preset, 1)
    return (1, preset.in_channels, m, m, m)


def check_input_shape(
    preset: str | Preset,
    shape: tuple[int, ...],
    model_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Raise :class:`InputShapeError` unless ``shape`` (B, C, D, H, W) suits the preset.

    ``model_kwargs`` are the kwargs the model is built with; an ``in_channels`` there
    (``n_input_channels`` for resnet3d) replaces the preset's default channel count. The
    divisibility rule is the preset's default one (overriding strides can change it).
    """
    preset = get_preset(preset)
    shape = tuple(int(s) for s in shape)
    if len(shape) != 5:
        raise InputShapeError(
            f"{preset.name} takes a 5-D input (batch, channels, D, H, W); got {len(shape)} dims: "
            f"{format_shape(shape)}. Example of a legal shape: "
            f"{format_shape(smallest_input_shape(preset))}."
        )
    kwargs = model_kwargs or {}
    in_channels = kwargs.get("in_channels", kwargs.get("n_input_channels", preset.in_channels))
    if shape[1] != in_channels:
        raise InputShapeError(
            f"{preset.name} is built for {in_channels} input channel(s); got {shape[1]} in "
            f"{format_shape(shape)}. Pass in_channels={shape[1]} in the model kwargs, or give "
            f"the input {in_channels} channel(s)."
        )
    fixed = legal_shape(preset, shape)
    if fixed == shape:
        return
    spatial = dict(zip("DHW", shape[2:]))
    small = [axis for axis, size in spatial.items() if size < preset.min_size]
    ragged = [axis for axis, size in spatial.items() if size % preset.divisor]
    rules = []
    if ragged:
        rules.append(f"divisible by {preset.divisor} ({preset.divisor_rule})")
    if small:
        rules.append(f"at least {preset.min_size} ({preset.min_size_rule})")
    offending = ", ".join(f"{axis}={spatial[axis]}" for axis in "DHW" if axis in small + ragged)
    verb = "is not" if len(set(small + ragged)) == 1 else "are not"
    raise InputShapeError(
        f"{preset.name} needs every spatial size {' and '.join(rules)}; got {format_shape(shape)} "
        f"({offending} {verb}). Pad to {format_shape(fixed)}."
    )

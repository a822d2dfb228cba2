"""The presets: the field's standard 3D networks (built through MONAI) and their shapes.

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
nnunetv2   nnU-Net v2's own PlainConvUNet          32       64        as nnunet (same
           (dynamic-network-architectures),                           architecture; the
           3d_fullres for an isotropic CT dataset                     decoder concatenates
                                                                      in its own forward)
resenc-l   nnU-Net v2's ResEnc-L                   32       64        as nnunet
           (ResidualEncoderUNet, blocks
           1,3,4,6,6,6, 1 decoder conv per stage)
=========  ======================================  =======  ========  ========================

``min_size`` applies to every spatial edge: a simple sufficient rule (some anisotropic shapes
with one smaller edge also run). With batch size 2 or more, the BatchNorm models accept
smaller inputs too.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from remat3d.errors import ModelSpecError

__all__ = ["PRESETS", "Preset", "get_preset", "preset_names"]

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


def _require_dna(preset: str) -> None:
    if importlib.util.find_spec("dynamic_network_architectures") is None:
        raise ModelSpecError(
            f"The {preset} preset is nnU-Net v2's own network, from the "
            "'dynamic-network-architectures' package, which is not installed. Install it "
            "with: pip install 'remat3d[nnunet]'"
        )


def _nnunetv2_config(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What nnU-Net v2's planner writes for 3d_fullres on an isotropic CT dataset: 6
    stages, features doubling from 32 and capped at 320, kernel 3, strides 1,2,2,2,2,2,
    InstanceNorm (eps 1e-5, affine), in-place LeakyReLU, biased convolutions. Overriding
    ``strides`` keeps the rule for the rest. ``in_channels``/``out_channels`` are
    accepted for ``input_channels``/``num_classes``, as in every preset."""
    from torch import nn as torch_nn

    if "in_channels" in kwargs:
        kwargs["input_channels"] = kwargs.pop("in_channels")
    if "out_channels" in kwargs:
        kwargs["num_classes"] = kwargs.pop("out_channels")
    strides = [list(s) if isinstance(s, (list, tuple)) else [s] * 3
               for s in kwargs.pop("strides", [1, 2, 2, 2, 2, 2])]
    stages = len(strides)
    return {
        "input_channels": 1,
        "num_classes": 2,
        "n_stages": stages,
        "features_per_stage": [min(32 * 2**i, 320) for i in range(stages)],
        "conv_op": torch_nn.Conv3d,
        "kernel_sizes": [[3, 3, 3]] * stages,
        "strides": strides,
        "conv_bias": True,
        "norm_op": torch_nn.InstanceNorm3d,
        "norm_op_kwargs": {"eps": 1e-5, "affine": True},
        "nonlin": torch_nn.LeakyReLU,
        "nonlin_kwargs": {"inplace": True},
        "deep_supervision": False,
    }


def _nnunetv2(spatial_size: SpatialSize | None = None, **kwargs: Any) -> nn.Module:
    _require_dna("nnunetv2")
    from dynamic_network_architectures.architectures.unet import PlainConvUNet

    config = _nnunetv2_config(kwargs)
    stages = config["n_stages"]
    config.update(n_conv_per_stage=[2] * stages, n_conv_per_stage_decoder=[2] * (stages - 1))
    return PlainConvUNet(**{**config, **kwargs})


def _resenc_l(spatial_size: SpatialSize | None = None, **kwargs: Any) -> nn.Module:
    _require_dna("resenc-l")
    from dynamic_network_architectures.architectures.unet import ResidualEncoderUNet

    config = _nnunetv2_config(kwargs)
    stages = config["n_stages"]
    config.update(n_blocks_per_stage=[1, 3, 4, 6, 6, 6, 6, 6][:stages],
                  n_conv_per_stage_decoder=[1] * (stages - 1))
    return ResidualEncoderUNet(**{**config, **kwargs})


# the shape rules of the nnU-Net-style networks: six stages, five stride-2 downsamplings
_FIVE_DOWNSAMPLINGS: dict[str, Any] = {
    "divisor": 32,
    "min_size": 64,
    "divisor_rule": "2^5 downsamplings",
    "min_size_rule": "the 2^5-downsampled bottleneck must hold more than one voxel for "
                     "InstanceNorm in training",
}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "nnunet",
            "DynUNet configured like nnU-Net 3d_fullres for CT (32..320 filters, 6 stages, "
            "InstanceNorm, LeakyReLU); divisor 32, min 64.",
            **_FIVE_DOWNSAMPLINGS,
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
        Preset(
            "nnunetv2",
            "nnU-Net v2's own PlainConvUNet (dynamic-network-architectures) as its planner "
            "configures 3d_fullres for isotropic CT: 32..320 features, 6 stages, 2 convs "
            "per stage, InstanceNorm, LeakyReLU; divisor 32, min 64. Needs "
            "remat3d[nnunet].",
            **_FIVE_DOWNSAMPLINGS,
            factory=_nnunetv2,
        ),
        Preset(
            "resenc-l",
            "nnU-Net v2's ResEnc-L (ResidualEncoderUNet: residual blocks 1,3,4,6,6,6, one "
            "decoder conv per stage, 32..320 features); divisor 32, min 64. Needs "
            "remat3d[nnunet].",
            **_FIVE_DOWNSAMPLINGS,
            factory=_resenc_l,
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

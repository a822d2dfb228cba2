"""The calls a tiled run may hold, by name: argument names and defaults of the ones the
executor rewrites, and the sets of ops that are refused or allowed only as no-ops."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["DEFAULTS", "DIM_OPS", "DROPOUT", "REFUSED", "SCALAR_READS", "SHAPE_OPS",
           "SIGNATURES", "bind", "func_name"]

# argument names of the calls the executor rewrites, in positional order
SIGNATURES: dict[str, tuple[str, ...]] = {
    "conv3d": ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    "conv_transpose3d": ("input", "weight", "bias", "stride", "padding", "output_padding",
                         "groups", "dilation"),
    "max_pool3d": ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
                   "return_indices"),
    "avg_pool3d": ("input", "kernel_size", "stride", "padding", "ceil_mode",
                   "count_include_pad", "divisor_override"),
    "interpolate": ("input", "size", "scale_factor", "mode", "align_corners",
                    "recompute_scale_factor", "antialias"),
    "instance_norm": ("input", "running_mean", "running_var", "weight", "bias",
                      "use_input_stats", "momentum", "eps"),
    "group_norm": ("input", "num_groups", "weight", "bias", "eps"),
    "batch_norm": ("input", "running_mean", "running_var", "weight", "bias", "training",
                   "momentum", "eps"),
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "conv3d": {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1},
    "conv_transpose3d": {"bias": None, "stride": 1, "padding": 0, "output_padding": 0,
                         "groups": 1, "dilation": 1},
    "max_pool3d": {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False,
                   "return_indices": False},
    "avg_pool3d": {"stride": None, "padding": 0, "ceil_mode": False,
                   "count_include_pad": True, "divisor_override": None},
    "interpolate": {"size": None, "scale_factor": None, "mode": "nearest",
                    "align_corners": None, "recompute_scale_factor": None,
                    "antialias": False},
    "instance_norm": {"running_mean": None, "running_var": None, "weight": None,
                      "bias": None, "use_input_stats": True, "momentum": 0.1, "eps": 1e-5},
    "group_norm": {"weight": None, "bias": None, "eps": 1e-5},
    "batch_norm": {"weight": None, "bias": None, "training": False, "momentum": 0.1,
                   "eps": 1e-5},
}
DROPOUT = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                      "feature_alpha_dropout"})
# ops whose result mixes voxels along a dimension named by an argument
DIM_OPS = frozenset({"softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax",
                      "cummin", "sort", "argsort", "flip", "roll", "narrow", "select",
                      "index_select", "gather", "scatter", "logcumsumexp", "diff"})
# ops that may move voxels without changing the shape: allowed only as exact no-ops
SHAPE_OPS = frozenset({"permute", "transpose", "movedim", "moveaxis", "swapaxes",
                        "swapdims", "view", "reshape", "flatten", "unflatten", "expand",
                        "repeat", "tile", "rot90", "fliplr", "flipud", "t", "pixel_shuffle",
                        "pixel_unshuffle", "unfold", "fold", "as_strided"})
SCALAR_READS = frozenset({"__float__", "__int__", "__bool__", "__index__", "item",
                           "tolist"})
REFUSED = frozenset({"pad", "layer_norm", "local_response_norm", "grid_sample",
                      "adaptive_avg_pool3d", "adaptive_max_pool3d", "lp_pool3d",
                      "fractional_max_pool3d", "max_unpool3d", "rms_norm"})


def func_name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", None) or str(func)
    return "max_pool3d" if name in ("_max_pool3d", "max_pool3d_with_indices") else name


def bind(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call by name (``SIGNATURES``), defaults filled in."""
    names = SIGNATURES[name]
    bound = dict(DEFAULTS.get(name, {}))
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound

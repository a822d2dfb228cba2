"""CUDA autocast, reproduced for tensors on the meta device.

``torch.autocast`` does nothing for meta tensors (and a CPU build of PyTorch cannot even
create CUDA tensors), yet a plan for a GPU must know which activations autocast makes
bf16/fp16. :class:`MetaAutocast` is a ``TorchFunctionMode`` that applies CUDA autocast's op
lists, copied from ``ATen/autocast_mode.h`` (PyTorch 2.13; a test compares them with the
installed header when it ships):

- lower precision: convolutions, matmuls, linear, attention -> inputs cast to bf16/fp16;
- fp32: exp/log family, pow, layer/group/rms norm, losses, upsampling -> inputs cast to fp32;
- fp32 unless a dtype is given: sum, prod, softmax, log_softmax, cumsum, norms;
- promote: the widest input dtype.
Every other op runs in whatever dtype its inputs have, as under autocast.

NOTE [ Why a function mode and not a dispatch mode ]
  Autocast sits above autograd in the dispatcher, so its casts are recorded in the autograd
  graph and backward runs in the cast dtypes. A ``TorchFunctionMode`` also sits above
  autograd; a ``TorchDispatchMode`` would sit below it and produce a wrong backward.
  Like CUDA autocast, casts of leaf tensors that require grad (the weights) are cached for
  the life of the context, so each weight is cast once per forward.

NOTE [ Python-level wrappers ]
  A function mode sees a Python wrapper such as ``F.interpolate`` but not the builtin it
  calls inside (the mode is paused while it handles a call). Autocast, in the dispatcher,
  sees the inner op. ``PYTHON_WRAPPERS`` maps the wrappers whose inner op is on a list to
  that list, so ``F.interpolate`` runs in fp32 like ``upsample_trilinear3d`` on CUDA.
  Builtin composites whose inner ops are listed (``cross_entropy_loss`` -> ``log_softmax``)
  are treated the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from remat3d.instrument.tensors import map_leaves
from remat3d.units import parse_amp

__all__ = [
    "FP32_OPS",
    "FP32_SET_OPT_DTYPE_OPS",
    "LOWER_PRECISION_OPS",
    "PROMOTE_OPS",
    "PYTHON_WRAPPERS",
    "MetaAutocast",
    "ambient_autocast",
    "amp_dtype",
    "amp_name",
]

LOWER_PRECISION_OPS = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
})
FP32_OPS = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
})
FP32_SET_OPT_DTYPE_OPS = frozenset({
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum", "norm",
})
PROMOTE_OPS = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
})

# wrapper name -> the list its inner op is on (see NOTE [ Python-level wrappers ])
PYTHON_WRAPPERS = {
    "interpolate": "fp32",  # upsample_* (mode="area" is adaptive_avg_pool: not listed)
    "upsample": "fp32",
    "cross_entropy": "fp32",  # log_softmax + nll_loss
    "cross_entropy_loss": "fp32",
    "binary_cross_entropy_with_logits": "fp32",
}

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # names as parse_amp gives
_WIDTH = {torch.float16: 0, torch.bfloat16: 0, torch.float32: 1}


def amp_dtype(amp: str | None) -> torch.dtype | None:
    """Map ``None | "none" | "bf16" | "fp16"`` to a dtype; raise a clear error otherwise."""
    name = parse_amp(amp)
    return None if name is None else _AMP_DTYPES[name]


def amp_name(dtype: torch.dtype) -> str:
    """The ``amp`` name of a dtype (``torch.bfloat16`` -> ``"bf16"``), else the dtype."""
    return next((n for n, d in _AMP_DTYPES.items() if d == dtype), str(dtype))


def ambient_autocast() -> list[tuple[str, torch.dtype]]:
    """The device types ``torch.autocast`` is on for here, with its dtype for each."""
    return [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
            if torch.is_autocast_enabled(d)]


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__"):  # Tensor.__matmul__, __pow__, __rpow__
        name = name[2:-2]
        if name.startswith("r") and name[1:] in ("matmul", "pow"):
            name = name[1:]
    return name.rstrip("_") if not name.startswith("_") else name


# what each function is to the casting rules, by its name (a function's name never
# changes: looked up once per function, not on every call)
_OTHER, _LOWER, _FP32, _FP32_UNLESS_DTYPE, _FP32_UNLESS_AREA, _PROMOTE = range(6)
_KINDS: dict[Any, int] = {}
# the pending fused-output class among an op's argument types, None: none (by the tuple)
_PENDING: dict[tuple[type, ...], type | None] = {}
_UNSEEN = object()


def _kind(func: Any) -> int:
    name = _op_name(func)
    if name in LOWER_PRECISION_OPS:
        return _LOWER
    if name in FP32_OPS:
        return _FP32
    if name in FP32_SET_OPT_DTYPE_OPS:
        return _FP32_UNLESS_DTYPE
    if PYTHON_WRAPPERS.get(name) == "fp32":
        return _FP32_UNLESS_AREA
    return _PROMOTE if name in PROMOTE_OPS else _OTHER


def _eligible(x: Any, any_device: bool = False) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and (any_device or x.device.type == "meta")
        and x.is_floating_point()
        and x.dtype != torch.float64
    )


def active_meta_autocast() -> MetaAutocast | None:
    """The innermost MetaAutocast on PyTorch's function-mode stack, if any.

    Recomputation re-enters one like it (``torch.utils.checkpoint`` restores
    ``torch.autocast``, not function modes).
    """
    from torch.overrides import _get_current_function_mode_stack

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, MetaAutocast):
            return mode
    return None


class MetaAutocast(TorchFunctionMode):
    """Apply CUDA autocast's casting rules to meta tensors (see module docstring).

    ``any_device=True`` applies them to tensors on every device: a graph plan made for
    CUDA autocast traces its step with them on fake CPU tensors, and runs them wherever it
    runs (``capture/joint.py``, NOTE rule 6), so the plan means the same step everywhere.
    """

    def __init__(self, dtype: torch.dtype, *, any_device: bool = False) -> None:
        super().__init__()
        self.dtype = dtype
        self.any_device = any_device
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _cast(self, x: Any, dtype: torch.dtype) -> Any:
        if not _eligible(x, self.any_device) or x.dtype == dtype:
            return x
        cacheable = x.is_leaf and x.requires_grad and dtype == self.dtype
        if cacheable:
            hit = self._cache.get(id(x))
            if hit is not None and hit[0] is x:
                return hit[1]
        with torch._C.DisableTorchFunction():
            y = x.to(dtype)
        if cacheable and isinstance(y, FakeTensor) and not isinstance(x, FakeTensor):
            # cast inside a trace on fake tensors (a tiled run's, runtime/tiling/trace.py):
            # kept, it would make every later op of the real step run on fake tensors
            cacheable = False
        if cacheable:
            self._cache[id(x)] = (x, y)
        return y

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        pending = _PENDING.get(types, _UNSEEN)
        if pending is _UNSEEN:
            pending = _PENDING[types] = next(
                (t for t in types if t is not torch.Tensor and hasattr(t, "materialize")), None)
        if pending is not None:
            # a pending fused tiled output (runtime/tiling/fused.py) answers shape queries
            # itself and is computed before any other op
            if pending.is_metadata(func):
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            args, kwargs = tree_map(
                lambda a: a.materialize() if hasattr(type(a), "materialize") else a,
                (args, kwargs))
        try:
            kind = _KINDS.get(func)
            if kind is None:
                kind = _KINDS[func] = _kind(func)
        except TypeError:  # a function that cannot be hashed: looked up each time
            kind = _kind(func)
        target: torch.dtype | None = None
        if kind == _LOWER:
            target = self.dtype
        elif kind == _FP32 or (kind == _FP32_UNLESS_DTYPE and kwargs.get("dtype") is None) \
                or (kind == _FP32_UNLESS_AREA and kwargs.get("mode") != "area"):
            target = torch.float32
        elif kind == _PROMOTE:
            dtypes = [x.dtype for x in tree_leaves((args, kwargs))
                      if _eligible(x, self.any_device)]
            if dtypes:
                target = max(dtypes, key=lambda d: _WIDTH.get(d, 1))
        if target is not None:
            args, kwargs = map_leaves(lambda x: self._cast(x, target), (args, kwargs))
        return func(*args, **kwargs)

    def __exit__(self, *exc: object) -> Any:
        self._cache.clear()
        return super().__exit__(*exc)


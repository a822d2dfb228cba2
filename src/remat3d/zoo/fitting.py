"""Weights for a model a spec built: a checkpoint file's tensors, unwrapped from whatever
holds them (:func:`read_state_dict`, also what ``pretrained:`` reads), and loaded where
they fit (:func:`load_fitting`: name and shape; the rest left as initialised and logged, a
changed head is normal). Shared by the nnU-Net checkpoint and MONAI bundle specs;
``remat3d.train.weights`` fits ``pretrained:`` weights with prefixes stripped and a full
report."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat3d.errors import WeightsError, quoted

__all__ = ["checkpoint_safe_globals", "load_fitting", "read_state_dict"]

logger = logging.getLogger(__name__)

# where checkpoints in the wild keep their state dict (nnU-Net: network_weights)
_CONTAINER_KEYS = ("state_dict", "model_state_dict", "model", "network_weights", "net",
                   "module", "network", "weights")


def load_fitting(model: nn.Module, tensors: Mapping[str, object], where: str) -> None:
    """Load the tensors of ``tensors`` whose name and shape ``model`` has; nothing on a
    model built on meta (for planning: no values to hold)."""
    if any(p.is_meta for p in model.parameters()):
        return
    own = model.state_dict()
    fits = {k: v for k, v in tensors.items()
            if isinstance(v, torch.Tensor) and k in own and own[k].shape == v.shape}
    model.load_state_dict(fits, strict=False)
    left = sorted(set(own) - set(fits))
    if left:
        logger.warning("%s: %d tensors kept as initialised (not in its weights, or another "
                       "shape: a changed task): %s%s", where, len(left), ", ".join(left[:6]),
                       " …" if len(left) > 6 else "")


def checkpoint_safe_globals() -> list[Any]:
    """The non-tensor types nnU-Net's checkpoints hold besides plain Python: numpy
    scalars and dtypes in its training log (``logging``, ``_best_ema``)."""
    import numpy as np

    types: list[Any] = [np.dtype, np.ndarray]
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar  # type: ignore[no-redef]
    types += [scalar, _reconstruct]
    types += [type(np.dtype(t)) for t in ("float64", "float32", "int64", "int32", "bool")]
    return types


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of a ``.pt``/``.pth``/``.ckpt``/``.safetensors`` file, unwrapped."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise WeightsError(f"Pretrained weights {str(path)!r} do not exist.")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path), device="cpu"))
        except (SafetensorError, OSError, ValueError) as exc:
            raise WeightsError(f"Cannot read safetensors file {str(path)!r}: {exc}. The file "
                               "may be truncated; download or save it again.") from None
    try:
        # numpy scalars in nnU-Net's training log are allowed too: its checkpoints are
        # the pretrained 3D weights people have (zoo/nnunet.py)
        with torch.serialization.safe_globals(checkpoint_safe_globals()):
            content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file
        message = quoted(exc)
        hint = ("It holds pickled Python objects beyond tensors; re-save just the weights "
                "with torch.save(model.state_dict(), path)."
                if "weights_only" in str(exc) else
                "The file may be truncated or not a PyTorch checkpoint.")
        raise WeightsError(f"Cannot read {str(path)!r}: {type(exc).__name__}: {message} "
                           f"{hint}") from None
    return _unwrap(content, path)


def _unwrap(content: Any, path: Path) -> dict[str, torch.Tensor]:
    for _ in range(4):
        if isinstance(content, nn.Module):
            content = content.state_dict()
        if isinstance(content, Mapping) and content and all(
                isinstance(v, torch.Tensor) for v in content.values()):
            return dict(content)
        if isinstance(content, Mapping):
            inner = next((content[k] for k in _CONTAINER_KEYS
                          if isinstance(content.get(k), (Mapping, nn.Module))), None)
            if inner is None:
                tensors = {k: v for k, v in content.items() if isinstance(v, torch.Tensor)}
                if tensors:
                    return tensors
                break
            content = inner
        else:
            break
    raise WeightsError(
        f"{str(path)!r} holds no state dict (found a {type(content).__name__}"
        + (f" with keys {', '.join(map(str, list(content)[:8]))}"
           if isinstance(content, Mapping) else "")
        + "). Save the weights with torch.save(model.state_dict(), path)."
    )

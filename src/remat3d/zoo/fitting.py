"""Weights into a model a spec built: what fits (name and shape) is loaded, the rest left
as initialised and logged (a changed head is normal). Shared by the nnU-Net checkpoint
and MONAI bundle specs; ``remat3d.train.weights`` does the same for ``pretrained:`` with
a full report."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["load_fitting"]

logger = logging.getLogger(__name__)


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

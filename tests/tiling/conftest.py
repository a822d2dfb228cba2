"""Helpers: compare a tiled run with the same run untiled (outputs, every gradient)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from remat3d.runtime.tiling import tile


def max_relative_errors(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                        tile_size: int | tuple[int, int, int],
                        params: Sequence[nn.Parameter] | None = None) -> dict[str, float]:
    """Max |tiled - untiled| / max |untiled| for the output and each gradient.

    A gradient that is zero in exact arithmetic (a bias right before a normalisation: the
    normalisation subtracts it again) is rounding noise on both sides; such a tensor
    (largest value under 1e-4 of the largest gradient) is compared on the scale of the
    largest gradient instead of its own.
    """
    if params is None:
        params = list(fn.parameters()) if isinstance(fn, nn.Module) else []
    torch.manual_seed(0)
    wrt = [x for x in inputs if x.requires_grad] + list(params)
    reference = fn(*inputs)
    seed = torch.randn_like(reference)
    g_ref = torch.autograd.grad(reference, wrt, seed, allow_unused=True)
    tiled = tile(fn, *inputs, tile=tile_size)
    g_tiled = torch.autograd.grad(tiled, wrt, seed, allow_unused=True)
    scale = max((g.abs().max().item() for g in g_ref if g is not None), default=1.0)
    errors = {"output": _rel(tiled, reference, 0.0)}
    for i, (a, b) in enumerate(zip(g_tiled, g_ref)):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            noise = b.abs().max().item() < 1e-4 * scale
            errors[f"grad{i}"] = _rel(a, b, scale if noise else 0.0)
    return errors


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype
    return (a - b).abs().max().item() / max(b.abs().max().item(), floor, 1e-30)

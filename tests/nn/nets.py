"""Shared helpers: reversible sequences and their ordinary twins, one training step each."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from remat3d.nn import AdditiveCoupling, AffineCoupling, ReversibleSequence


def half(channels: int, *, out: int | None = None, norm: str = "group", dropout: float = 0.0,
         inplace: bool = True) -> nn.Module:
    """F or G: conv -> norm -> LeakyReLU (in place by default) -> dropout."""
    out = out or channels
    norms: dict[str, Callable[[], nn.Module]] = {
        "group": lambda: nn.GroupNorm(1, out),
        "instance": lambda: nn.InstanceNorm3d(out, affine=True),
        "batch": lambda: nn.BatchNorm3d(out),
        "none": nn.Identity,
    }
    layers = [nn.Conv3d(channels, out, 3, padding=1), norms[norm](),
              nn.LeakyReLU(0.01, inplace=inplace)]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def sequence(depth: int, channels: int = 4, *, affine: bool = False, **kwargs) -> \
        ReversibleSequence:
    """``depth`` couplings on ``channels`` channels (F, G on half of them)."""
    h = channels // 2
    if affine:
        blocks = [AffineCoupling(half(h, out=2 * h, **kwargs), half(h, out=2 * h, **kwargs))
                  for _ in range(depth)]
    else:
        blocks = [AdditiveCoupling(half(h, **kwargs), half(h, **kwargs)) for _ in range(depth)]
    return ReversibleSequence(*blocks)


def ordinary(seq: ReversibleSequence) -> ReversibleSequence:
    """The same blocks (shared parameters and buffers) with ordinary backward."""
    return ReversibleSequence(*seq.blocks, reversible=False)


def step(model: nn.Module, x: torch.Tensor, *, seed: int = 1, amp: bool = False):
    """One training step: (output, input grad, {param name: grad}); grads are reset after."""
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_(True)
    amp_ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    with amp_ctx:
        y = model(x)
    y32 = y.float()
    (y32 * torch.sin(y32)).sum().backward()  # a loss whose gradient depends on y
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    assert x.grad is not None
    return y.detach(), x.grad.detach(), grads


def max_relative_error(a: dict[str, torch.Tensor] | torch.Tensor,
                       b: dict[str, torch.Tensor] | torch.Tensor) -> float:
    """``max |a - b| / max |a|`` over all entries together.

    Over all gradients at once, not per tensor: a convolution bias before a norm layer
    has a gradient that is zero in exact arithmetic, so its own relative error is noise
    over noise.
    """
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        a = torch.cat([t.flatten().double() for t in a.values()])
        b = torch.cat([t.flatten().double() for t in b.values()])
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return float((a.double() - b.double()).abs().max() / a.double().abs().max())

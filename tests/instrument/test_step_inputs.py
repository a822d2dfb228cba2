"""What a measured step counts from its start: the inputs and what the loss holds."""

from __future__ import annotations

import functools

import torch
from torch import nn

import remat3d


class _ForwardPeak(nn.Module):
    """Its peak is in forward: a large temporary, freed before the loss runs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.repeat(1, 64, 1, 1, 1)  # 64 channels, alive only here
        return self.conv(x) + wide.mean(dim=1, keepdim=True)


def _net() -> nn.Module:
    return _ForwardPeak()


def test_a_target_the_loss_holds_is_counted_from_the_start():
    """issue 19 point 2: a label first read by the loss was not counted while forward
    held the peak, but a training loop loads it with the image: the step measured above
    its verified peak by the label's bytes."""
    shape = (1, 1, 16, 16, 16)
    plain = remat3d.measure(_net(), shape, device="meta").peak_bytes
    target = torch.zeros(1, 1, 32, 32, 32, device="meta")

    def loss_of(out, t):
        return (out - t[..., :16, :16, :16]).pow(2).mean()

    for loss_fn in (lambda out: loss_of(out, target), functools.partial(loss_of, t=target)):
        held = remat3d.measure(_net(), shape, device="meta", loss_fn=loss_fn).peak_bytes
        assert held >= plain + target.numel() * target.element_size()

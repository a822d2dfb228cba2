"""A partially reversible 3D U-Net (Brügger et al. 2019, "A Partially Reversible U-Net for
Memory-Efficient Volumetric Image Segmentation").

Each resolution level is a :class:`~remat3d.nn.ReversibleSequence` of additive couplings
(F and G: convolution -> norm -> activation on half the channels); only the down- and
upsampling, the skip merges, the stem and the head are ordinary layers. So the activations
kept for backward are about one tensor per level and layer *between* levels, however many
blocks a level has.

::

    stem (conv, c0) -> rev[0] ----------------------------------- cat -> 1x1 -> rev'[0] -> head
                         \\ down (stride-2 conv, c1) -> rev[1] -- cat -> 1x1 -> rev'[1] -> up /
                                                ...                             ...
                                     \\ down -> rev[L-1] (bottleneck) -> up (transposed conv) /

Layers are MONAI's ``Convolution`` blocks, configured like MONAI's own networks (``norm``
and ``act`` take MONAI's names or ``(name, kwargs)`` tuples). Normalisation and activation
are inside F and G only; stem, resampling, merges and head are plain convolutions.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat3d.nn.coupling import AdditiveCoupling, ReversibleError
from remat3d.nn.sequence import ReversibleSequence

__all__ = ["RevUNet"]


class RevUNet(nn.Module):
    """Partially reversible U-Net: reversible blocks at every level, ordinary resampling.

    Args:
        spatial_dims: 3 (or 2) spatial dimensions.
        in_channels: input channels.
        out_channels: output channels (class logits).
        channels: channels per resolution level, each even (couplings split them in two);
            ``len(channels)`` levels means ``len(channels) - 1`` stride-2 downsamplings, so
            every spatial size must be divisible by ``2 ** (len(channels) - 1)``.
        blocks: additive couplings per reversible sequence (an int for every level, or one
            per level); encoder and decoder each have one sequence per level, the
            bottleneck one.
        kernel_size: kernel of the convolutions in F and G and of the downsampling.
        norm: normalisation in every block (MONAI name or ``(name, kwargs)``).
        act: activation. Not in place by default: in a reversible block F's tensors exist
            only during backward, and an in-place activation on InstanceNorm's output (a
            view) makes autograd add three half-size copies there (+10% step peak at 128³).
            In-place works correctly, though.
        dropout: dropout probability inside F and G (replayed exactly in backward).
        reversible: ``False`` runs the same network with ordinary backward (reference).

    >>> import torch
    >>> net = RevUNet(channels=(4, 8), blocks=1)
    >>> net(torch.randn(1, 1, 8, 8, 8)).shape
    torch.Size([1, 2, 8, 8, 8])
    """

    def __init__(
        self,
        spatial_dims: int = 3,
        in_channels: int = 1,
        out_channels: int = 2,
        channels: Sequence[int] = (16, 32, 64, 128),
        blocks: int | Sequence[int] = 2,
        kernel_size: int = 3,
        norm: str | tuple = ("instance", {"affine": True}),
        act: str | tuple = ("leakyrelu", {"negative_slope": 0.01}),
        dropout: float | None = None,
        reversible: bool = True,
    ) -> None:
        super().__init__()
        from monai.networks.blocks import Convolution

        channels = tuple(int(c) for c in channels)
        if not channels:
            raise ReversibleError("RevUNet needs at least one level in channels, got ().")
        odd = [c for c in channels if c % 2 or c <= 0]
        if odd:
            raise ReversibleError(
                f"RevUNet's channels must be positive and even (each reversible block splits "
                f"them in two halves); got channels={channels} ({odd[0]} is not)."
            )
        per_level = [int(blocks)] * len(channels) if isinstance(blocks, int) else list(blocks)
        if len(per_level) != len(channels) or min(per_level) < 1:
            raise ReversibleError(
                f"RevUNet's blocks must be a positive int or one positive int per level "
                f"({len(channels)} levels); got {blocks!r}."
            )
        self.spatial_dims = spatial_dims
        self.levels = len(channels)

        def linear_conv(cin: int, cout: int, **kwargs: Any) -> nn.Module:
            return Convolution(spatial_dims, cin, cout, conv_only=True, **kwargs)

        def sequence(c: int, n: int) -> ReversibleSequence:
            def half() -> nn.Module:  # F or G: conv -> norm -> act on half the channels
                return Convolution(spatial_dims, c // 2, c // 2, kernel_size=kernel_size,
                                   norm=norm, act=act, dropout=dropout)

            return ReversibleSequence(*[AdditiveCoupling(half(), half()) for _ in range(n)],
                                      reversible=reversible)

        # Every layer outside the reversible sequences is a plain convolution: norms and
        # activations live in F and G, so the ordinary layers keep only their inputs for
        # backward (mostly the sequences' outputs, kept anyway), not extra tensors.
        self.stem = linear_conv(in_channels, channels[0], kernel_size=kernel_size)
        self.encoders = nn.ModuleList(sequence(c, n) for c, n in zip(channels, per_level))
        self.downs = nn.ModuleList(
            linear_conv(cin, cout, strides=2, kernel_size=kernel_size)
            for cin, cout in itertools.pairwise(channels)
        )
        self.ups = nn.ModuleList(
            linear_conv(cin, cout, strides=2, kernel_size=2, padding=0, output_padding=0,
                        is_transposed=True)
            for cin, cout in zip(channels[1:], channels[:-1])
        )
        self.merges = nn.ModuleList(linear_conv(2 * c, c, kernel_size=1) for c in channels[:-1])
        self.decoders = nn.ModuleList(
            sequence(c, n) for c, n in zip(channels[:-1], per_level[:-1])
        )
        self.head = linear_conv(channels[0], out_channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skips = []
        for level, encoder in enumerate(self.encoders):
            x = encoder(x)
            if level < self.levels - 1:
                skips.append(x)
                x = self.downs[level](x)
        for level in reversed(range(self.levels - 1)):
            x = self.ups[level](x)
            x = self.merges[level](torch.cat([x, skips.pop()], dim=1))
            x = self.decoders[level](x)
        out: torch.Tensor = self.head(x)
        return out

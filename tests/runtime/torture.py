"""A small model with every feature that breaks naive checkpointing."""

from __future__ import annotations

import torch
from torch import nn


class NormBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(c, c, 3, padding=1)
        self.norm = nn.InstanceNorm3d(c, affine=True)

    def forward(self, x):
        return self.norm(self.conv(x))  # the caller applies an in-place LeakyReLU to this


class PairOut(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.a = nn.Conv3d(c, c, 1)
        self.b = nn.Conv3d(c, c, 3, padding=1)

    def forward(self, x, *, scale: float = 1.0):
        return self.a(x) * scale, torch.relu(self.b(x))


class Torture(nn.Module):
    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, c, 3, padding=1)
        self.bn = nn.BatchNorm3d(c)
        self.drop = nn.Dropout3d(0.25)
        self.block = NormBlock(c)
        self.act = nn.LeakyReLU(0.01, inplace=True)
        self.shared = nn.Conv3d(c, c, 3, padding=1)  # called twice
        self.frozen = nn.Sequential(nn.Conv3d(c, c, 1), nn.GELU())
        for p in self.frozen.parameters():
            p.requires_grad_(False)
        self.pair = PairOut(c)
        self.drop2 = nn.Dropout(0.1)
        self.head = nn.Conv3d(2 * c, 2, 1)

    def forward(self, x):
        h = self.drop(self.bn(self.stem(x)))
        h = self.act(self.block(h))
        h = self.shared(self.shared(h))
        h = self.frozen(h)
        a, b = self.pair(h, scale=0.5)
        return self.head(self.drop2(torch.cat([a, b], 1))), a.mean()

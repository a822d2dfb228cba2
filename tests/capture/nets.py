"""Networks whose forward does work outside any submodule (a skip concatenated in the
parent's own code, as nnU-Net v2's decoder does)."""

from __future__ import annotations

import torch
from torch import nn


class ParentConcat(nn.Module):
    """Encoder, one down/up level, and a decoder that concatenates the skip itself."""

    def __init__(self, norm: str = "batch") -> None:
        super().__init__()
        make = {"batch": lambda c: nn.BatchNorm3d(c),
                "instance": lambda c: nn.InstanceNorm3d(c, affine=True)}[norm]
        self.enc = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), make(4), nn.PReLU())
        self.down = nn.Conv3d(4, 8, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose3d(8, 4, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv3d(8, 4, 3, padding=1), make(4),
                                 nn.LeakyReLU(0.01, inplace=True))
        self.head = nn.Conv3d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.enc(x)
        low = torch.relu(self.down(skip))
        return self.head(self.dec(torch.cat([self.up(low), skip], dim=1)))


class Aliased(nn.Module):
    """One module reachable under two names (as DynUNet's skip layers are) and a weight
    tied between two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv3d(1, 4, 3, padding=1)
        self.again = self.first  # the same module object under a second name
        self.a = nn.Conv3d(4, 4, 3, padding=1)
        self.b = nn.Conv3d(4, 4, 3, padding=1)
        self.b.weight = self.a.weight  # tied
        self.head = nn.Conv3d(4, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.again(x)) + self.first(x)
        return self.head(self.b(torch.relu(self.a(y))))

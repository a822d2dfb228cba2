"""Concatenations saved for backward as their parts (NOTE [ Shared concatenations ])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat3d
from remat3d.planspec import Plan
from remat3d.runtime.concat import StaleConcatError
from tests.tiling.test_fused import TinyUNet


def _grads(net: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    xi = x.clone().requires_grad_(True)
    out = net(xi)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return [out.detach(), xi.grad, *(p.grad for p in net.parameters())]


def test_shared_concat_is_bitwise_and_saves_memory() -> None:
    torch.manual_seed(0)
    net = TinyUNet()
    x = torch.randn(1, 1, 16, 16, 16)
    reference = _grads(copy.deepcopy(net), x)
    planned = copy.deepcopy(net)
    remat3d.apply(planned, Plan())  # no regions: only the model-level saved-tensor hook
    assert all(torch.equal(a, b) for a, b in zip(_grads(planned, x), reference))

    peaks = {}
    for share in (False, True):
        meta = TinyUNet().to("meta")
        remat3d.apply(meta, Plan(share_concat=share))
        peaks[share] = remat3d.measure(meta, (1, 1, 32, 32, 32), device="meta").peak_bytes
    # the decoder's concatenation (8 channels at 32³, fp32: 1 MiB) is saved as the
    # upsampled half only; the skip half is the stem's output, alive anyway
    assert peaks[False] - peaks[True] > 0.9 * 4 * 32**3 * 4  # the skip half, 512 KiB


class CatThenInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv3d(1, 2, 1)
        self.b = nn.Conv3d(4, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        z = torch.cat([y, y * 2], 1)
        out = self.b(z)
        y.mul_(3)  # changes a part after the concatenation was saved
        return out + y.sum()


def test_a_part_changed_in_place_is_an_error_not_a_wrong_gradient() -> None:
    net = CatThenInPlace()
    remat3d.apply(net, Plan())
    out = net(torch.randn(1, 1, 4, 4, 4))
    with pytest.raises(StaleConcatError, match="modified in place"):
        out.sum().backward()
    fine = CatThenInPlace()
    remat3d.apply(fine, Plan(share_concat=False))
    fine(torch.randn(1, 1, 4, 4, 4)).sum().backward()  # saved as a copy: nothing to check


def test_mixed_dtypes_and_views_are_saved_as_usual() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv3d(3, 1, 1).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            big = torch.cat([x, x.double()[:, :1]], 1)  # promoted, and a view
            return self.conv(torch.cat([big, x.double()[:, :0]], 1))

    net = Mixed()
    x = torch.randn(1, 2, 4, 4, 4)
    reference = _grads(copy.deepcopy(net), x)
    remat3d.apply(net, Plan())
    assert all(torch.equal(a, b) for a, b in zip(_grads(net, x), reference))


def test_share_concat_round_trips() -> None:
    plan = Plan(share_concat=False)
    assert Plan.from_dict(plan.to_dict()).share_concat is False
    data = Plan().to_dict()
    del data["share_concat"]  # a plan written before the field existed
    assert Plan.from_dict(data).share_concat is True

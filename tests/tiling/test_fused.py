"""Fused tiled regions (NOTE [ Fused tiled regions ]): exact, computed once when needed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat3d
from remat3d.planspec import Plan, PlanError, Region
from remat3d.runtime.tiling.fused import Deferred, defer


class Up(nn.Module):
    """A decoder stage: transposed convolution, concatenation with the skip, conv-BN-ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.transp = nn.ConvTranspose3d(8, 4, 2, stride=2)
        self.conv = nn.Conv3d(8, 4, 3, padding=1)
        self.norm = nn.BatchNorm3d(4)
        self.conv2 = nn.Conv3d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm(self.conv(torch.cat([self.transp(x), skip], 1))))
        return torch.relu(self.conv2(y))


class TinyUNet(nn.Module):
    """Two levels; the full-resolution skip is read by the encoder and by the decoder.
    Every stage but the head holds two or more convolutions (a block to the planner)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True),
                                  nn.LeakyReLU(0.01), nn.Conv3d(4, 4, 3, padding=1),
                                  nn.LeakyReLU(0.01))
        self.down = nn.Sequential(nn.Conv3d(4, 8, 3, stride=2, padding=1), nn.GroupNorm(2, 8),
                                  nn.ReLU(), nn.Conv3d(8, 8, 1))
        self.inner = nn.Sequential(nn.Conv3d(8, 8, 3, padding=1), nn.ReLU(),
                                   nn.Conv3d(8, 8, 3, padding=1))
        self.up = Up()
        self.head = nn.Conv3d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.stem(x)
        return self.head(self.up(self.inner(self.down(skip)), skip))


def _step(net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    xi = x.clone().requires_grad_(True)
    out = net(xi)
    seed = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * seed).sum().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    grads["input"] = xi.grad
    grads.update({n: b.clone().to(out.dtype) for n, b in net.named_buffers()
                  if b.is_floating_point()})
    return out.detach(), grads


def assert_same_step(reference: tuple[torch.Tensor, dict[str, torch.Tensor]],
                     got: tuple[torch.Tensor, dict[str, torch.Tensor]],
                     tolerance: float) -> None:
    """Output, every gradient and buffer within ``tolerance`` of the reference's scale.

    A bias right before a normalisation has a zero gradient in exact arithmetic (the
    normalisation subtracts it again): it is compared on the largest gradient's scale."""
    (out_ref, g_ref), (out, g) = reference, got
    assert (out - out_ref).abs().max().item() <= tolerance * out_ref.abs().max().item()
    scale = max(v.abs().max().item() for v in g_ref.values())
    for name, ref in g_ref.items():
        floor = scale if ref.abs().max().item() < 1e-4 * scale else 1e-300
        err = (g[name] - ref).abs().max().item() / max(ref.abs().max().item(), floor)
        assert err <= tolerance, (name, err)


FUSED = [Region("stem", decision="tile", tile=[6, 7, 5], fuse=True),
         Region("down", decision="tile", tile=[3, 4, 3]),
         Region("up", decision="tile", tile=[6, 7, 5], fuse=True),
         Region("head", decision="tile", tile=[6, 7, 5])]


# the stem's output (the skip connection) read by two tiled regions, kept in host memory
# instead of fused (NOTE [ Host-resident tiled outputs ]; more in test_host.py)
HOST = [Region("stem", decision="tile", tile=[6, 7, 5], host=True), *FUSED[1:]]


@pytest.mark.parametrize("regions", [FUSED, HOST], ids=["fused", "host"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-12),
                                                  (torch.float32, 1e-5)])
def test_fused_regions_equal_the_untiled_step(regions: list[Region], dtype: torch.dtype,
                                              tolerance: float) -> None:
    torch.manual_seed(0)
    net = TinyUNet().to(dtype)
    tiled = copy.deepcopy(net)
    remat3d.apply(tiled, Plan(regions=regions))
    x = torch.randn(1, 1, 16, 14, 12, dtype=dtype)
    assert_same_step(_step(net, x), _step(tiled, x), tolerance)
    assert int(tiled.up.norm.num_batches_tracked) == 1  # BatchNorm updated once


def test_fused_output_read_by_an_untiled_module_is_computed_once() -> None:
    torch.manual_seed(0)
    net = TinyUNet().double()
    tiled = copy.deepcopy(net)
    # 'down' is not tiled: the stem's fused output is materialised for it, and the tiled
    # decoder then reads that tensor instead of recomputing the stem
    remat3d.apply(tiled, Plan(regions=[FUSED[0], FUSED[2], FUSED[3]]))
    calls = []
    tiled.stem[0].register_forward_hook(lambda *a: calls.append(remat3d.is_recomputing()))
    x = torch.randn(1, 1, 12, 12, 12, dtype=torch.float64)
    assert_same_step(_step(net, x), _step(tiled, x), 1e-12)
    tiles = 2 * 2 * 3  # 12³ in tiles of 6 x 7 x 5
    assert calls.count(False) == tiles  # one writing pass: materialised once


def test_deferred_answers_metadata_and_materialises_once() -> None:
    runs = []

    def double(x: torch.Tensor) -> torch.Tensor:
        runs.append(1)
        return x * 2

    x = torch.randn(1, 2, 5, 6, 7)
    d = defer(double, [x], 3)
    assert isinstance(d, Deferred) and d.shape == x.shape and d.dtype == x.dtype
    before = len(runs)  # the trace on fake tensors
    assert d.dim() == 5 and d.size(1) == 2 and "pending" in repr(d)
    assert len(runs) == before
    torch.testing.assert_close(d + 1, x * 2 + 1)
    after = len(runs)
    torch.testing.assert_close(torch.cat([d, d], 1), torch.cat([x * 2, x * 2], 1))
    assert len(runs) == after and "computed" in repr(d)


def test_fuse_needs_a_tiled_region_and_round_trips() -> None:
    with pytest.raises(PlanError, match="fuse applies to tiled regions"):
        Plan(regions=[Region("m", fuse=True)])
    plan = Plan(regions=FUSED)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "fused" in plan.summary()
    data = plan.to_dict()
    for region in data["regions"]:
        del region["fuse"]  # a plan written before 'fuse' existed
    assert not any(r.fuse for r in Plan.from_dict(data).regions)


@pytest.mark.parametrize(("flag", "message"), [("fuse", "can be fused. Set fuse=False"),
                                               ("host", ("can be kept in host memory. "
                                                         "Set host=False"))])
def test_a_region_with_two_outputs_cannot_be_fused_or_kept_on_the_host(
        flag: str, message: str) -> None:
    class Two(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x + 1, x * 2

    net = nn.Sequential(Two())
    region = Region("0", decision="tile", tile=[4], **{flag: True})
    remat3d.apply(net, Plan(regions=[region]))
    with pytest.raises(remat3d.TilingError, match=f"only a region with one output {message}"):
        net(torch.randn(1, 1, 8, 8, 8))

"""Tiled execution equals untiled execution: outputs, gradients, BatchNorm statistics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat3d
from remat3d.runtime.tiling import TilingError, tile

from .conftest import max_relative_errors

TOL = 1e-5


def _x(*shape: int, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float32).requires_grad_(grad)


def _assert_exact(fn, inputs, tile_size, params=None) -> None:  # type: ignore[no-untyped-def]
    errors = max_relative_errors(fn, inputs, tile_size, params)
    assert max(errors.values()) < TOL, errors


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("tile_size", [(3, 4, 5), 4, 16])
def test_strided_dilated_grouped_convolutions(tile_size) -> None:  # type: ignore[no-untyped-def]
    net = nn.Sequential(
        nn.Conv3d(2, 4, 3, stride=2, padding=1), nn.LeakyReLU(0.1, inplace=True),
        nn.Conv3d(4, 4, 3, padding=2, dilation=2, groups=2), nn.ReLU(),
        nn.Conv3d(4, 3, (1, 3, 2), padding=(0, 1, 0)),
    )
    _assert_exact(net, [_x(1, 2, 11, 9, 10)], tile_size)


def test_padding_mode_same_string() -> None:
    net = nn.Conv3d(2, 3, 3, padding="same", dilation=2)
    _assert_exact(net, [_x(1, 2, 9, 9, 9)], 4)


@pytest.mark.parametrize("tile_size", [5, (7, 3, 12)])
def test_transposed_convolutions(tile_size) -> None:  # type: ignore[no-untyped-def]
    net = nn.Sequential(
        nn.ConvTranspose3d(3, 4, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),
        nn.ConvTranspose3d(4, 2, 1, stride=2),      # stride wider than kernel: gaps
        nn.Conv3d(2, 2, 3, padding=1),
    )
    _assert_exact(net, [_x(1, 3, 3, 2, 3)], tile_size)


def test_pooling_and_upsampling() -> None:
    net = nn.Sequential(
        nn.Conv3d(1, 3, 3, padding=1),
        nn.MaxPool3d(3, stride=2, padding=1),
        nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False),
        nn.AvgPool3d(2),
        nn.Upsample(scale_factor=2, mode="nearest"),
        nn.Conv3d(3, 2, 3, padding=1),
    )
    _assert_exact(net, [_x(2, 1, 12, 10, 8)], (5, 3, 7))


class _ResBlock(nn.Module):
    """conv -> norm -> in-place LeakyReLU -> conv -> norm, plus the input (nnU-Net/SegResNet)."""

    def __init__(self, c: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(c, c, 3, padding=1)
        self.conv2 = nn.Conv3d(c, c, 3, padding=1)
        make = {"instance": lambda: nn.InstanceNorm3d(c, affine=True),
                "group": lambda: nn.GroupNorm(2, c),
                "batch": lambda: nn.BatchNorm3d(c)}[norm]
        self.norm1, self.norm2 = make(), make()
        self.act = nn.LeakyReLU(0.01, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        y += x
        return self.act(y)


@pytest.mark.parametrize("norm", ["instance", "group", "batch"])
@pytest.mark.parametrize("tile_size", [5, (16, 3, 16)])
def test_residual_block_with_global_normalisation(norm: str, tile_size) -> None:  # type: ignore[no-untyped-def]
    block = _ResBlock(4, norm)
    _assert_exact(block, [_x(2, 4, 11, 10, 9)], tile_size)


class _Up(nn.Module):
    """Transposed conv, concatenation with a skip, conv, GroupNorm (a U-Net decoder stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose3d(6, 3, 2, stride=2)
        self.conv = nn.Conv3d(6, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.head = nn.Conv3d(4, 2, 1)

    def forward(self, low: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.up(low), skip], dim=1)
        return self.head(F.relu(self.norm(self.conv(y))))


def test_two_inputs_skip_concatenation() -> None:
    up = _Up()
    _assert_exact(up, [_x(1, 6, 4, 5, 3), _x(1, 3, 8, 10, 6)], (3, 4, 5))


def test_input_without_grad_and_functions() -> None:
    conv = nn.Conv3d(1, 2, 3, padding=1)

    def run(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(conv(x)) * skip + skip

    _assert_exact(run, [_x(1, 1, 7, 7, 7, grad=False), _x(1, 2, 7, 7, 7)], 3,
                  params=list(conv.parameters()))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_running_statistics_updated_once(momentum: float | None) -> None:
    block, twin = _ResBlock(4, "batch"), _ResBlock(4, "batch")
    twin.load_state_dict(block.state_dict())
    for m in (block.norm1, block.norm2, twin.norm1, twin.norm2):
        m.momentum = momentum
    x = _x(2, 4, 7, 6, 7)
    for _ in range(2):  # two steps: the second reads num_batches_tracked of the first
        tile(block, x, tile=4).sum().backward()
        twin(x).sum().backward()
    for name, buf in twin.state_dict().items():
        torch.testing.assert_close(block.state_dict()[name], buf, rtol=1e-5, atol=1e-6,
                                   msg=name)
    block.eval()
    twin.eval()
    _assert_exact(block, [x], 4)


def test_no_grad_forward_matches() -> None:
    block = _ResBlock(3, "instance")
    x = _x(1, 3, 10, 10, 10, grad=False)
    with torch.no_grad():
        torch.testing.assert_close(tile(block, x, tile=3), block(x), rtol=TOL, atol=1e-6)


def test_backward_is_a_recomputation() -> None:
    seen: list[bool] = []
    conv = nn.Conv3d(1, 1, 3, padding=1)
    conv.register_forward_hook(lambda *a: seen.append(remat3d.is_recomputing()))
    tile(conv, _x(1, 1, 6, 6, 6), tile=3).sum().backward()
    # the trace, then 8 output tiles in forward, then 8 recomputed tiles in backward
    assert seen == [True] + [False] * 8 + [True] * 8


def test_dropout_refused_unless_inactive() -> None:
    net = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Dropout3d(0.2))
    with pytest.raises(TilingError, match="dropout"):
        tile(net, _x(1, 1, 6, 6, 6), tile=3)
    net[1].p = 0.0
    _assert_exact(net, [_x(1, 1, 6, 6, 6)], 3)
    net[1].p = 0.2
    net.eval()
    _assert_exact(net, [_x(1, 1, 6, 6, 6)], 3)


@pytest.mark.parametrize(("fn", "match"), [
    (lambda x: torch.flip(x, dims=[2]), "spatial"),
    (lambda x: x - x.mean(dim=(2, 3, 4), keepdim=True), "shape"),
    (lambda x: F.pad(x, (1, 1, 1, 1, 1, 1)), "padding by"),
    (lambda x: F.interpolate(x, scale_factor=2, mode="trilinear", align_corners=True),
     "align_corners"),
])
def test_non_local_ops_refused(fn, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TilingError, match=match):
        tile(fn, _x(1, 1, 6, 6, 6), tile=3)


def test_zero_padding_is_identity() -> None:
    conv = nn.Conv3d(1, 2, 3, padding=1)

    def run(x: torch.Tensor) -> torch.Tensor:  # BasicUNet's UpCat pads by 0 this way
        return F.pad(conv(x), [0] * 6, "replicate")

    _assert_exact(run, [_x(1, 1, 7, 6, 5)], 3, params=list(conv.parameters()))


def test_bad_tile_size_and_inputs() -> None:
    conv = nn.Conv3d(1, 1, 1)
    with pytest.raises(TilingError, match="tile size"):
        tile(conv, _x(1, 1, 4, 4, 4), tile=(2, 2))
    with pytest.raises(TilingError, match="5-D"):
        tile(conv, torch.zeros(1, 4, 4, 4), tile=2)


def test_inside_checkpoint_region() -> None:
    block = _ResBlock(2, "instance")
    x = _x(1, 2, 8, 8, 8)

    def region(x: torch.Tensor) -> torch.Tensor:
        return tile(block, x, tile=3) * 2

    y = remat3d.checkpoint(region, x)
    (gx,) = torch.autograd.grad(y.sum(), x)
    (ref,) = torch.autograd.grad((block(x) * 2).sum(), x)
    torch.testing.assert_close(gx, ref, rtol=TOL, atol=1e-5)


def test_several_outputs_at_two_resolutions() -> None:
    """A run that returns its full-resolution skip and a downsampled map (nnU-Net encoder)."""
    block = _ResBlock(2, "instance")
    down = nn.Sequential(nn.Conv3d(2, 4, 3, stride=2, padding=1), nn.GroupNorm(2, 4))

    def encoder(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        skip = block(x)
        return skip, down(skip)

    x = _x(1, 2, 10, 9, 11)
    params = [*block.parameters(), *down.parameters()]
    ref = encoder(x)
    seeds = [torch.randn_like(r) for r in ref]
    g_ref = torch.autograd.grad(ref, [x, *params], seeds)
    out = tile(encoder, x, tile=(4, 9, 3))
    assert isinstance(out, tuple) and len(out) == 2
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=TOL, atol=1e-6)
    g = torch.autograd.grad(out, [x, *params], seeds)
    scale = max(t.abs().max().item() for t in g_ref)
    for a, b in zip(g, g_ref):  # zero-in-exact-arithmetic gradients on the global scale
        own = b.abs().max().item()
        assert (a - b).abs().max().item() < TOL * (scale if own < 1e-4 * scale else own)
    # only the downsampled output used: no gradient flows from the skip
    (g_down,) = torch.autograd.grad(tile(encoder, x, tile=4)[1].sum(), x)
    (g_down_ref,) = torch.autograd.grad(encoder(x)[1].sum(), x)
    torch.testing.assert_close(g_down, g_down_ref, rtol=TOL, atol=1e-6)


def test_a_reversible_coupling_is_refused_by_name() -> None:
    """It rebuilds its input from its whole output: a tile with halos cannot do that (the
    planner's probe then never offers it as a tiled stage)."""
    from remat3d.nn.coupling import AdditiveCoupling

    coupling = AdditiveCoupling(nn.Conv3d(2, 2, 3, padding=1), nn.Conv3d(2, 2, 3, padding=1))
    net = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), coupling)
    x = torch.randn(1, 1, 16, 16, 16, requires_grad=True)
    with pytest.raises(TilingError, match="AdditiveCoupling.*cannot run tiled"):
        tile(net, x, tile=8)


def test_a_weight_used_after_a_tiled_run_under_autocast_is_a_real_tensor() -> None:
    # the tiled run is traced on fake tensors inside the user's autocast block; autocast's
    # weight-cast cache must not keep the fake cast for the block's later ops
    from torch._subclasses.fake_tensor import FakeTensor

    net = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True),
                        nn.LeakyReLU(), nn.Conv3d(4, 2, 3, padding=1))
    x = _x(1, 2, 16, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = tile(net, x, tile=8)
        z = net[0](x)
    assert not isinstance(y, FakeTensor) and not isinstance(z, FakeTensor)
    (y.float().sum() + z.float().sum()).backward()
    assert net[0].weight.grad is not None and not isinstance(net[0].weight.grad, FakeTensor)

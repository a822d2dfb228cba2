"""Saved tensors rebuilt from cheap ops instead of stored (NOTE [ Rebuilt saved tensors ])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat3d
from remat3d.planspec import Plan
from remat3d.runtime.rebuild import StaleRebuildError
from tests.tiling.test_fused import TinyUNet


def _grads(net: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    xi = x.clone().requires_grad_(True)
    out = net(xi)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return [out.detach(), xi.grad, *(p.grad for p in net.parameters())]


def _measure(build, shape) -> dict[bool, remat3d.Measurement]:
    found = {}
    for rebuild in (False, True):
        meta = build().to("meta")
        remat3d.apply(meta, Plan(rebuild_saved=rebuild))
        found[rebuild] = remat3d.measure(meta, shape, device="meta")
    return found


def test_rebuilt_concatenation_is_bitwise_and_saves_memory() -> None:
    torch.manual_seed(0)
    net = TinyUNet()
    x = torch.randn(1, 1, 16, 16, 16)
    reference = _grads(copy.deepcopy(net), x)
    planned = copy.deepcopy(net)
    remat3d.apply(planned, Plan())  # no regions: only the model-level saved-tensor hook
    assert all(torch.equal(a, b) for a, b in zip(_grads(planned, x), reference))
    m = _measure(TinyUNet, (1, 1, 32, 32, 32))
    # at least the decoder concatenation's skip half (4 channels at 32³, fp32: 512 KiB) is
    # not stored twice: the skip is the stem's output, alive anyway
    assert m[False].peak_bytes - m[True].peak_bytes > 0.9 * 4 * 32**3 * 4


class ResidualDecoder(nn.Module):
    """SegResNet's shape: an upsampled low-resolution input plus a skip, then a
    norm → in-place ReLU → conv block, with a residual sum."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 4, 3, padding=1)
        self.down = nn.Conv3d(4, 8, 3, stride=2, padding=1)
        self.reduce = nn.Conv3d(8, 4, 1)
        self.norm1 = nn.GroupNorm(2, 4) if norm == "group" else nn.InstanceNorm3d(4, affine=True)
        self.norm2 = nn.BatchNorm3d(4)
        self.act = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv3d(4, 4, 3, padding=1)
        self.conv2 = nn.Conv3d(4, 4, 3, padding=1)
        self.head = nn.Conv3d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.stem(x)
        low = self.down(skip)
        # (trilinear would be decomposed into a dozen full-size temporaries on meta with
        # deterministic algorithms on, which the recorder rightly stores instead)
        up = nn.functional.interpolate(self.reduce(low), scale_factor=2, mode="nearest")
        x = up + skip
        identity = x
        x = self.conv1(self.act(self.norm1(x)))
        x = self.conv2(self.act(self.norm2(x)))
        x += identity
        return self.head(x)


@pytest.mark.parametrize("norm", ["group", "instance"])
def test_rebuilt_norms_and_skip_sums_are_bitwise_and_save_memory(norm: str) -> None:
    torch.manual_seed(0)
    net = ResidualDecoder(norm)
    x = torch.randn(2, 1, 16, 16, 16)
    unplanned = copy.deepcopy(net)
    reference = _grads(unplanned, x)
    planned = copy.deepcopy(net)
    remat3d.apply(planned, Plan())
    assert all(torch.equal(a, b) for a, b in zip(_grads(planned, x), reference))
    # BatchNorm (running statistics) is never replayed: updated exactly once
    assert torch.equal(planned.norm2.running_mean, unplanned.norm2.running_mean)
    assert int(planned.norm2.num_batches_tracked) == 1
    m = _measure(lambda: ResidualDecoder(norm), (2, 1, 32, 32, 32))
    full = 2 * 4 * 32**3 * 4  # one full-resolution 4-channel tensor, fp32
    # kept from forward: the skip sum as the upsampling's low-resolution input (⅛; the skip is
    # kept anyway), the group/instance norm's output (in-place ReLU) not at all: rebuilt when
    # read. (The BatchNorm's output is stored: replaying it would update running statistics.)
    assert m[False].saved_bytes - m[True].saved_bytes >= 1.8 * full
    # the step's peak moves into forward (the head's convolution); backward's is lower
    assert m[True].peak_bytes < m[False].peak_bytes


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


def test_a_leaf_changed_in_place_is_an_error_not_a_wrong_gradient() -> None:
    net = CatThenInPlace()
    remat3d.apply(net, Plan())
    out = net(torch.randn(1, 1, 4, 4, 4))
    with pytest.raises(StaleRebuildError, match="modified in place"):
        out.sum().backward()
    fine = CatThenInPlace()
    remat3d.apply(fine, Plan(rebuild_saved=False))
    fine(torch.randn(1, 1, 4, 4, 4)).sum().backward()  # saved as a copy: nothing to check


def test_mixed_dtypes_views_and_dropout_are_exact() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv3d(3, 1, 1).double()
            self.drop = nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            big = torch.cat([x, x.double()[:, :1]], 1)  # promoted, and a view
            return self.conv(self.drop(torch.cat([big, x.double()[:, :0]], 1)))

    net = Mixed()
    x = torch.randn(1, 2, 4, 4, 4)
    torch.manual_seed(1)
    reference = _grads(copy.deepcopy(net), x)
    remat3d.apply(net, Plan())
    torch.manual_seed(1)
    assert all(torch.equal(a, b) for a, b in zip(_grads(net, x), reference))


def test_rebuild_saved_round_trips() -> None:
    plan = Plan(rebuild_saved=False)
    assert Plan.from_dict(plan.to_dict()).rebuild_saved is False
    data = Plan().to_dict()
    del data["rebuild_saved"]  # a plan written before the field existed
    data["share_concat"] = True  # ... or by the version that shared concatenations only
    assert Plan.from_dict(data).rebuild_saved is True


class UpsampleThenInPlace(nn.Module):
    """The recipe keeps the upsampling's small input itself; writing into it later must
    be caught, not replayed from the new values."""

    def __init__(self) -> None:
        super().__init__()
        self.low = nn.Conv3d(1, 2, 1)
        self.conv = nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self.low(x)
        up = nn.functional.interpolate(small, scale_factor=2, mode="nearest")
        out = self.conv(up)  # saves ``up``: rebuilt from ``small``
        small.add_(1)
        return out


def test_a_kept_small_input_changed_in_place_is_an_error() -> None:
    net = UpsampleThenInPlace()
    remat3d.apply(net, Plan())
    out = net(torch.randn(1, 1, 4, 4, 4))
    with pytest.raises(StaleRebuildError, match="upsample_nearest3d"):
        out.sum().backward()


def test_nothing_accumulates_over_training_steps() -> None:
    import weakref

    class ViewsItsInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv3d(1, 1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # a view of a tensor that outlives the step (recorded like any cheap op)
            return self.conv(x.view(x.shape))

    net = ViewsItsInput()
    remat3d.apply(net, Plan())
    x = torch.randn(1, 1, 8, 8, 8)
    sizes = []
    for _ in range(3):
        net(x).sum().backward()
        sizes.append(len(weakref.finalize._registry))  # type: ignore[attr-defined]
    assert sizes[0] == sizes[1] == sizes[2]


def test_running_statistics_written_after_being_saved_are_stored_not_rebuilt() -> None:
    """``InstanceNorm3d(track_running_stats=True)`` hands ``native_batch_norm`` a
    ``repeat`` of its buffers, which the kernel updates in place without a version bump
    after autograd saved it (NOTE rule 5). That tensor is stored as it is: the step is
    bitwise the unplanned one, buffers included, and it plans on meta (it raised
    StaleRebuildError in backward, on CPU and in every verification)."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv3d(1, 4, 3, padding=1),
                             nn.InstanceNorm3d(4, track_running_stats=True, momentum=0.3),
                             nn.LeakyReLU(0.01, inplace=True), nn.Conv3d(4, 2, 3, padding=1))

    x = torch.randn(2, 1, 8, 8, 8)
    reference, planned = build(), remat3d.apply(build(), Plan())
    for a, b in zip(_grads(planned, x), _grads(reference, x)):
        assert torch.equal(a, b)
    for a, b in zip(planned.buffers(), reference.buffers()):
        assert torch.equal(a, b)
    plan = remat3d.plan(build(), x.shape, budget="1x")
    assert plan.verified_peak_bytes is not None

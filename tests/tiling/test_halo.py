"""Halo arithmetic against brute force: which input voxels influence which output voxels.

The brute force runs the real PyTorch op on a tiny volume with all-ones weights and reads,
by autograd, which inputs the gradient of a slice of the output reaches.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from remat3d.halo import (
    CONV,
    SpatialOp,
    conv_input_interval,
    conv_transpose_input_interval,
    interpolate_input_interval,
    needed_regions,
    owned_region,
    split_axis,
    tile_grid,
)


def _influence(op, n_in: int, lo: int, hi: int) -> tuple[int, int] | None:
    """Bounding interval (along the first spatial axis) of inputs that outputs [lo, hi) read."""
    x = torch.rand(1, 1, n_in, 1, 1, dtype=torch.float64, requires_grad=True)
    y = op(x)
    y[:, :, lo:hi].sum().backward()
    hit = (x.grad[0, 0, :, 0, 0] != 0).nonzero().flatten().tolist()
    return (min(hit), max(hit) + 1) if hit else None


CONV_CASES = [  # kernel, stride, padding, dilation
    (3, 1, 1, 1), (3, 2, 1, 1), (3, 1, 2, 2), (5, 2, 2, 1), (3, 3, 0, 2), (1, 2, 0, 1),
    (4, 2, 1, 1), (2, 2, 0, 1), (3, 2, 3, 3),
]


@pytest.mark.parametrize(("k", "s", "p", "d"), CONV_CASES)
def test_conv_interval_matches_autograd_at_borders(k: int, s: int, p: int, d: int) -> None:
    n = 11
    w = torch.ones(1, 1, k, 1, 1, dtype=torch.float64)

    def op(x: torch.Tensor) -> torch.Tensor:
        return F.conv3d(x, w, stride=(s, 1, 1), padding=(p, 0, 0), dilation=(d, 1, 1))

    n_out = op(torch.zeros(1, 1, n, 1, 1, dtype=torch.float64)).shape[2]
    for lo, hi in itertools.combinations(range(n_out + 1), 2):
        a, b = conv_input_interval(lo, hi, kernel=k, stride=s, padding=p, dilation=d)
        expected = _influence(op, n, lo, hi)
        clamped = (max(a, 0), min(b, n))
        if expected is None:  # the slice reads only padding
            assert clamped[0] >= clamped[1] or d > 1
        elif d == 1:
            assert clamped == expected, (lo, hi)
        else:  # dilation skips voxels: the interval may hold unread ones at a border only
            assert clamped[0] <= expected[0] and clamped[1] >= expected[1], (lo, hi)
            assert expected[0] - clamped[0] < d and clamped[1] - expected[1] < d
        # the unclamped interval's length is exactly what a padding-0 conv needs
        assert (b - a - d * (k - 1) - 1) // s + 1 == hi - lo


CONVT_CASES = [  # kernel, stride, padding, dilation, output_padding
    (2, 2, 0, 1, 0), (3, 2, 1, 1, 1), (4, 2, 1, 1, 0), (3, 1, 1, 1, 0), (1, 2, 0, 1, 1),
    (3, 3, 0, 2, 2), (5, 2, 2, 1, 1),
]


@pytest.mark.parametrize(("k", "s", "p", "d", "op_"), CONVT_CASES)
def test_conv_transpose_interval_matches_autograd(k: int, s: int, p: int, d: int,
                                                  op_: int) -> None:
    n = 7
    w = torch.ones(1, 1, k, 1, 1, dtype=torch.float64)

    def op(x: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose3d(x, w, stride=(s, 1, 1), padding=(p, 0, 0),
                                  output_padding=(op_, 0, 0), dilation=(d, 1, 1))

    n_out = op(torch.zeros(1, 1, n, 1, 1, dtype=torch.float64)).shape[2]
    for lo, hi in itertools.combinations(range(n_out + 1), 2):
        a, b = conv_transpose_input_interval(lo, hi, kernel=k, stride=s, padding=p,
                                             dilation=d, size=n)
        expected = _influence(op, n, lo, hi)
        if expected is None:  # outputs no input reaches (bias only): one input kept
            assert b - a == 1
        elif d == 1:
            assert (a, b) == expected, (lo, hi)
        else:  # dilated taps are sparse: the bounding interval may hold one input too many
            assert a <= expected[0] and b >= expected[1], (lo, hi)
            assert expected[0] - a <= 1 and b - expected[1] <= 1


@pytest.mark.parametrize(("mode", "scale"), [("nearest", 2), ("nearest", 3), ("linear", 2),
                                             ("linear", 4)])
def test_interpolate_interval_covers_autograd(mode: str, scale: int) -> None:
    n = 6
    torch_mode = "trilinear" if mode == "linear" else "nearest"

    def op(x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=(scale, 1, 1), mode=torch_mode)

    for lo, hi in itertools.combinations(range(n * scale + 1), 2):
        a, b = interpolate_input_interval(lo, hi, scale=scale, mode=mode, size=n)
        e0, e1 = _influence(op, n, lo, hi) or (0, 0)
        # exact, except that linear keeps a neighbour whose weight is 0 at a border
        assert a <= e0 and b >= e1, (lo, hi)
        slack = 1 if mode == "linear" else 0
        assert e0 - a <= slack and b - e1 <= slack, (lo, hi)


def test_needed_regions_chain_strided_then_transposed() -> None:
    # 12 -> conv k3 s2 p1 -> 6 -> transposed k2 s2 -> 12 -> conv k3 p1 dilation 2 -> 12
    ops = [
        SpatialOp(CONV, (0,), 1, (3,) * 3, (2,) * 3, (1,) * 3, (1,) * 3),
        SpatialOp("conv_transpose", (1,), 2, (2,) * 3, (2,) * 3, (0,) * 3, (1,) * 3),
        SpatialOp(CONV, (2,), 3, (3,) * 3, (1,) * 3, (2,) * 3, (2,) * 3),
        SpatialOp("pointwise", (3, 0), 4),  # residual with the input
    ]
    sizes = {0: (12,) * 3, 1: (6,) * 3, 2: (12,) * 3, 3: (12,) * 3, 4: (12,) * 3}
    tile = ((0, 4), (4, 8), (8, 12))
    regions = needed_regions(ops, sizes, {4: tile})
    assert regions[3] == tile
    assert regions[2] == ((0, 6), (2, 10), (6, 12))     # dilation 2 halo, clamped
    assert regions[1] == ((0, 3), (1, 5), (3, 6))
    assert regions[0] == ((0, 6), (1, 10), (5, 12))     # union with the residual's tile


def test_tiles_partition_and_owned_regions() -> None:
    assert split_axis(10, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    grid = tile_grid((5, 4, 3), (2, 4, 2))
    assert len(grid) == 3 * 1 * 2
    covered = sum((d1 - d0) * (h1 - h0) * (w1 - w0) for (d0, d1), (h0, h1), (w0, w1) in grid)
    assert covered == 5 * 4 * 3
    # owned regions of a 7-voxel output on a 14-voxel (upsampled) and 4-voxel node
    for size in (14, 4):
        owned = [owned_region(((lo, hi),), (7,), (size,))[0] for lo, hi in split_axis(7, 3)]
        assert owned[0][0] == 0 and owned[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(owned))

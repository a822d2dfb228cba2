"""Halo arithmetic: which input voxels each output tile of a run of local ops needs.

Pure integer arithmetic on plain data (no torch), one spatial axis at a time. A run of
spatially local ops is a list of :class:`SpatialOp` over numbered nodes (tensors); a
*region* is a half-open interval per spatial axis, in the global coordinates of its node.

Conventions (PyTorch's): a convolution with kernel ``k``, stride ``s``, padding ``p`` and
dilation ``d`` computes output ``o`` from inputs ``o*s - p + j*d`` (``j < k``); a transposed
convolution spreads input ``i`` to outputs ``i*s - p + j*d``; linear interpolation with an
integer scale ``s`` (``align_corners=False``) reads inputs ``floor(c)`` and ``floor(c) + 1``
at ``c = (o + 0.5)/s - 0.5`` (clamped to the volume); nearest reads ``floor(o/s)``.

>>> conv_input_interval(0, 4, kernel=3, stride=1, padding=1, dilation=1)   # unclamped
(-1, 5)
>>> conv_transpose_input_interval(3, 7, kernel=2, stride=2, padding=0, dilation=1, size=8)
(1, 4)
>>> split_axis(10, 4)
[(0, 4), (4, 8), (8, 10)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from remat3d.errors import TilingError

__all__ = [
    "Interval",
    "Region",
    "SpatialOp",
    "conv_input_interval",
    "conv_transpose_input_interval",
    "conv_transpose_input_slices",
    "input_region",
    "interpolate_input_interval",
    "needed_regions",
    "owned_region",
    "region_size",
    "split_axis",
    "tile_grid",
    "union",
]

Interval = tuple[int, int]
Region = tuple[Interval, ...]

# op kinds: how an output region maps back to each input's region
CONV = "conv"                      # conv3d, max/avg pooling (window ops)
CONV_TRANSPOSE = "conv_transpose"
INTERPOLATE = "interpolate"        # nearest / linear with an integer scale
POINTWISE = "pointwise"            # activations, norms (region-wise), add, cat on channels
KINDS = (CONV, CONV_TRANSPOSE, INTERPOLATE, POINTWISE)


@dataclass(frozen=True)
class SpatialOp:
    """One op of a run: its kind, per-axis window parameters, input and output nodes."""

    kind: str
    inputs: tuple[int, ...]
    output: int
    kernel: tuple[int, ...] = (1, 1, 1)
    stride: tuple[int, ...] = (1, 1, 1)
    padding: tuple[int, ...] = (0, 0, 0)   # low-side padding (PyTorch pads both sides)
    dilation: tuple[int, ...] = (1, 1, 1)
    scale: tuple[int, ...] = (1, 1, 1)     # interpolation: output size / input size
    mode: str = "nearest"                  # interpolation: "nearest" or "linear"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TilingError(f"unknown op kind {self.kind!r}; expected one of {KINDS}")


def conv_input_interval(lo: int, hi: int, *, kernel: int, stride: int, padding: int,
                        dilation: int) -> Interval:
    """Input interval (unclamped: may reach into the padding) that outputs [lo, hi) read."""
    return lo * stride - padding, (hi - 1) * stride - padding + dilation * (kernel - 1) + 1


def conv_transpose_input_interval(lo: int, hi: int, *, kernel: int, stride: int,
                                  padding: int, dilation: int, size: int) -> Interval:
    """Inputs (clamped to [0, size)) of a transposed convolution that reach outputs [lo, hi).

    Input ``i`` reaches outputs ``i*stride - padding + j*dilation``; the smallest ``i``
    reaching ``lo`` or beyond is ``ceil((lo + padding - dilation*(kernel-1)) / stride)``,
    the largest at or below ``hi - 1`` is ``floor((hi - 1 + padding) / stride)``. The
    interval is never empty: outputs that no input reaches (a stride wider than the kernel)
    still get one input, so that the local result has a place to put them.
    """
    first = -((-(lo + padding - dilation * (kernel - 1))) // stride)
    last = (hi - 1 + padding) // stride
    a, b = max(first, 0), min(last + 1, size)
    if a >= b:
        a = min(a, size - 1)
        b = a + 1
    return a, b


def conv_transpose_input_slices(want: Region, *, kernel: Sequence[int],
                                stride: Sequence[int], padding: Sequence[int],
                                dilation: Sequence[int], size: Sequence[int],
                                ) -> tuple[Region, tuple[int, ...]]:
    """Per axis, the inputs of a transposed convolution that reach outputs ``want``
    (:func:`conv_transpose_input_interval`) and the output position where the local result
    of that input slice starts (``i0 * stride - padding``)."""
    slices = tuple(conv_transpose_input_interval(
        lo, hi, kernel=kernel[a], stride=stride[a], padding=padding[a],
        dilation=dilation[a], size=size[a]) for a, (lo, hi) in enumerate(want))
    starts = tuple(i0 * stride[a] - padding[a] for a, (i0, _) in enumerate(slices))
    return slices, starts


def interpolate_input_interval(lo: int, hi: int, *, scale: int, mode: str,
                               size: int) -> Interval:
    """Inputs (clamped to [0, size)) that interpolated outputs [lo, hi) read."""
    if mode == "nearest":
        return lo // scale, min((hi - 1) // scale + 1, size)
    if mode == "linear":
        # c = (o + 0.5)/s - 0.5 = (2o + 1 - s) / 2s; floor with integers only
        def floor_c(o: int) -> int:
            return (2 * o + 1 - scale) // (2 * scale)

        return max(floor_c(lo), 0), min(floor_c(hi - 1) + 2, size)
    raise TilingError(f"unknown interpolation mode {mode!r}")


def input_region(op: SpatialOp, out: Region, in_size: Sequence[int]) -> Region:
    """The region of one input node that ``op`` needs to compute ``out``, clamped to it."""
    axes = []
    for a, (lo, hi) in enumerate(out):
        n = in_size[a]
        if op.kind == CONV:
            i0, i1 = conv_input_interval(lo, hi, kernel=op.kernel[a], stride=op.stride[a],
                                         padding=op.padding[a], dilation=op.dilation[a])
            axes.append((max(i0, 0), min(i1, n)))
        elif op.kind == CONV_TRANSPOSE:
            axes.append(conv_transpose_input_interval(
                lo, hi, kernel=op.kernel[a], stride=op.stride[a], padding=op.padding[a],
                dilation=op.dilation[a], size=n))
        elif op.kind == INTERPOLATE:
            axes.append(interpolate_input_interval(lo, hi, scale=op.scale[a], mode=op.mode,
                                                   size=n))
        else:
            axes.append((lo, hi))
    return tuple(axes)


def union(a: Region | None, b: Region) -> Region:
    """Bounding box of two regions (``a`` may be None: nothing yet)."""
    if a is None:
        return b
    return tuple((min(x[0], y[0]), max(x[1], y[1])) for x, y in zip(a, b))


def region_size(region: Region) -> int:
    """Number of voxels in a region."""
    n = 1
    for lo, hi in region:
        n *= max(hi - lo, 0)
    return n


def needed_regions(ops: Sequence[SpatialOp], sizes: Mapping[int, Sequence[int]],
                   targets: Mapping[int, Region]) -> dict[int, Region]:
    """Region of every node needed to produce ``targets`` (node -> region) exactly.

    ``ops`` must be in execution order and every op's output a new node (so the reversed
    list is a reverse topological order). A node's region is the bounding box of what all
    its consumers need, plus its own target if it has one.
    """
    regions: dict[int, Region] = dict(targets)
    for op in reversed(ops):
        out = regions.get(op.output)
        if out is None:
            continue
        for node in op.inputs:
            regions[node] = union(regions.get(node), input_region(op, out, sizes[node]))
    return regions


def split_axis(size: int, tile: int) -> list[Interval]:
    """Consecutive intervals of length ``tile`` covering [0, size); the last may be shorter."""
    if tile < 1:
        raise TilingError(f"a tile edge must be at least 1, got {tile}")
    return [(lo, min(lo + tile, size)) for lo in range(0, size, tile)]


def tile_grid(size: Sequence[int], tile: Sequence[int]) -> list[Region]:
    """All tiles of a volume, in C order (the last axis fastest)."""
    grid: list[Region] = [()]
    for n, t in zip(size, tile):
        grid = [r + (iv,) for r in grid for iv in split_axis(n, min(t, n))]
    return grid


def owned_region(tile: Region, out_size: Sequence[int], size: Sequence[int]) -> Region:
    """The part of a node of ``size`` that a tile of the output owns.

    Tile boundaries are scaled from the output's grid to the node's (rounding down), so the
    owned regions of all tiles partition the node exactly (some may be empty when the node
    is smaller than the output). Used to sum statistics over a node once.
    """
    return tuple((lo * n // m, hi * n // m) for (lo, hi), m, n in zip(tile, out_size, size))


"""What a tiled stage costs, as a function of the tile size: plain data in, numbers out.

For the planner (which never imports torch): :func:`describe` (torch side) turns a run
into a :class:`StageSpec` once, at the example input's size; :func:`tiled_cost` (pure)
then prices any tile size from the halo arithmetic alone, with no torch and no tracing.

The model, per NOTE [ Tiled backward ] in ``tiled.py`` (k = normalisations with batch
statistics in the run; "region work" = FLOPs of an op over the region a tile computes):

- forward: statistics pass j runs every op before normalisation j, once per tile; the
  output pass runs every op once per tile: ``sum_j work(ops < norm_j) + work(all)``;
- backward: k + 1 recomputations of every op; sums pass j back-propagates through the ops
  after normalisation j (input gradients only: 1x their forward FLOPs); the last pass
  back-propagates everything (input and weight gradients: 2x; 1x for an op reading only
  inputs that need no gradient);
- memory kept between forward and backward: the run's inputs (its output is the caller's);
- transient: one tile's working set in backward, bounded by every node's region of that
  tile alive at once (as autograd keeps them) plus as much again for their gradients,
  plus the full-size input gradients the backward writes into.

FLOPs count convolutions only (as ``torch.utils.flop_counter`` does); the halo overlap is
included exactly, tile by tile. Untiled reference: forward ``work(all)`` over whole nodes,
backward 2x.

>>> from remat3d.nn.tiling.halo import SpatialOp
>>> spec = StageSpec(ops=[SpatialOp("conv", (0,), 1, (3,) * 3, (1,) * 3, (1,) * 3, (1,) * 3)],
...                  sizes={0: (64,) * 3, 1: (64,) * 3}, inputs=[0], output=1,
...                  voxel_bytes={0: 4, 1: 8}, flops=[2 * 27 * 2 * 64**3], norms=[])
>>> cost = tiled_cost(spec, (32, 32, 32))
>>> cost.tiles, round(cost.forward_flops / cost.untiled_forward_flops, 3)
(8, 1.0)
>>> cost.kept_bytes == 4 * 64**3
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from remat3d.nn.tiling.halo import (
    Region,
    SpatialOp,
    needed_regions,
    owned_region,
    region_size,
    tile_grid,
    union,
)

__all__ = ["StageSpec", "TileCost", "describe", "tiled_cost"]


@dataclass(frozen=True)
class StageSpec:
    """A traced run as plain data: ops, node sizes and bytes per voxel, FLOPs per op."""

    ops: list[SpatialOp]
    sizes: dict[int, tuple[int, ...]]
    inputs: list[int]
    output: int
    voxel_bytes: dict[int, int]
    flops: list[int]          # untiled forward FLOPs of each op (convolutions)
    norms: list[int]          # op index of each normalisation with batch statistics
    no_grad_inputs: tuple[int, ...] = ()   # input nodes that need no gradient
    outputs: tuple[int, ...] = ()          # all outputs, when the run returns several


@dataclass(frozen=True)
class TileCost:
    """The price of running a stage with one tile size (see the module docstring)."""

    tile: tuple[int, ...]
    tiles: int
    forward_flops: int
    backward_flops: int
    untiled_forward_flops: int
    untiled_backward_flops: int
    kept_bytes: int
    tile_peak_bytes: int
    input_grad_bytes: int

    @property
    def extra_flops(self) -> int:
        """FLOPs above the untiled forward + backward of the stage."""
        return (self.forward_flops + self.backward_flops
                - self.untiled_forward_flops - self.untiled_backward_flops)

    @property
    def peak_bytes(self) -> int:
        """Kept inputs + input gradients + one tile's working set: the stage's peak."""
        return self.kept_bytes + self.input_grad_bytes + self.tile_peak_bytes


def tiled_cost(spec: StageSpec, tile: Sequence[int]) -> TileCost:
    """Price ``spec`` run with output tiles of edge ``tile`` (pure Python)."""
    out_size = spec.sizes[spec.output]
    tiles = tile_grid(out_size, [min(t, n) for t, n in zip(tile, out_size)])
    norm_nodes = [spec.ops[i].output for i in spec.norms]
    no_grad = set(spec.no_grad_inputs)
    k = len(spec.norms)
    fwd = bwd = 0
    tile_peak = 0
    for t in tiles:
        targets: dict[int, Region] = {
            node: owned_region(t, out_size, spec.sizes[node])
            for node in (spec.outputs or (spec.output,))}
        for node in norm_nodes:
            targets[node] = union(targets.get(node),
                                  owned_region(t, out_size, spec.sizes[node]))
        regions = needed_regions(spec.ops, spec.sizes, targets)
        work = [f * region_size(regions[op.output]) // max(_volume(spec.sizes[op.output]), 1)
                for op, f in zip(spec.ops, spec.flops)]
        total = sum(work)
        fwd += sum(sum(work[:i]) for i in spec.norms) + total
        bwd += (k + 1) * total + sum(sum(work[i + 1:]) for i in spec.norms)
        bwd += sum(w * (1 if set(op.inputs) <= no_grad else 2) for op, w in zip(spec.ops, work))
        live = sum(region_size(r) * spec.voxel_bytes.get(node, 0)
                   for node, r in regions.items())
        tile_peak = max(tile_peak, 2 * live)
    untiled = sum(spec.flops)
    untiled_bwd = sum(f * (1 if set(op.inputs) <= no_grad else 2)
                      for op, f in zip(spec.ops, spec.flops))
    kept = sum(_volume(spec.sizes[n]) * spec.voxel_bytes[n] for n in spec.inputs)
    grads = sum(_volume(spec.sizes[n]) * spec.voxel_bytes[n] for n in spec.inputs
                if n not in no_grad)
    return TileCost(tile=tuple(tile), tiles=len(tiles), forward_flops=fwd, backward_flops=bwd,
                    untiled_forward_flops=untiled, untiled_backward_flops=untiled_bwd,
                    kept_bytes=kept, tile_peak_bytes=tile_peak, input_grad_bytes=grads)


def _volume(size: Sequence[int]) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def describe(fn: Callable[..., Any], *inputs: Any) -> StageSpec:
    """Trace ``fn(*inputs)`` (fake tensors; meta inputs work) into a :class:`StageSpec`."""
    from remat3d.nn.tiling.trace import trace

    tr = trace(fn, inputs)
    no_grad = tuple(n for n, x in zip(tr.inputs, inputs) if not x.requires_grad)
    return StageSpec(ops=tr.spatial_ops, sizes=dict(tr.sizes), inputs=list(tr.inputs),
                     output=tr.outputs[0], voxel_bytes=dict(tr.voxel_bytes),
                     flops=[op.flops for op in tr.ops], norms=list(tr.norms),
                     no_grad_inputs=no_grad, outputs=tuple(tr.outputs))

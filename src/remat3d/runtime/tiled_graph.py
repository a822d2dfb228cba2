"""Tiled regions of a partitioned graph, run tile by tile (``planner/graph_tiles.py``).

NOTE [ Running tiled regions ]
  1. ``tile_graph`` reads each node of an FX graph as a ``TileValue`` (what the op
     computes decides its kind, from the tables below; an op no table names is
     ``outside``), keeps as members those on the tiled grids, and replaces each convex
     region by one call, its outputs picked from the call's result, in a topological
     order of the graph with each region one unit, each unit as early as its inputs
     allow in the order of its first node (the graph's own order where nothing moves).
  2. Every member is computed for exactly the region its readers need, from operands
     cropped to what it reads: a convolution reads its input window and pads with zeros
     only where that window leaves the volume (its own padding), then runs unpadded; a
     transposed convolution, and a convolution's input gradient, run on the slice of
     their operand that reaches the region and crop the local result (zeros where nothing
     reaches; a bias added after); pointwise ops, views and channel concatenations crop
     every spatial operand, a view's shape taking the region's extent.
  3. Sums over tiles accumulate in float32 (float64 for a normalisation's statistics,
     merged as Chan et al. merge variances) and are cast to the op's own output dtype once
     complete. A normalisation's output and input gradient are ``a * x + b`` (and
     ``+ c * dy``) with per-channel coefficients from the whole tensor's sums, in float32,
     cast back: every tiled value equals the untiled one up to rounding.
  4. A region holds plain data only (the ops, their arguments with nodes named), so the
     graph it sits in can be copied. Members the partition recomputes run inside
     ``is_recomputing()``, as the graph's own recomputed ops do.
  5. On fake tensors (a plan measured) a pass runs one tile: of the kinds of tiles
     (``planner/graph_tiles.py`` NOTE rule 5), the one whose parts hold the most bytes
     (its working set is every tile's largest). Each member's FLOPs per voxel of its
     region, booked by the tracker for that tile, count for its regions in every tile.
  6. A normalisation the backward recomputes reads the statistics its forward saved
     (``save_norm_statistics``: placeholders after the saved tensors, the forward's
     outputs after its saved ones, the partition's convention): its output is then
     pointwise in a tiled region.
  7. A region is labelled by its graph ("forward" / "backward") and the name of its last
     member: a plan sets a stash policy per label, and on fake tensors the tracker books
     each region's peak and FLOPs under its label (``MemoryTracker.window``).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from remat3d.halo import (
    CONV,
    CONV_TRANSPOSE,
    POINTWISE,
    Region,
    SpatialOp,
    conv_input_interval,
    conv_transpose_input_slices,
    region_size,
)
from remat3d.instrument.tracker import active_tracker
from remat3d.planner.graph_tiles import TiledRegion, TileValue, needed, regions_of
from remat3d.runtime.tiling.execute import compute_dtype, crop

__all__ = ["save_norm_statistics", "tile_graph"]

aten = torch.ops.aten

_POINTWISE = {
    aten.leaky_relu.default, aten.leaky_relu_backward.default, aten.relu.default,
    aten.threshold_backward.default, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor,
    aten.div.Tensor, aten.add.Scalar, aten.mul.Scalar, aten.neg.default,
    aten.where.self, aten.sigmoid.default, aten.sigmoid_backward.default,
    aten.tanh.default, aten.tanh_backward.default, aten.gelu.default,
    aten.gelu_backward.default, aten.silu.default, aten.hardtanh.default,
    aten.hardtanh_backward.default, aten.elu.default, aten.elu_backward.default,
    aten._to_copy.default, aten.clone.default, aten.detach.default, aten.alias.default,
}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_CHANNELS = {aten.cat.default, aten.slice.Tensor}
_NORMS = {aten._native_batch_norm_legit.no_stats, aten.native_group_norm.default}
_NORM_BACKWARDS = {aten.native_batch_norm_backward.default,
                   aten.native_group_norm_backward.default}
_CONV_PARAMS = slice(3, 9)  # convolution: stride, padding, dilation, transposed, out_pad, groups


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (tuple, list)) and value else value


def _grid(node: Any) -> tuple[int, ...] | None:
    t = _first(_val(node))
    if isinstance(t, torch.Tensor) and t.dim() == 5 and t.shape[2:].numel() > 1:
        return tuple(t.shape[2:])
    return None


# ----------------------------------------------------------------------------- reading nodes

def _conv_op(node: fx.Node, kind: str) -> SpatialOp:
    """The window relation (``kind``: which way) of a ``convolution`` or a
    ``convolution_backward`` node's weight, stride, padding and dilation."""
    # convolution(x, weight, bias, stride, ...); convolution_backward(grad, x, weight,
    # bias_sizes, stride, ...)
    w = 2 if node.target is aten.convolution_backward.default else 1
    stride, padding, dilation = (tuple(node.args[k]) for k in (w + 2, w + 3, w + 4))
    kernel = tuple(_val(node.args[w]).shape[2:])
    return SpatialOp(kind, (0,), 1, kernel, stride, padding, dilation)


_SAME = SpatialOp(POINTWISE, (0,), 1)


def _value(node: fx.Node, grids: set[tuple[int, ...]], kinds: dict[str, str]) -> TileValue:
    """``node`` as tiling sees it (NOTE rule 1 of ``planner/graph_tiles.py``); ``kinds``:
    those of the nodes before it (a pick is a member only if its op is)."""
    value = _classify(node, grids, kinds)
    value.joins = node.meta.get(_JOINS)
    return value


def _classify(node: fx.Node, grids: set[tuple[int, ...]], kinds: dict[str, str]) -> TileValue:
    inputs = [a.name for a in node.all_input_nodes]
    outside = TileValue(node.name, "outside", inputs, _grid(node))
    if node.op != "call_function":
        return outside
    target, grid = node.target, _grid(node)
    spatial = [a for a in node.all_input_nodes if _grid(a) is not None]
    if target is operator.getitem:
        source = node.args[0]
        if not isinstance(source, fx.Node) or kinds.get(source.name) not in ("reduce", "shell"):
            return outside
        return _pick(node, grids) or outside
    if target is aten.convolution_backward.default:
        return _conv_backward(node, grids) or outside
    if target in _NORM_BACKWARDS | _NORMS:
        if _grid(node.args[0]) not in grids:
            return outside
        if target in _NORM_BACKWARDS:
            return _norm_backward(node)
        if target is aten._native_batch_norm_legit.no_stats and not node.args[3]:
            return outside  # in eval mode: pointwise, but not written here yet
        if _SAVED in node.meta:  # its statistics saved by the forward: nothing to sum
            return TileValue(node.name, "shell", inputs + list(node.meta[_SAVED]))
        if _STATS_OF in node.meta:  # a copy: the statistics its original gathered
            return TileValue(node.name, "shell", [*inputs, node.meta[_STATS_OF]])
        return TileValue(node.name, "reduce", inputs, None, {node.args[0].name: _SAME},
                         node.args[0].name)
    if grid is None or grid not in grids:
        return outside
    if target in _POINTWISE or target in _VIEWS:
        if all(_grid(a) == grid for a in spatial) and \
                all(_val(a).dim() == 5 for a in spatial):
            return TileValue(node.name, "local", inputs, grid,
                             {a.name: _SAME for a in spatial})
        return outside
    if target in _CHANNELS:
        dim = node.args[1] if target is aten.slice.Tensor else \
            (node.args[1] if len(node.args) > 1 else 0)
        if dim in (0, 1, -4, -5) and all(_grid(a) == grid for a in spatial):
            return TileValue(node.name, "local", inputs, grid,
                             {a.name: _SAME for a in spatial})
        return outside
    if target is aten.convolution.default and _val(node).dim() == 5:
        transposed = bool(node.args[6])
        if transposed and node.args[8] != 1:
            return outside
        x = node.args[0]
        kind = CONV_TRANSPOSE if transposed else CONV
        return TileValue(node.name, "local", inputs, grid, {x.name: _conv_op(node, kind)})
    return outside


def _conv_backward(node: fx.Node, grids: set[tuple[int, ...]]) -> TileValue | None:
    """The weight and bias gradients of a convolution: a reduce over its output's
    gradient (or a shell, when only the input gradient is asked for). Its input
    gradient is a member of its own (``_pick``): on a grid not tiled, the op is not."""
    grad, x = node.args[0], node.args[1]
    transposed, groups, mask = bool(node.args[7]), node.args[9], node.args[10]
    if (transposed and groups != 1) or _grid(grad) not in grids or \
            (mask[0] and _grid(x) not in grids):
        return None
    inputs = [a.name for a in node.all_input_nodes]
    if not (mask[1] or mask[2]):
        return TileValue(node.name, "shell", inputs)
    window = _conv_op(node, CONV_TRANSPOSE if transposed else CONV)
    return TileValue(node.name, "reduce", inputs, None,
                     {grad.name: _SAME, x.name: window}, grad.name)


def _norm_backward(node: fx.Node) -> TileValue:
    dy, x = node.args[0], node.args[1]
    if node.target is aten.native_batch_norm_backward.default and not node.args[7]:
        return TileValue(node.name, "outside", [a.name for a in node.all_input_nodes])
    return TileValue(node.name, "reduce", [a.name for a in node.all_input_nodes], None,
                     {dy.name: _SAME, x.name: _SAME}, dy.name)


def _pick(node: fx.Node, grids: set[tuple[int, ...]]) -> TileValue | None:
    source, index = node.args
    if not isinstance(source, fx.Node) or source.op != "call_function":
        return None
    target, grid = source.target, _grid(node)
    if target is aten.convolution_backward.default and _grid(source.args[0]) in grids:
        if index != 0:
            return TileValue(node.name, "pick", [source.name])
        grad, transposed = source.args[0], bool(source.args[7])
        if grid is None or grid not in grids or (transposed and source.args[9] != 1):
            return None
        rel = _conv_op(source, CONV if transposed else CONV_TRANSPOSE)
        return TileValue(node.name, "local", [grad.name, source.args[2].name, source.name],
                         grid, {grad.name: rel})
    if target in _NORMS | _NORM_BACKWARDS and _grid(source.args[0]) in grids:
        if index != 0:
            return TileValue(node.name, "pick", [source.name])
        spatial = source.args[:2] if target in _NORM_BACKWARDS else source.args[:1]
        saved = list(source.meta.get(_SAVED, ())) + \
            ([source.meta[_STATS_OF]] if _STATS_OF in source.meta else [])
        return TileValue(node.name, "local", [source.name, *saved] + [a.name for a in spatial],
                         grid, {a.name: _SAME for a in spatial})
    return None


# ----------------------------------------------------------------------------- plain ops

@dataclass(frozen=True)
class _Ref:
    """A node an op's arguments name (NOTE rule 4)."""

    name: str


@dataclass
class _Op:
    name: str
    target: Any
    args: tuple
    kwargs: dict
    dtype: torch.dtype | None  # of its (first) output


def _plain(node: fx.Node) -> _Op:
    def ref(a: Any) -> Any:
        return _Ref(a.name) if isinstance(a, fx.Node) else a

    args = fx.node.map_aggregate(node.args, ref)
    kwargs = fx.node.map_aggregate(node.kwargs, ref)
    value = _first(_val(node))
    return _Op(node.name, node.target, args, dict(kwargs),
               value.dtype if isinstance(value, torch.Tensor) else None)


# ----------------------------------------------------------------------------- tensors

def _conv_window(want: Region, kernel: Any, stride: Any, padding: Any, dilation: Any
                 ) -> Region:
    """The input a convolution reads for outputs ``want``, unclamped (into its padding)."""
    return tuple(conv_input_interval(lo, hi, kernel=kernel[a], stride=stride[a],
                                     padding=padding[a], dilation=dilation[a])
                 for a, (lo, hi) in enumerate(want))


def _fit(t: torch.Tensor, have: Region, want: Region) -> torch.Tensor:
    """``t`` (covering ``have``) on ``want``: cropped where it reaches beyond, zeros where
    it does not reach."""
    inner = tuple((max(h0, w0), min(h1, w1)) for (h0, h1), (w0, w1) in zip(have, want))
    if any(lo >= hi for lo, hi in inner):
        shape = (*t.shape[:2], *(hi - lo for lo, hi in want))
        return t.new_zeros(shape)
    t = crop(t, have, inner)
    pad: list[int] = []
    for (lo, hi), (w0, w1) in reversed(list(zip(inner, want))):
        pad += [lo - w0, w1 - hi]
    return torch.constant_pad_nd(t, pad) if any(pad) else t


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32 (NOTE rule 3)."""
    return t.to(compute_dtype(t.dtype))


def _extent(region: Region) -> list[int]:
    return [hi - lo for lo, hi in region]


class _Tile:
    """The values one tile of one pass computes: ``name -> (tensor, region)``."""

    def __init__(self, run: _RegionRun) -> None:
        self.run = run
        self.parts: dict[str, tuple[torch.Tensor, Region]] = {}

    def get(self, name: str, want: Region) -> torch.Tensor:
        """``name`` over ``want`` (inside its volume)."""
        if name in self.parts:
            t, have = self.parts[name]
        else:
            t = self.run.whole[name]
            have = tuple((0, n) for n in t.shape[2:])
        return crop(t, have, want)

    def window(self, name: str, want: Region) -> torch.Tensor:
        """``name`` over ``want``, zeros where ``want`` leaves the volume."""
        size = self.run.sizes[name]
        inner = tuple((max(lo, 0), min(hi, n)) for (lo, hi), n in zip(want, size))
        return _fit(self.get(name, inner), inner, want)

    def arg(self, a: Any, want: Region) -> Any:
        """An op's argument for a member computed over ``want``: spatial operands
        cropped (NOTE rule 2), small values as they are."""
        if isinstance(a, _Ref):
            if a.name in self.run.sizes:
                return self.get(a.name, want)
            return self.run.small[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(self.arg(x, want) for x in a)
        return a


# ----------------------------------------------------------------------------- the region run

class _RegionRun:
    """One region, called with its inputs, returning its outputs (NOTE rules 2-4)."""

    def __init__(self, region: TiledRegion, values: dict[str, TileValue],
                 ops: dict[str, _Op], sizes: dict[str, tuple[int, ...]],
                 shapes: dict[str, tuple[int, ...]], dtypes: dict[str, list],
                 tile: tuple[int, ...], recomputed: set[str], label: str = "") -> None:
        self.region = region
        self._shapes = shapes  # of every tensor value the region reads or makes
        self._dtypes = dtypes  # of each member's outputs
        self.label = label
        self.values = values
        self.ops = ops
        self.sizes = sizes  # every spatial value the region reads or makes
        self.tile = tile
        self.recomputed = recomputed
        self.whole: dict[str, torch.Tensor] = {}
        self.small: dict[str, Any] = {}
        self._last = {i: max(region.made[m] for m in region.members
                             if i in values[m].relations)
                      for i in region.stashes}  # the last pass reading each stash
        self.__name__ = f"tiled_region_{region.members[-1]}"

    def __call__(self, *inputs: Any) -> tuple:
        from remat3d.instrument.state import recomputing

        region = self.region
        for name, value in zip(region.inputs, inputs):
            if name in self.sizes:
                self.whole[name] = value
            else:
                self.small[name] = value
        del inputs
        tracker = active_tracker() if self._fake() else None
        try:
            with tracker.window(self.label, "region") if tracker is not None \
                    else contextlib.nullcontext():
                for step in range(region.passes):
                    self._pass(step, recomputing)
            return tuple(self.whole[o] if o in self.sizes else self.small[o]
                         for o in region.outputs)
        finally:
            self.whole, self.small = {}, {}

    def _pass(self, step: int, recomputing: Any) -> None:
        region, values = self.region, self.values
        made_whole = [o for o in region.made_whole if region.made[o] == step]
        for name in made_whole:
            op = self.ops[name]
            shape = (*self._channels(name), *self.sizes[name])
            self.whole[name] = torch.empty(shape, dtype=op.dtype, device=self._device())
        reduces = [m for m in region.members
                   if values[m].kind == "reduce" and region.made[m] == step]
        sums: dict[str, Any] = {}
        done = set(self.whole) - set(made_whole)
        if self._fake():  # NOTE rule 5
            classes = [(t, k, needed(region, values, step, t, done))
                       for t, k in region.tile_classes(self.tile)]
            largest = max(classes, key=lambda c: sum(
                region_size(r) * self._voxel_bytes(m) for m, r in c[2].items()))
            tracker = active_tracker()
            rates = self._tile(step, largest[0], largest[2], made_whole, done, reduces,
                               sums, recomputing, tracker)
            if tracker is not None:
                for phase, rate in rates.items():
                    total = sum(k * sum(r * region_size(want[m]) for m, r in rate.items()
                                        if m in want) for _, k, want in classes)
                    run = sum(r * region_size(largest[2][m]) for m, r in rate.items())
                    tracker.add_flops(phase, round(total - run))
        else:
            for tile in region.tiles(self.tile):
                self._tile(step, tile, needed(region, values, step, tile, done), made_whole,
                           done, reduces, sums, recomputing, None)
        for name in reduces:
            self.small[name] = self._finish(name, sums.get(name))
        for name in region.stashes:  # read by no later pass
            if name in self.whole and self._last.get(name, 0) <= step:
                del self.whole[name]
        for name in region.members:
            v = values[name]
            if v.kind == "pick" and v.inputs[0] in self.small and name not in self.small:
                index = self.ops[name].args[1]
                self.small[name] = self.small[v.inputs[0]][index]

    def _tile(self, step: int, tile: Region, want: dict[str, Region],
              made_whole: list[str], done: set[str], reduces: list[str],
              sums: dict[str, Any], recomputing: Any, tracker: Any
              ) -> dict[str, dict[str, float]]:
        """One tile of one pass: its members over what the pass needs of them (``done``:
        whole already), its reduces' partial sums, its part of the outputs made whole
        (``made_whole``). With ``tracker``, the
        FLOPs each member booked per voxel of its region (NOTE rule 5), by phase."""
        rates: dict[str, dict[str, float]] = {}
        part = _Tile(self)

        def booked(name: str, region: Region, before: dict[str, int]) -> None:
            for phase, n in tracker.flops.items():
                if n != before[phase] and region_size(region):
                    rates.setdefault(phase, {})[name] = (n - before[phase]) / region_size(region)

        for name in self.region.members:
            if name not in want or self.values[name].kind != "local" or name in done:
                continue
            before = dict(tracker.flops) if tracker is not None else {}
            if name in self.recomputed:
                with recomputing():
                    value = self._local(part, name, want[name])
            else:
                value = self._local(part, name, want[name])
            part.parts[name] = (value, want[name])
            if tracker is not None:
                booked(name, want[name], before)
        for name in reduces:
            owned = want.get(name)
            if owned is not None and region_size(owned):
                before = dict(tracker.flops) if tracker is not None else {}
                sums[name] = _add(sums.get(name), self._partial(part, name, owned))
                if tracker is not None:
                    booked(name, owned, before)
        for name in made_whole:
            owned = want[name]
            t, have = part.parts[name]
            own = tuple((0, n) for n in self.sizes[name])
            crop(self.whole[name], own, owned).copy_(crop(t, have, owned))
        return rates

    def _voxel_bytes(self, name: str) -> int:
        """What one voxel of ``name`` holds, all its channels (0: a reduce's sums)."""
        op = self.ops.get(name)
        if name not in self.sizes or (op is not None and self.values[name].kind != "local"):
            return 0
        dtype = op.dtype if op is not None else self.whole[name].dtype
        shape = self._shapes[name]
        return shape[0] * shape[1] * (dtype.itemsize if dtype is not None else 4)

    def _fake(self) -> bool:
        """Whether this run is measured on fake tensors (NOTE rule 5): its values are
        never read, so one tile of each kind runs for all of them."""
        return any(isinstance(t, FakeTensor) for t in self.whole.values())

    def _device(self) -> torch.device:
        for t in self.whole.values():
            return t.device
        return torch.device("cpu")

    def _channels(self, name: str) -> tuple[int, ...]:
        return self._shapes[name][:2]

    # -- members over a region -------------------------------------------------------------
    def _local(self, part: _Tile, name: str, want: Region) -> torch.Tensor:
        op = self.ops[name]
        target = op.target
        if target is operator.getitem:
            source = self.ops[op.args[0].name]
            if source.target is aten.convolution_backward.default:
                out = self._input_gradient(part, source, want)
            elif source.target in _NORM_BACKWARDS:
                a, b, c = self.small[source.name][3]
                dy = _wide(part.get(source.args[0].name, want))
                x = _wide(part.get(source.args[1].name, want))
                out = torch.addcmul(torch.addcmul(c, b, x), a, dy)
            else:  # a normalisation's output
                stats_of = self.values[source.name].inputs[-1] \
                    if self.values[source.name].kind == "shell" else None
                if stats_of in self.small and not isinstance(self.small[stats_of],
                                                             torch.Tensor):
                    self.small[source.name] = self.small[stats_of]  # a copy's (rule 7)
                if source.name not in self.small:  # its statistics saved (NOTE rule 6)
                    saved = self.values[source.name].inputs[-2:]
                    self.small[source.name] = self._norm(
                        source, self.small[saved[0]], self.small[saved[1]],
                        self._dtypes[source.name])
                scale, shift = self.small[source.name][3]
                x = _wide(part.get(source.args[0].name, want))
                out = torch.addcmul(shift, scale, x.unflatten(1, (scale.shape[1], -1))
                                    ).flatten(1, 2) if scale.dim() == 6 else \
                    torch.addcmul(shift, scale, x)
            return out.to(op.dtype)
        if target is aten.convolution.default:
            return self._convolution(part, op, want)
        args = part.arg(op.args, want)
        if target in _VIEWS:
            args = (args[0], [*args[1][:-3], *_extent(want)])
        return target(*args, **part.arg(op.kwargs, want))

    def _convolution(self, part: _Tile, op: _Op, want: Region) -> torch.Tensor:
        x, w, b = op.args[0], self.small[op.args[1].name], \
            self.small[op.args[2].name] if op.args[2] is not None else None
        stride, padding, dilation, transposed, _, groups = op.args[_CONV_PARAMS]
        kernel = w.shape[2:]
        zeros = [0, 0, 0]
        if not transposed:
            window = _conv_window(want, kernel, stride, padding, dilation)
            return aten.convolution(part.window(x.name, window), w, b, stride, zeros,
                                    dilation, False, zeros, groups)
        slices, starts = conv_transpose_input_slices(
            want, kernel=kernel, stride=stride, padding=padding, dilation=dilation,
            size=self.sizes[x.name])
        local = aten.convolution(part.get(x.name, slices), w, None, stride, zeros, dilation,
                                 True, zeros, groups)
        have = tuple((s, s + n) for s, n in zip(starts, local.shape[2:]))
        out = _fit(local, have, want)
        return out if b is None else out + b.view(1, -1, 1, 1, 1).to(out.dtype)

    def _input_gradient(self, part: _Tile, source: _Op, want: Region) -> torch.Tensor:
        grad, w = source.args[0].name, self.small[source.args[2].name]
        stride, padding, dilation, transposed, _, groups = source.args[4:10]
        kernel, zeros = w.shape[2:], [0, 0, 0]
        if transposed:  # the input gradient of a transposed convolution is a convolution
            window = _conv_window(want, kernel, stride, padding, dilation)
            return aten.convolution(part.window(grad, window), w, None, stride, zeros,
                                    dilation, False, zeros, groups)
        slices, starts = conv_transpose_input_slices(
            want, kernel=kernel, stride=stride, padding=padding, dilation=dilation,
            size=self.sizes[grad])
        local = aten.convolution(part.get(grad, slices), w, None, stride, zeros, dilation,
                                 True, zeros, groups)
        return _fit(local, tuple((s, s + n) for s, n in zip(starts, local.shape[2:])), want)

    # -- sums over tiles ------------------------------------------------------------------
    def _partial(self, part: _Tile, name: str, owned: Region) -> Any:
        op = self.ops[name]
        if op.target is aten.convolution_backward.default:
            return self._weight_gradient(part, op, owned)
        if op.target in _NORMS:
            x = part.get(op.args[0].name, owned)
            x6 = _wide(x).unflatten(1, (self._groups(op), -1))
            dims = (0, 2, 3, 4, 5) if op.target in _BATCH else (2, 3, 4, 5)
            var, mean = torch.var_mean(x6, dims, correction=0, keepdim=True)
            n = x6.numel() // (mean.numel())
            return (n, mean.double(), var.double() * n)
        dy = _wide(part.get(op.args[0].name, owned))
        x = _wide(part.get(op.args[1].name, owned))
        dims = (2, 3, 4)
        return ((dy * x).sum(dims, dtype=torch.float64), dy.sum(dims, dtype=torch.float64))

    def _weight_gradient(self, part: _Tile, op: _Op, owned: Region) -> tuple:
        grad, x, w = op.args[0].name, op.args[1].name, self.small[op.args[2].name]
        bias_sizes, stride, padding, dilation, transposed, _, groups, mask = op.args[3:11]
        kernel, zeros = w.shape[2:], [0, 0, 0]
        wanted = [False, bool(mask[1]), bool(mask[2])]
        if not transposed:
            window = _conv_window(owned, kernel, stride, padding, dilation)
            _, gw, gb = aten.convolution_backward(
                part.get(grad, owned), part.window(x, window), w, bias_sizes, stride, zeros,
                dilation, False, zeros, groups, wanted)
        else:
            slices, starts = conv_transpose_input_slices(
                owned, kernel=kernel, stride=stride, padding=padding, dilation=dilation,
                size=self.sizes[x])
            extent = tuple((s, s + (hi - lo - 1) * stride[a] + (kernel[a] - 1) * dilation[a] + 1)
                           for a, (s, (lo, hi)) in enumerate(zip(starts, slices)))
            g = _fit(part.get(grad, owned), owned, extent)
            _, gw, gb = aten.convolution_backward(
                g, part.get(x, slices), w, bias_sizes, stride, zeros, dilation, True, zeros,
                groups, wanted)
        return (None if gw is None else _wide(gw), None if gb is None else _wide(gb))

    def _groups(self, op: _Op) -> int:
        if op.target is aten.native_group_norm.default:
            return int(op.args[6])
        return self._shapes[op.args[0].name][1]

    def _finish(self, name: str, total: Any) -> tuple:
        """A reduce's outputs once every tile is summed (NOTE rule 3); the fourth entry
        holds the coefficients its local pick computes with."""
        op = self.ops[name]
        dtypes = self._dtypes[name]
        if op.target is aten.convolution_backward.default:
            gw, gb = total
            return (None, None if gw is None else gw.to(dtypes[1]),
                    None if gb is None else gb.to(dtypes[2]))
        if op.target in _NORMS:
            n, mean, m2 = total
            return self._norm(op, mean, (m2 / n + float(op.args[-1])).rsqrt(), dtypes)
        return self._norm_backward(op, total, dtypes)

    def _norm(self, op: _Op, mean: torch.Tensor, rstd: torch.Tensor, dtypes: list) -> tuple:
        """A normalisation's statistics and the scale and shift of its output."""
        mean, rstd = mean.double(), rstd.double()
        if op.target not in _BATCH:  # per (sample, group)
            mean = mean.reshape(mean.shape[0], mean.shape[1], 1, 1, 1, 1)
            rstd = rstd.reshape(mean.shape)
        channels = self._shapes[op.args[0].name][1]
        weight = self._affine(op.args[1], channels)
        bias = self._affine(op.args[2], channels) if op.args[2] is not None else \
            torch.zeros(channels, dtype=torch.float64, device=self._device())
        if op.target in _BATCH:  # statistics per channel: (1, C, 1, ...)
            scale = rstd.view(1, -1, 1, 1, 1) * weight.view(1, -1, 1, 1, 1)
            shift = bias.view(1, -1, 1, 1, 1) - mean.view(1, -1, 1, 1, 1) * scale
            stats = (mean.view(-1), rstd.view(-1))
        else:  # per (sample, group): scale (N, G, C/G, 1, 1, 1)
            groups = mean.shape[1]
            w6 = weight.view(1, groups, -1, 1, 1, 1)
            scale = rstd * w6
            shift = bias.view(1, groups, -1, 1, 1, 1) - mean * scale
            stats = (mean.view(mean.shape[0], groups), rstd.view(mean.shape[0], groups))
        wide = compute_dtype(dtypes[0])
        return (None, stats[0].to(dtypes[1]), stats[1].to(dtypes[2]),
                (scale.to(wide), shift.to(wide)))

    def _affine(self, a: Any, channels: int) -> torch.Tensor:
        """A normalisation's weight or bias (1 or 0 when it has none: ``bias`` False)."""
        if a is None:
            return torch.ones(channels, dtype=torch.float64, device=self._device())
        return self.small[a.name].double()

    def _norm_backward(self, op: _Op, total: Any, dtypes: list) -> tuple:
        ds, db = total  # per (sample, channel), float64
        x_shape = self._shapes[op.args[1].name]
        mask = op.args[-1]
        if op.target is aten.native_batch_norm_backward.default:
            mean = self.small[op.args[5].name].double()
            invstd = self.small[op.args[6].name].double()
            weight = self._affine(op.args[2], x_shape[1])
            count = x_shape[0] * x_shape[2] * x_shape[3] * x_shape[4]
            db_c, ds_c = db.sum(0), ds.sum(0)
            dot = ds_c - mean * db_c  # sum of dy * (x - mean)
            a = invstd * weight
            k = invstd * invstd * dot / count
            b = -a * k
            c = -a * db_c / count - mean * b
            coeff = tuple(t.view(1, -1, 1, 1, 1) for t in (a, b, c))
            gw, gb = dot * invstd, db_c
        else:  # native_group_norm_backward(dy, x, mean, rstd, weight, N, C, HxW, group, mask)
            mean = self.small[op.args[2].name].double()  # (N, G)
            rstd = self.small[op.args[3].name].double()
            groups = int(op.args[8])
            n, channels = x_shape[0], x_shape[1]
            weight = self._affine(op.args[4], channels).expand(channels)
            per = channels // groups
            count = per * x_shape[2] * x_shape[3] * x_shape[4]
            ds_g = (ds * weight).view(n, groups, per).sum(-1)
            db_g = (db * weight).view(n, groups, per).sum(-1)
            c2 = (db_g * mean - ds_g) * rstd.pow(3) / count
            c3 = -c2 * mean - db_g * rstd / count

            def per_channel(t: torch.Tensor) -> torch.Tensor:
                return t.repeat_interleave(per, dim=1)

            a = per_channel(rstd) * weight
            coeff = tuple(t.view(n, channels, 1, 1, 1)
                          for t in (a, per_channel(c2), per_channel(c3)))
            gw = ((ds - db * per_channel(mean)) * per_channel(rstd)).sum(0)
            gb = db.sum(0)
        wide = compute_dtype(dtypes[0])
        return (None, gw.to(dtypes[1]) if mask[1] else None,
                gb.to(dtypes[2]) if mask[2] else None, tuple(t.to(wide) for t in coeff))


_BATCH = {aten._native_batch_norm_legit.no_stats}


def _add(total: Any, partial: Any) -> Any:
    if total is None:
        return partial
    if isinstance(partial, tuple) and len(partial) == 3 and isinstance(partial[0], int):
        n0, mean0, m20 = total  # Chan et al.'s merge
        n1, mean1, m21 = partial
        count = n0 + n1
        delta = mean1 - mean0
        return (count, mean0 + delta * (n1 / count),
                m20 + m21 + delta.square() * (n0 * n1 / count))
    return tuple(None if a is None else a + b for a, b in zip(total, partial))


# ----------------------------------------------------------------------------- saved statistics

_SAVED = "remat3d_saved_statistics"  # a recomputed norm's (mean, rstd) placeholders


def save_norm_statistics(forward: fx.GraphModule, backward: fx.GraphModule,
                         num_fwd_outputs: int) -> None:
    """A normalisation the backward recomputes normalises with the statistics its forward
    computed (NOTE rule 6): they are saved (two small tensors each), the backward reads
    them, and a tiled region needs no pass to gather them again."""
    made = {n.name: n for n in forward.graph.nodes}
    (output,) = [n for n in forward.graph.nodes if n.op == "output"]
    results = list(output.args[0])
    saved = [n for n in backward.graph.nodes
             if n.op == "placeholder" and not n.name.startswith("tangents")]
    after = saved[-1] if saved else None
    changed = False
    for node in list(backward.graph.nodes):
        if node.op != "call_function" or node.target not in _NORMS or \
                node.name not in made or _grid(node.args[0]) is None:
            continue
        if node.target is aten._native_batch_norm_legit.no_stats and not node.args[3]:
            continue
        source = made[node.name]
        names = []
        for k in (1, 2):
            with forward.graph.inserting_after(source):
                pick = forward.graph.call_function(operator.getitem, (source, k))
            pick.meta["val"] = source.meta["val"][k]
            results.append(pick)
            if after is None:
                first = next(iter(backward.graph.nodes))
                with backward.graph.inserting_before(first):
                    placeholder = backward.graph.placeholder(f"{node.name}_saved_{k}")
            else:
                with backward.graph.inserting_after(after):
                    placeholder = backward.graph.placeholder(f"{node.name}_saved_{k}")
            placeholder.meta["val"] = source.meta["val"][k]
            after = placeholder
            for user in list(node.users):
                if user.target is operator.getitem and user.args[1] == k:
                    user.replace_all_uses_with(placeholder)
                    backward.graph.erase_node(user)
            names.append(placeholder.name)
        node.meta[_SAVED] = tuple(names)
        changed = True
    if changed:
        output.args = (tuple(results),)
        for module in (forward, backward):
            module.graph.lint()
            module.recompile()


# ----------------------------------------------------------------------------- copies

_JOINS = "remat3d_joins"  # a copy's meta: the member whose region it runs in
_STATS_OF = "remat3d_statistics_of"  # a copied normalisation: whose statistics it uses
_FREE = {aten.detach.default, aten.alias.default}


def _copy_across(gm: fx.GraphModule, regions: list[TiledRegion], values: list[TileValue],
                 recomputed: set[str], forward: bool) -> bool:
    """Give each later region that reads spatial outputs of an earlier one its own copy of
    their chains of local members (``planner/graph_tiles.py`` NOTE rule 7), where nothing
    outside the regions reads them whole. Forward values only (in a backward graph, the
    recomputed ones: a gradient is never computed twice); the copies of recomputed ops are
    recomputations too. Whether anything was copied (one later region's copies a call)."""
    by_name = {v.name: v for v in values}
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {n.name: k for k, n in enumerate(gm.graph.nodes)}
    region_of = {m: k for k, r in enumerate(regions) for m in r.members}

    def copyable(name: str) -> bool:
        if by_name[name].kind not in ("local", "shell"):
            return False
        node = nodes[name]
        if forward or name in recomputed:
            return True
        # a view or detach of a recomputed value (the partition's own) is one too
        return node.target in _VIEWS | _FREE and copyable(node.args[0].name)

    for region in regions:
        inside = set(region.members)
        wanted: dict[int, list[str]] = {}  # a later region -> the outputs it copies
        for name in region.outputs:
            users = [u for u in nodes[name].users if u.name not in inside]
            if by_name[name].kind != "local" or not copyable(name) or not users or \
                    any(u.name not in region_of for u in users):
                continue  # read whole outside every region (or returned)
            for later in {region_of[u.name] for u in users}:
                wanted.setdefault(later, []).append(name)
        for later, names in sorted(wanted.items()):
            chain, stack = set(), list(names)
            while stack:
                at = stack.pop()
                if at not in chain:
                    chain.add(at)
                    stack += [i for i in by_name[at].inputs if i in inside and copyable(i)]
            readers = sorted({u for n in names for u in nodes[n].users
                              if region_of.get(u.name) == later}, key=lambda u: order[u.name])
            env: dict[str, fx.Node] = {}
            with gm.graph.inserting_before(readers[0]):
                for at in sorted(chain, key=order.__getitem__):
                    source = nodes[at].args[0] if nodes[at].target is operator.getitem \
                        else None
                    if source is not None and by_name[source.name].kind == "reduce":
                        # a normalisation's output: its op copied to read the copied input,
                        # its statistics the earlier region's
                        op = gm.graph.node_copy(source, lambda a, e=env: e.get(a.name, a))
                        op.meta[_STATS_OF] = source.name
                        op.meta[_JOINS] = readers[0].name
                        env[source.name] = op
                    made = gm.graph.node_copy(nodes[at], lambda a, e=env: e.get(a.name, a))
                    made.meta[_JOINS] = readers[0].name
                    if at in recomputed:
                        recomputed.add(made.name)
                    env[at] = made
                    env.pop(source.name, None) if source is not None else None
            for reader in readers:
                for n in names:
                    reader.replace_input_with(nodes[n], env[n])
            # one region's copies a round: the next reads the graph as it now is (a chain
            # copied later may pass through readers rewired here)
            gm.graph.lint()
            gm.recompile()
            return True
    return False


# ----------------------------------------------------------------------------- the rewrite

def _values(gm: fx.GraphModule, grids: set[tuple[int, ...]]) -> list[TileValue]:
    values: list[TileValue] = []
    kinds: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "output":
            values.append(_value(node, grids, kinds))
            kinds[node.name] = values[-1].kind
    return values


def tile_graph(gm: fx.GraphModule, tile: tuple[int, ...], recomputed: Iterable[str] = (),
               levels: int = 1, stash: str = "none", copy: bool = False,
               label: str = "", stashes: Mapping[str, str] | None = None
               ) -> list[TiledRegion]:
    """Replace the ops of ``gm`` on its ``levels`` finest grids by tiled regions run in
    tiles of ``tile`` on the finest (NOTE rule 1), each stashing what ``stash`` says of
    what a later pass reads (``planner/graph_tiles.py`` NOTE rule 6), computing again what an
    earlier region made when ``copy`` (rule 7); returns the regions. ``label`` says which
    graph ``gm`` is (``"forward"``: every value may be copied; else only the
    ``recomputed`` ones) and starts its regions' labels (NOTE rule 7); ``stashes`` sets a
    stash policy per label."""
    grids = sorted({g for g in (_grid(n) for n in gm.graph.nodes) if g is not None},
                   key=lambda s: -s[0] * s[1] * s[2])
    if not grids:
        return []
    recomputed = set(recomputed)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    returned = [a.name for a in output.all_input_nodes]
    forward = label == "forward"  # a forward graph: every value is a forward value
    while True:  # each round copies into later regions only: it ends
        values = _values(gm, set(grids[:levels]))
        regions = regions_of(values, returned)
        if not copy or not _copy_across(gm, regions, values, recomputed, forward):
            break
    if not regions:
        return []
    by_name = {v.name: v for v in values}
    labels = [f"{label}:{r.members[-1]}" for r in regions]
    for region, name in zip(regions, labels):
        policy = (stashes or {}).get(name, stash)
        if policy != "none":
            region.stashes = region.stashable(by_name, policy)
    nodes = {n.name: n for n in gm.graph.nodes}
    owner = {m: k for k, r in enumerate(regions) for m in r.members}
    runs = []
    for region in regions:
        names = set(region.members) | set(region.inputs)
        # spatial: the members made on a grid and what their windows read (a weight is
        # 5-D too, but read whole)
        spatial = {m for m in region.members if by_name[m].size is not None} | \
            {i for m in region.members for i in by_name[m].relations}
        ops = {m: _plain(nodes[m]) for m in region.members}
        for m in region.members:  # a pick's op, made by an earlier region (a copy's)
            if nodes[m].target is operator.getitem and nodes[m].args[0].name not in ops:
                ops[nodes[m].args[0].name] = _plain(nodes[m].args[0])
        sizes = {n: _grid(nodes[n]) for n in spatial}
        shapes = {n: tuple(_first(_val(nodes[n])).shape) for n in names
                  if isinstance(_first(_val(nodes[n])), torch.Tensor)}
        dtypes = {m: [t.dtype if isinstance(t, torch.Tensor) else None
                      for t in (_val(nodes[m]) if isinstance(_val(nodes[m]), (tuple, list))
                                else [_val(nodes[m])])]
                  for m in region.members}
        runs.append(_RegionRun(region, by_name, ops, sizes, shapes, dtypes, tile,
                               set(recomputed), labels[len(runs)]))
    _rewrite(gm, regions, runs, owner)
    return regions


def _rewrite(gm: fx.GraphModule, regions: list[TiledRegion], runs: list[_RegionRun],
             owner: dict[str, int]) -> None:
    """Rebuild ``gm``'s graph with each region one call (NOTE rule 1): a topological order
    of the graph with each region one unit, each unit placed as early as its inputs allow
    in the order of its first node (the original order, where no region moves anything)."""
    import heapq

    old = gm.graph
    nodes = [n for n in old.nodes if n.op != "output"]
    (output,) = [n for n in old.nodes if n.op == "output"]
    index = {n.name: k for k, n in enumerate(nodes)}
    unit = {n.name: ("r", owner[n.name]) if n.name in owner else ("n", n.name) for n in nodes}
    first: dict[tuple, int] = {}
    needs: dict[tuple, set] = {}
    for n in nodes:
        u = unit[n.name]
        first[u] = min(first.get(u, index[n.name]), index[n.name])
        needs.setdefault(u, set()).update(unit[a.name] for a in n.all_input_nodes
                                          if unit[a.name] != u)
    users: dict[tuple, list] = {}
    for u, deps in needs.items():
        for d in deps:
            users.setdefault(d, []).append(u)
    waiting = {u: len(deps) for u, deps in needs.items()}
    heap = [(first[u], u) for u, k in waiting.items() if k == 0]
    heapq.heapify(heap)
    new = fx.Graph()
    env: dict[str, fx.Node] = {}
    by_name = {n.name: n for n in nodes}
    while heap:
        _, u = heapq.heappop(heap)
        if u[0] == "n":
            env[u[1]] = new.node_copy(by_name[u[1]], lambda a: env[a.name])
        else:
            region, run = regions[u[1]], runs[u[1]]
            call = new.call_function(run, tuple(env[i] for i in region.inputs))
            call.meta["val"] = None
            for j, name in enumerate(region.outputs):
                pick = new.call_function(operator.getitem, (call, j))
                pick.meta = dict(by_name[name].meta)
                env[name] = pick
        for v in users.get(u, []):
            waiting[v] -= 1
            if waiting[v] == 0:
                heapq.heappush(heap, (first[v], v))
    assert len(env) >= len(nodes) - len(owner), "a tiled region is not convex"
    new.output(fx.node.map_arg(output.args[0], lambda a: env[a.name]))
    gm.graph = new
    new.lint()
    gm.recompile()

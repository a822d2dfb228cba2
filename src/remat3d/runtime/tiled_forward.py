"""Run a forward plan (``planner/forward_tiles.py``): the traced forward graph, step by
step, each step's ops tile by tile into its materialized root.

NOTE [ Tiled forward steps ]
  1. A step with one tile calls each op on whole tensors, the traced aten call as it is:
     bit for bit the untiled forward.
  2. In a tiled step every member op computes exactly the region of its output that
     ``halo.needed_regions`` names for the tile (its consumers' bounding box). Operands
     are cropped to what the op reads: a convolution or pooling reads the slice its
     window needs and pads only where that slice leaves the volume (zeros; ``-inf`` for
     max pooling), then runs without padding; a transposed convolution and an
     interpolation run on their input slice and crop (or pad, adding the bias alone
     where no input reaches) the local result; pointwise ops, concatenation along
     channels and channel reductions crop every spatial operand; a view's shape takes
     the tile's extent. Materialized operands in host memory are copied to the device
     slice by slice.
  3. A normalisation with statistics in a tiled step uses the whole tensor's mean and
     variance, gathered (Chan et al.'s merge, in float64) while the storage it reads was
     made: tile by tile if that step was tiled, in slabs otherwise. Its output is
     ``(x - mean) * rstd * weight + bias`` at least in float32, cast back: every value a
     tile computes equals the untiled value up to rounding.
  4. On meta (``verify``) a tiled step runs only its representative tiles (the planner's
     ``representative_tiles``: every distinct clamping), so the tracker's peak is the
     plan's without running every tile.
  5. An activation whose operand is a temporary of its own step (not the step's root, not
     a view, read by nothing after it) overwrites that operand: the same kernel, the same
     values, one allocation fewer. Members of a step other than its root have one reader.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from remat3d.capture.forward import ForwardCapture, spatial_size_args
from remat3d.errors import TilingError
from remat3d.halo import (
    Region,
    conv_input_interval,
    conv_transpose_input_slices,
    interpolate_input_interval,
    needed_regions,
    tile_grid,
)
from remat3d.planner.forward_tiles import ForwardPlan, Step, representative_tiles, view_base
from remat3d.runtime.tiling.execute import Stats, compute_dtype, crop
from remat3d.runtime.tiling.host import host_empty, is_host, to_device
from remat3d.runtime.tiling.trace import NormSpec

__all__ = ["run_plan"]

aten = torch.ops.aten
_SLABS = 8  # a whole tensor's statistics are gathered in this many slabs
# activations run in place on a step's own temporary that nothing else reads (NOTE rule 5)
_IN_PLACE = {aten.relu.default: aten.relu_.default,
             aten.leaky_relu.default: aten.leaky_relu_.default,
             aten.hardtanh.default: aten.hardtanh_.default,
             aten.elu.default: aten.elu_.default,
             aten.silu.default: aten.silu_.default,
             aten.sigmoid.default: aten.sigmoid_.default,
             aten.tanh.default: aten.tanh_.default}


def _whole(t: torch.Tensor) -> Region:
    return tuple((0, n) for n in t.shape[2:])


def _stats_spec(node: fx.Node) -> NormSpec:
    x = node.args[0].meta["val"]
    if node.target is aten.native_group_norm.default:
        return NormSpec("group", int(node.args[6]), float(node.args[7]), False)
    return NormSpec("batch", int(x.shape[1]), float(node.args[-1]), False)


class _Run:
    def __init__(self, capture: ForwardCapture, plan: ForwardPlan, device: torch.device,
                 verify: bool) -> None:
        self.gm = capture.gm
        self.graph = capture.graph
        self.plan = plan
        self.device = device
        self.verify = verify
        self.nodes = {n.name: n for n in self.gm.graph.nodes}
        self.host = set(plan.host)
        self.env: dict[str, Any] = {}
        self.stats: dict[str, Stats] = {}
        self._chains: dict[str, list[tuple[str, list[fx.Node]]]] = {}
        self.number = {n.name: i for i, n in enumerate(self.graph.nodes)}

    # -- materialized tensors ------------------------------------------------------------
    def place(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` where the plan keeps ``name``."""
        if name in self.host and isinstance(value, torch.Tensor):
            out = host_empty(value.shape, value.dtype, self.device)
            out.copy_(value)
            return out
        return value

    def fetch(self, name: str, want: Region | None = None) -> torch.Tensor:
        """A materialized tensor (or the part covering ``want``) on the device."""
        t = self.env[name]
        if want is not None:
            t = crop(t, _whole(t), want)
        if name in self.host:
            t = to_device(t, self.device)
        return t

    # -- statistics (NOTE rule 3) ----------------------------------------------------------
    def chains(self, root: str) -> list[tuple[str, list[fx.Node]]]:
        """The tiled normalisations reading ``root`` (through views): each with the view
        nodes leading to its input (found once per run: ``gather`` asks per tile)."""
        if root in self._chains:
            return self._chains[root]
        found = []
        for name in self.stats:
            node = self.nodes[name]
            if view_base(self.graph, node.args[0].name) != root:
                continue
            chain, at = [], node.args[0]
            while at.name != root:
                chain.append(at)
                at = at.args[0]
            found.append((name, chain[::-1]))
        self._chains[root] = found
        return found

    def gather(self, root: str, value: torch.Tensor, region: Region | None) -> None:
        for name, chain in self.chains(root):
            x = value
            for view in chain:
                x = self.call_view(view, x, region or _whole(value))
            self.stats[name].add(x.unflatten(1, (self.stats[name].spec.groups, -1)))

    def finish(self, root: str) -> None:
        """The statistics gathered from ``root`` are complete."""
        for name, _ in self.chains(root):
            self.stats[name].finish()

    def gather_whole(self, root: str) -> None:
        if not self.chains(root):
            return
        t = self.env[root]
        depth = t.shape[2]
        step = max(-(-depth // _SLABS), 1)
        for lo in range(0, depth, step):
            want = ((lo, min(lo + step, depth)), *_whole(t)[1:])
            self.gather(root, self.fetch(root, want), want)
        self.finish(root)

    # -- one tile's ops (NOTE rule 2) ---------------------------------------------------
    def call_view(self, node: fx.Node, x: torch.Tensor, want: Region) -> torch.Tensor:
        args = list(node.args)
        args[0] = x
        if spatial_size_args(node):
            args[1] = [*args[1][:-3], *(hi - lo for lo, hi in want)]
        return node.target(*args, **node.kwargs)

    def operand(self, a: fx.Node, want: Region, vals: dict[str, tuple[Any, Region]]
                ) -> torch.Tensor:
        if a.name in vals:
            t, have = vals[a.name]
            return crop(t, have, want)
        return self.fetch(a.name, want)

    def whole_operand(self, a: fx.Node, vals: dict[str, tuple[Any, Region]]) -> Any:
        if a.name in vals:
            return vals[a.name][0]
        if a.name in self.host:
            return self.fetch(a.name)
        return self.env[a.name]

    def window(self, node: fx.Node, want: Region, vals: dict, fill: float) -> torch.Tensor:
        tn = self.graph[node.name]
        x = node.args[0]
        size = self.graph[x.name].size
        assert size is not None
        slices, pads = [], []
        for a, (lo, hi) in enumerate(want):
            i0, i1 = conv_input_interval(lo, hi, kernel=tn.kernel[a], stride=tn.stride[a],
                                         padding=tn.padding[a], dilation=tn.dilation[a])
            slices.append((max(i0, 0), min(i1, size[a])))
            pads.append((max(-i0, 0), max(i1 - size[a], 0)))
        t = self.operand(x, tuple(slices), vals)
        if any(p for pair in pads for p in pair):
            t = aten.constant_pad_nd(t, [p for pair in reversed(pads) for p in pair], fill)
        return t

    def tile_op(self, node: fx.Node, want: Region, vals: dict) -> Any:
        tn = self.graph[node.name]
        t = node.target
        if t is aten.convolution.default and tn.relation == "conv":
            x = self.window(node, want, vals, 0.0)
            _, w, b, stride, _, dilation, _, _, groups = node.args
            return aten.convolution(x, self.env[w.name], None if b is None else
                                    self.env[b.name], stride, [0, 0, 0], dilation, False,
                                    [0, 0, 0], groups)
        if t is aten.convolution.default:
            return self.conv_transpose(node, want, vals)
        if t is aten.max_pool3d_with_indices.default:
            x = self.window(node, want, vals, float("-inf"))
            return aten.max_pool3d_with_indices(x, list(tn.kernel), list(tn.stride),
                                                [0, 0, 0], list(tn.dilation), False)
        if t is aten.avg_pool3d.default:
            x = self.window(node, want, vals, 0.0)
            args = list(node.args) + [None] * (7 - len(node.args))
            return aten.avg_pool3d(x, list(tn.kernel), list(tn.stride), [0, 0, 0], False,
                                   True if args[5] is None else args[5], args[6])
        if tn.relation == "interpolate":
            return self.interpolate(node, want, vals)
        if tn.kind == "stats":
            return self.normalise(node, want, vals)
        if spatial_size_args(node):
            return self.call_view(node, self.operand(node.args[0], want, vals), want)
        if t is operator.getitem:
            return vals[node.args[0].name][0][node.args[1]]
        inputs = set(tn.inputs)

        def value(a: fx.Node) -> Any:
            if a.name in inputs:
                return self.operand(a, want, vals)
            return self.whole_operand(a, vals)

        target = self.in_place(node, vals)
        return target(*fx.node.map_arg(node.args, value),
                      **fx.node.map_arg(node.kwargs, value))

    def in_place(self, node: fx.Node, temporaries: dict[str, Any]) -> Any:
        """``node``'s in-place twin where its operand is a temporary it may overwrite
        (NOTE rule 5; the caller drops that temporary after ``node``), else its target."""
        twin = _IN_PLACE.get(node.target)  # type: ignore[call-overload]
        if twin is None or not isinstance(node.args[0], fx.Node):
            return node.target
        a = node.args[0]
        fresh = a.name in temporaries and not self.graph[a.name].view and \
            a.op == "call_function" and len(a.users) == 1
        return twin if fresh else node.target

    def conv_transpose(self, node: fx.Node, want: Region, vals: dict) -> torch.Tensor:
        tn = self.graph[node.name]
        x_node, w, b, stride, _, dilation, _, _, groups = node.args
        size = self.graph[x_node.name].size
        assert size is not None
        slices, starts = conv_transpose_input_slices(
            want, kernel=tn.kernel, stride=tn.stride, padding=tn.padding,
            dilation=tn.dilation, size=size)
        x = self.operand(x_node, slices, vals)
        weight = self.env[w.name]
        bias = None if b is None else self.env[b.name]
        extent = [(i1 - i0 - 1) * tn.stride[a] + tn.dilation[a] * (tn.kernel[a] - 1) + 1
                  for a, (i0, i1) in enumerate(slices)]
        pads = [(g0 - lo, hi - (g0 + n)) for g0, (lo, hi), n in zip(starts, want, extent)]
        reached = all(p <= 0 for pair in pads for p in pair)
        # every position reached: the kernel adds the bias, as the untiled op does
        y = aten.convolution(x, weight, bias if reached else None, stride, [0, 0, 0],
                             dilation, True, [0, 0, 0], groups)
        if reached:
            return crop(y, tuple((g0, g0 + n) for g0, n in zip(starts, y.shape[2:])), want)
        y = aten.constant_pad_nd(y, [p for pair in reversed(pads) for p in pair], 0.0)
        if bias is not None:
            y = y + bias.to(y.dtype).view(1, -1, 1, 1, 1)
        return y

    def interpolate(self, node: fx.Node, want: Region, vals: dict) -> torch.Tensor:
        tn = self.graph[node.name]
        x_node = node.args[0]
        size = self.graph[x_node.name].size
        assert size is not None
        mode = tn.mode
        slices = tuple(interpolate_input_interval(lo, hi, scale=tn.scale[a], mode=mode,
                                                  size=size[a])
                       for a, (lo, hi) in enumerate(want))
        x = self.operand(x_node, slices, vals)
        out_size = [(i1 - i0) * f for (i0, i1), f in zip(slices, tn.scale)]
        scales = [float(f) for f in tn.scale]
        if mode == "nearest":
            y = aten.upsample_nearest3d(x, out_size, *scales)
        else:
            y = aten.upsample_trilinear3d(x, out_size, False, *scales)
        local = tuple((i0 * f, i1 * f) for (i0, i1), f in zip(slices, tn.scale))
        return crop(y, local, want)

    def normalise(self, node: fx.Node, want: Region, vals: dict) -> tuple:
        x = self.operand(node.args[0], want, vals)
        stats = self.stats[node.name]
        assert stats.mean is not None and stats.rstd is not None
        dtype = compute_dtype(x.dtype)
        groups = stats.spec.groups
        # y = x * scale + shift, scale = rstd * weight and shift = bias - mean * scale made
        # in float64 per (sample, channel): one pass, the arithmetic of torch's own norms
        scale = stats.rstd.expand(-1, -1, x.shape[1] // groups, 1, 1, 1)
        weight, bias = node.args[1], node.args[2]
        if weight is not None:
            scale = scale * self.env[weight.name].double().view(1, groups, -1, 1, 1, 1)
        shift = -stats.mean * scale
        if bias is not None:
            shift = shift + self.env[bias.name].double().view(1, groups, -1, 1, 1, 1)
        x6 = x.unflatten(1, (groups, -1)).to(dtype)
        y = torch.addcmul(shift.to(dtype), x6, scale.to(dtype)).flatten(1, 2)
        return (y.to(x.dtype),)

    # -- steps ---------------------------------------------------------------------------
    def run_step(self, step: Step) -> None:
        if step.whole or not step.tiled(self.graph):
            self.run_whole(step)
            return
        g = self.graph
        members = [self.nodes[m] for m in step.nodes]
        ops = [g[m].spatial_op(self.number) for m in step.nodes]
        sizes = {self.number[n]: g[n].size for m in step.nodes for n in (m, *g[m].inputs)}
        size = g[step.root].size
        assert size is not None and step.tile is not None
        root_value = self.nodes[step.root].meta["val"]
        if step.root in self.host:
            out = host_empty(root_value.shape, root_value.dtype, self.device)
        else:
            out = torch.empty(root_value.shape, dtype=root_value.dtype, device=self.device)
        tiles = representative_tiles(size, step.tile) if self.verify else \
            tile_grid(size, step.tile)
        last_use = {}
        for k, node in enumerate(members):
            for a in node.all_input_nodes:
                last_use[a.name] = k
        for tile in tiles:
            regions = needed_regions(ops, sizes, {self.number[step.root]: tile})
            vals: dict[str, tuple[Any, Region]] = {}
            for k, node in enumerate(members):
                want = regions[self.number[node.name]]
                vals[node.name] = (self.tile_op(node, want, vals), want)
                for a in node.all_input_nodes:
                    if last_use.get(a.name) == k and a.name in vals and a.name != step.root:
                        del vals[a.name]
            value = vals.pop(step.root)[0]
            del vals
            crop(out, _whole(out), tile).copy_(value)
            self.gather(step.root, value, tile)
            del value
        self.env[step.root] = out
        if self.chains(step.root):
            self.finish(step.root)

    def run_whole(self, step: Step) -> None:
        local: dict[str, Any] = {}

        def value(a: fx.Node) -> Any:
            if a.name in local:
                return local[a.name]
            if a.name in self.host:
                return self.fetch(a.name)
            return self.env[a.name]

        members = [self.nodes[m] for m in step.nodes]
        last_use = {}
        for k, node in enumerate(members):
            for a in node.all_input_nodes:
                last_use[a.name] = k
        for k, node in enumerate(members):
            target = self.in_place(node, local)
            local[node.name] = target(*fx.node.map_arg(node.args, value),
                                      **fx.node.map_arg(node.kwargs, value))
            for a in node.all_input_nodes:
                if last_use.get(a.name) == k and a.name in local and a.name != step.root:
                    del local[a.name]
        self.env[step.root] = self.place(step.root, local.pop(step.root))
        local.clear()
        self.gather_whole(step.root)

    def run(self, weights: list[torch.Tensor], volume: torch.Tensor,
            progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for node, w in zip(placeholders, weights):
            self.env[node.name] = w
        for node in self.gm.graph.nodes:  # constants: once, before any step
            if node.op == "call_function" and self.graph[node.name].kind == "const":
                self.env[node.name] = node.target(
                    *fx.node.map_arg(node.args, lambda a: self.env[a.name]),
                    **fx.node.map_arg(node.kwargs, lambda a: self.env[a.name]))
        vname = placeholders[-1].name
        if vname in self.host:
            self.env[vname] = volume if is_host(volume, self.device) else \
                self.place(vname, volume)
        else:
            self.env[vname] = volume.to(self.device)
        tiled = {m for s in self.plan.steps if not s.whole and s.tiled(self.graph)
                 for m in s.nodes}
        self.stats = {n.name: Stats(_stats_spec(self.nodes[n.name]))
                      for n in self.graph.nodes if n.kind == "stats" and n.name in tiled}
        self.gather_whole(vname)
        last = {}
        for k, step in enumerate(self.plan.steps):
            for m in step.nodes:
                for r in self.graph[m].reads:
                    last[r] = k
        output = self.graph.output
        for k, step in enumerate(self.plan.steps):
            self.run_step(step)
            if progress is not None:
                progress(k + 1, len(self.plan.steps))
            for name in [n for n, at in last.items() if at == k and n != output]:
                if self.graph[name].kind != "const":
                    self.env.pop(name, None)
        return self.env[output]


def run_plan(capture: ForwardCapture, plan: ForwardPlan, model: nn.Module,
             volume: torch.Tensor, device: torch.device, *, verify: bool = False,
             progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """``plan``'s forward of ``model`` on ``volume``, computed on ``device`` (NOTE);
    ``progress(done, total)`` is called after each step."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    missing = [n for n in capture.weights if n not in named]
    if missing:
        raise TilingError(f"the model has no parameter or buffer {missing[0]!r} that its "
                          "traced forward reads; plan the prediction for this model")
    weights = [named[n] for n in capture.weights]
    return _Run(capture, plan, device, verify).run(weights, volume, progress)

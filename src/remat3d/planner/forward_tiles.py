"""Plan a forward pass (prediction) under a device budget: which tensors are whole, where
they live, and which runs of ops are computed tile by tile. Pure Python, no torch.

NOTE [ Tiled forward plans ]
  1. *Materialized* tensors are whole (on the device or in host memory); every other
     tensor exists only tile by tile. Materialized are: the volume; the output; the inputs
     and outputs of ``whole`` ops; the storage a normalisation with statistics reads (its
     statistics are gathered while that tensor is produced, tile by tile); a spatial
     tensor read whole (a ``(1, 1, 1)`` operand broadcast over a larger one); and every
     tensor with more than one reader (a skip connection).
  2. So every other tensor has exactly one reader, and the ops joined by such tensors
     form trees, each ending in one materialized *root*: a *step* computes its root tile
     by tile (each tile's inputs by halo arithmetic, ``halo.needed_regions``) from
     materialized tensors made by earlier steps, with no recomputation but the halos.
     Steps run in their roots' graph order, which is a topological order of steps
     (a tree's inputs come before its members, its members before its root).
  3. Liveness is exact at step granularity: a materialized tensor is alive from the start
     of the step making it to the end of the last step reading it (the output to the
     end); on the device it counts against the budget, in host memory it does not. A
     step's own working set is bounded from above: every member's tile region, every
     slice it reads of a materialized input, two of its largest member's tile (in float32
     for a normalisation: an op's own temporaries), the statistics' temporaries; the peak of a
     plan is the largest step's live tensors plus working set, plus the constants.
  4. The search is greedy and deterministic: start whole and on the device; while the
     peak step is over the budget, halve its tile's largest axis when its working set
     is at least what its live materialized tensors hold (and it can shrink), else move
     the largest device tensor alive there to host memory (where the host is separate
     from the device), else shrink its tile anyway; no move left: infeasible, and the
     peak reached is the smallest feasible budget. Then each step's tile grows back to
     the largest that fits: fewer tiles, less halo work.
  5. A step with one tile runs its ops on whole tensors, the untiled kernels: a plan that
     tiles nothing computes bit for bit what the unplanned forward computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from remat3d.errors import InfeasibleBudgetError
from remat3d.halo import Region, input_region, needed_regions, region_size
from remat3d.tilegraph import TileGraph, TileNode
from remat3d.units import format_bytes

__all__ = ["ForwardPlan", "Step", "materialized", "plan_forward", "representative_tiles",
           "steps_of", "view_base"]

MIN_TILE = 8  # the smallest tile edge the search tries (on a step root's grid)


@dataclass
class Step:
    """One step: ``nodes`` (graph order) computed tile by tile into ``root``."""

    root: str
    nodes: list[str]
    whole: bool = False  # a ``whole`` op: one call on whole tensors
    tile: tuple[int, ...] | None = None  # the tile's extent on the root's grid

    def tiled(self, graph: TileGraph) -> bool:
        size = graph[self.root].size
        return self.tile is not None and size is not None and tuple(self.tile) != tuple(size)


@dataclass
class ForwardPlan:
    """Plain data: what ``runtime/tiled_forward.py`` runs."""

    steps: list[Step]
    host: list[str] = field(default_factory=list)  # materialized tensors in host memory
    peak_bytes: int = 0  # the plan's bound on device memory (NOTE rule 3)
    host_peak_bytes: int = 0
    budget_bytes: int | None = None
    unplanned_bytes: int = 0  # the same bound for the whole forward on the device
    tiled: bool = False  # some step runs in more than one tile

    def to_dict(self) -> dict[str, Any]:
        return {"steps": [vars(s) for s in self.steps], "host": self.host,
                "peak_bytes": self.peak_bytes, "host_peak_bytes": self.host_peak_bytes,
                "budget_bytes": self.budget_bytes, "unplanned_bytes": self.unplanned_bytes,
                "tiled": self.tiled}


def view_base(graph: TileGraph, name: str) -> str:
    """The node whose storage ``name`` reads through views (itself if it is none)."""
    node = graph[name]
    while node.view and node.kind == "local" and len(node.inputs) == 1:
        node = graph[node.inputs[0]]
    return node.name


def materialized(graph: TileGraph) -> set[str]:
    """The materialized tensors (NOTE rule 1)."""
    keep = {graph.output}
    for n in graph.nodes:
        if n.kind == "input":
            keep.add(n.name)
        elif n.kind == "whole":
            keep.add(n.name)
            keep.update(r for r in n.reads if graph[r].kind != "const")
        elif n.kind in ("local", "stats"):
            if n.kind == "stats":
                keep.add(view_base(graph, n.inputs[0]))
            keep.update(r for r in n.reads
                        if graph[r].kind != "const" and r not in n.inputs)
        if n.kind != "const" and len(graph.readers(n.name)) > 1:
            keep.add(n.name)
    return keep


def steps_of(graph: TileGraph) -> list[Step]:
    """The steps of NOTE rule 2, in their roots' graph order."""
    keep = materialized(graph)
    owner: dict[str, str] = {}  # local node -> the root of its tree

    def root_of(name: str) -> str:
        while name in owner and owner[name] != name:
            name = owner[name]
        return name

    for n in graph.nodes:
        if n.kind in ("local", "stats"):
            owner.setdefault(n.name, n.name)
            for i in n.inputs:
                if graph[i].kind in ("local", "stats") and i not in keep:
                    owner[root_of(i)] = root_of(n.name)
    members: dict[str, list[str]] = {}
    for n in graph.nodes:
        if n.kind in ("local", "stats"):
            members.setdefault(root_of(n.name), []).append(n.name)
        elif n.kind == "whole":
            members[n.name] = [n.name]
    return [Step(n.name, members[n.name], whole=n.kind == "whole") for n in graph.nodes
            if n.name in members]


def _voxel_bytes(node: TileNode) -> int:
    size = node.size or ()
    voxels = 1
    for s in size:
        voxels *= s
    return -(-node.bytes // max(voxels, 1))


def representative_tiles(size: tuple[int, ...], tile: tuple[int, ...]) -> list[Region]:
    """The first, second and last tile along each axis, combined: every distinct
    clamping a tile's halos can meet (the working set is the largest of these)."""
    axes = []
    for n, t in zip(size, tile):
        starts = sorted({0, min(t, n - 1) if n > t else 0, ((n - 1) // t) * t})
        axes.append([(s, min(s + t, n)) for s in starts])
    tiles: list[Region] = [()]
    for options in axes:
        tiles = [r + (iv,) for r in tiles for iv in options]
    return tiles


class _Model:
    """Working sets and liveness of one graph's steps (NOTE rule 3)."""

    def __init__(self, graph: TileGraph, steps: list[Step]) -> None:
        self.graph = graph
        self.steps = steps
        self.number = {n.name: i for i, n in enumerate(graph.nodes)}
        self.const_bytes = sum(n.bytes for n in graph.nodes if n.kind == "const")
        self.keep = materialized(graph)
        position = {s.root: k for k, s in enumerate(steps)}
        self.made = {s.root: k for k, s in enumerate(steps)}
        self.made[next(n.name for n in graph.nodes if n.kind == "input")] = 0
        self.last: dict[str, int] = {}
        for k, s in enumerate(steps):
            for name in s.nodes:
                for r in graph[name].reads:
                    if r in self.keep:
                        self.last[r] = max(self.last.get(r, k), k)
        self.last[graph.output] = len(steps) - 1
        del position
        # the stats whose statistics a tiled reader needs: gathered where their base is made
        self.stats_base = {n.name: view_base(graph, n.inputs[0]) for n in graph.nodes
                           if n.kind == "stats"}
        self.stats_step = {name: k for k, s in enumerate(steps) for name in s.nodes
                           if name in self.stats_base}
        self._cache: dict[tuple[int, tuple[int, ...], frozenset[str]], int] = {}

    def stats_fed(self, k: int, tiles: dict[int, tuple[int, ...]]) -> list[str]:
        """Stats nodes whose statistics step ``k`` gathers (their reader is tiled)."""
        root = self.steps[k].root
        return [s for s, base in self.stats_base.items()
                if base == root and self._is_tiled(self.stats_step[s], tiles)]

    def _is_tiled(self, k: int, tiles: dict[int, tuple[int, ...]]) -> bool:
        step = self.steps[k]
        return not step.whole and tiles[k] != self.graph[step.root].size

    def working(self, k: int, tile: tuple[int, ...], host: set[str],
                gathers: bool) -> int:
        step = self.steps[k]
        g = self.graph
        root = g[step.root]
        if step.whole:
            node = g[step.root]
            total = node.bytes if step.root in host else 0
            total += sum(g[r].bytes for r in node.reads if r in host)
            return total + (2 * node.bytes * 4 // max(node.itemsize, 1) // 8 if gathers else 0)
        fetched = frozenset(i for m in step.nodes for i in g[m].inputs if i in host)
        key = (k, tile, fetched)
        if key not in self._cache:
            ops = [g[m].spatial_op(self.number) for m in step.nodes]
            sizes = {self.number[n]: g[n].size for m in step.nodes
                     for n in (m, *g[m].inputs)}
            worst = 0
            assert root.size is not None
            for region in representative_tiles(root.size, tile):
                regions = needed_regions(ops, sizes, {self.number[step.root]: region})
                total = largest = 0
                for m in step.nodes:
                    node = g[m]
                    r = regions.get(self.number[m])
                    if r is not None and not node.view:
                        here = region_size(r)
                        if node.relation == "conv_transpose":  # its local result, uncropped
                            need = input_region(node.spatial_op(self.number), r,
                                                g[node.inputs[0]].size or ())
                            here = 1
                            for a, (lo, hi) in enumerate(need):
                                here *= (hi - lo - 1) * node.stride[a] + \
                                    node.dilation[a] * (node.kernel[a] - 1) + 1
                        here *= _voxel_bytes(node)
                        total += here
                        # an op's own temporaries (a normalisation's in float32, a
                        # padded or cropped local result): two of its outputs at most
                        widen = 4 // max(node.itemsize, 1) if node.kind == "stats" else 1
                        largest = max(largest, here * max(widen, 1))
                    out = regions.get(self.number[m])
                    if out is None:
                        continue
                    op = node.spatial_op(self.number)
                    for i in node.inputs:
                        # the copies of what it reads: a slice of a host tensor copied
                        # to the device, and a window op's padded copy (a member's own
                        # region is counted above; a device tensor's slice is a view)
                        copies = (i in fetched) + (node.relation == "conv" and
                                                   any(node.padding))
                        if not copies:
                            continue
                        need = input_region(op, out, g[i].size or ())
                        padded = tuple(hi - lo + 2 * p for (lo, hi), p
                                       in zip(need, node.padding))
                        voxels = 1
                        for e in padded:
                            voxels *= e
                        total += copies * voxels * _voxel_bytes(g[i])
                worst = max(worst, total + 2 * largest)
            self._cache[key] = worst
        total = self._cache[key]
        if gathers:
            voxels = 1
            for e in tile:
                voxels *= e
            total += 2 * voxels * _voxel_bytes(root) * 4 // max(root.itemsize, 1)
        if step.root in host:
            voxels = 1
            for e in tile:
                voxels *= e
            total += voxels * _voxel_bytes(root)  # the tile, copied out
        return total

    def peaks(self, tiles: dict[int, tuple[int, ...]], host: set[str]
              ) -> tuple[list[int], int]:
        """Device bytes at each step, and the host's peak."""
        device, host_peak = [], 0
        for k in range(len(self.steps)):
            live = [n for n in self.keep if self.made.get(n, 0) <= k <= self.last.get(n, k)]
            on_device = sum(self.graph[n].bytes for n in live if n not in host)
            host_peak = max(host_peak, sum(self.graph[n].bytes for n in live if n in host))
            gathers = bool(self.stats_fed(k, tiles))
            device.append(self.const_bytes + on_device +
                          self.working(k, tiles[k], host, gathers))
        return device, host_peak


def _shrink(tile: tuple[int, ...]) -> tuple[int, ...] | None:
    axis = max(range(len(tile)), key=lambda a: (tile[a], -a))
    if tile[axis] <= MIN_TILE:
        return None
    new = list(tile)
    new[axis] = max(-(-tile[axis] // 2), MIN_TILE)
    return tuple(new)


def plan_forward(graph: TileGraph, budget: int, *, host_separate: bool = True
                 ) -> ForwardPlan:
    """A plan whose device peak (NOTE rule 3) is at most ``budget`` bytes (NOTE rule 4).

    Raises :class:`InfeasibleBudgetError` naming the smallest peak the search reaches.
    """
    steps = steps_of(graph)
    model = _Model(graph, steps)
    tiles = {k: tuple(graph[s.root].size or ()) for k, s in enumerate(steps)}
    host: set[str] = set()
    device, host_peak = model.peaks(tiles, host)
    unplanned = max(device)
    while max(device) > budget:
        k = max(range(len(steps)), key=lambda i: (device[i], -i))
        step = steps[k]
        live = [n for n in model.keep if n not in host and
                model.made.get(n, 0) <= k <= model.last.get(n, k)]
        live_bytes = sum(graph[n].bytes for n in live)
        working = device[k] - live_bytes - model.const_bytes
        smaller = None if step.whole else _shrink(tiles[k])
        movable = sorted((n for n in live if graph[n].size is not None),
                         key=lambda n: (-graph[n].bytes, n)) if host_separate else []
        if smaller is not None and (working >= live_bytes or not movable):
            tiles[k] = smaller
        elif movable:
            host.add(movable[0])
        else:
            raise InfeasibleBudgetError(
                f"No forward plan of {graph.model} fits {format_bytes(budget)}: the "
                f"smallest feasible budget is {format_bytes(max(device))} (untiled "
                f"{format_bytes(unplanned)}). Raise the budget"
                + (", or predict on a device with host memory to spill to."
                   if not host_separate else "."),
                smallest_feasible_bytes=max(device), unplanned_peak_bytes=unplanned)
        device, host_peak = model.peaks(tiles, host)
    # NOTE rule 4: each tile grows back to the largest that fits
    for k, step in enumerate(steps):
        if step.whole:
            continue
        size = tuple(graph[step.root].size or ())
        ladder = [size]
        while (t := _shrink(ladder[-1])) is not None:
            ladder.append(t)
        for candidate in ladder:
            if candidate == tiles[k] or candidate in ladder[ladder.index(tiles[k]):]:
                break
            trial = {**tiles, k: candidate}
            if max(model.peaks(trial, host)[0]) <= budget:
                tiles[k] = candidate
                break
    device, host_peak = model.peaks(tiles, host)
    for k, step in enumerate(steps):
        step.tile = None if step.whole else tiles[k]
    return ForwardPlan(steps, sorted(host), max(device), host_peak, budget, unplanned,
                       any(step.tiled(graph) for step in steps))

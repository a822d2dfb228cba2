"""Tiled regions of a partitioned training graph: which ops run tile by tile, in which pass,
and what region of each a tile needs. Pure Python, no torch.

NOTE [ Tiled regions of a graph ]
  1. Every value of the graph (an op's output; a multi-output op's picks are values of
     their own) is one of: ``local`` (a spatial tensor each of whose voxels reads a
     window of its spatial inputs: a convolution, its transpose, a convolution's input
     gradient, pointwise ops, views and channel concatenations), ``reduce`` (a small
     tensor summed over every voxel of one spatial input, its ``sums``: a convolution's
     weight gradient, a normalisation's statistics, a normalisation backward's sums),
     ``pick`` (a small output of a ``reduce``), ``shell`` (a multi-output op whose
     outputs are all computed by its picks) or ``outside`` (anything else: it runs on
     whole tensors, as the untiled graph runs it).
  2. A *region* is a set of ``local``, ``reduce``, ``pick`` and ``shell`` values run as
     one unit:
     convex (no path leaves it and comes back), so it runs as one unit of a topological
     order of the graph. Values
     the region reads and does not make are its *inputs*, whole; members read outside it
     are its *outputs*: spatial ones made whole, written over each tile's owned part.
  3. A region runs in *passes*. A ``reduce`` is complete at the end of the pass its
     spatial inputs are made in (its *gather* pass) and can be read from the next one:
     ``ready(v)`` is the first pass ``v`` can be read in (0 for inputs), a ``local`` is
     made in the latest ``ready`` of what it reads, a ``reduce`` gathers in that pass and
     is ready one later. A normalisation is so a reduce (its statistics) read by a local
     (its output); a normalisation's backward a reduce (its sums) read by a local (the
     input gradient).
  4. In a pass, each tile of the region's finest grid owns a part of every grid
     (``halo.owned_region``: the owned parts of all tiles partition each grid), and the
     pass's targets (its reduces' ``sums`` and the spatial outputs made in it) are
     computed over exactly their owned parts: a sum sees every voxel once. What a target
     needs of each member is found backward through the members' window relations
     (bounding boxes): members made in earlier passes and not made whole are computed
     again per tile, with their halos.
  5. Tiles differ only where their halos meet the volume's faces: along each axis the
     first tile, the last, and every one between alike (the one after the first stands
     for them): ``tile_classes`` gives one of each kind and how many are of its kind, so
     a measurement on fake tensors runs one tile and books every tile's work
     (``runtime/tiled_graph.py`` NOTE rule 5).
  6. A member a later pass reads is computed again per tile there, with its halo, unless
     it is *stashed*: made whole (tile by tile, over owned parts) in the pass that makes
     it and read whole after. A stash trades its bytes for the work of recomputing it.
  7. A member a later region reads is made whole by its own region, unless it is
     *copied*: the later region computes it again tile by tile from what the earlier one
     read (its chain of local members back to the earlier region's inputs and reduces,
     whose small results it reads), trading its bytes for the work.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from remat3d.halo import Region, SpatialOp, input_region, owned_region, tile_grid, union

__all__ = ["TileValue", "TiledRegion", "needed", "regions_of"]

MEMBER_KINDS = ("local", "reduce", "pick", "shell")


@dataclass
class TileValue:
    """One value of the graph as tiling sees it (NOTE rule 1)."""

    name: str
    kind: str  # "local" | "reduce" | "pick" | "shell" | "outside"
    inputs: list[str] = field(default_factory=list)  # every value it reads
    size: tuple[int, ...] | None = None  # its grid (D, H, W) when it is spatial
    # spatial input -> the window relation (``halo.SpatialOp``: kind, kernel, stride,
    # padding, dilation) from this value's region (a reduce: its ``sums``'s owned region)
    relations: dict[str, SpatialOp] = field(default_factory=dict)
    sums: str | None = None  # a reduce: the spatial input it sums over
    joins: str | None = None  # a copy made for a later region: the member it is made for


@dataclass
class TiledRegion:
    """A region (NOTE rule 2) and its passes (rule 3)."""

    members: list[str]  # in graph order
    inputs: list[str]
    outputs: list[str]
    ready: dict[str, int]  # member -> the first pass it can be read in
    made: dict[str, int]  # member -> the pass it is made (a reduce: gathered) in
    grid: tuple[int, ...]  # the finest grid: tiles are drawn on it

    kinds: dict[str, str] = field(default_factory=dict)  # member -> its kind
    # members made whole in the pass that makes them and read whole after it (NOTE rule
    # 6), besides the outputs
    stashes: list[str] = field(default_factory=list)

    @property
    def made_whole(self) -> list[str]:
        """The spatial members made whole: outputs read after the region, and stashes."""
        return [m for m in self.members if self.kinds.get(m) == "local" and
                (m in self.outputs or m in self.stashes)]

    def stashable(self, values: dict[str, TileValue], which: str = "all") -> list[str]:
        """The local members a later pass reads (a reduce gathering later, a local made
        later), which may be made whole once instead of computed again per tile (NOTE
        rule 6): ``"all"`` of them, or only the ``"sums"`` of this region's reduces."""
        later = set()
        for m in self.members:
            for i in values[m].relations:
                if i in self.made and self.kinds.get(i) == "local" and \
                        self.made[m] > self.made[i]:
                    later.add(i)
        if which == "sums":
            later &= {values[m].sums for m in self.members if values[m].kind == "reduce"}
        elif which == "inputs":
            later &= {i for m in self.members if values[m].kind == "reduce"
                      for i in values[m].relations}
        return [m for m in self.members if m in later and m not in self.outputs]

    @property
    def passes(self) -> int:
        """The passes that compute something (a pick is complete with its reduce)."""
        return 1 + max((p for m, p in self.made.items()
                        if self.kinds.get(m) in ("local", "reduce")), default=0)

    def tiles(self, tile: tuple[int, ...]) -> list[Region]:
        return tile_grid(self.grid, tile)

    def tile_classes(self, tile: tuple[int, ...]) -> list[tuple[Region, int]]:
        """One tile of each kind (NOTE rule 5) and how many tiles are of its kind."""
        axes = []
        for n, t in zip(self.grid, tile):
            count = -(-n // t)
            starts = [(0, 1)] + ([(t, count - 2)] if count > 2 else []) + \
                ([((count - 1) * t, 1)] if count > 1 else [])
            axes.append([((s, min(s + t, n)), k) for s, k in starts])
        classes: list[tuple[Region, int]] = [((), 1)]
        for options in axes:
            classes = [(r + (iv,), w * k) for r, w in classes for iv, k in options]
        return classes


def _convex_groups(values: list[TileValue], members: set[str]) -> dict[str, int]:
    """Number each member by how many times a path to it left the members and came back
    (NOTE rule 2): the members with one number form a convex region."""
    group: dict[str, int] = {}
    depends: dict[str, int] = {}  # an outside value: the highest group it reads
    for v in values:
        if v.name in members:
            group[v.name] = max([1] + [group[i] if i in members else depends.get(i, 0) + 1
                                       for i in v.inputs])
        else:
            depends[v.name] = max([0] + [group[i] if i in members else depends.get(i, 0)
                                         for i in v.inputs])
    for v in values:  # a copy runs in the region of the member it is made for (rule 7)
        if v.joins is not None and v.name in group:
            group[v.name] = group[v.joins]
    return group


def _ready(values: dict[str, TileValue], members: list[str]
           ) -> tuple[dict[str, int], dict[str, int]]:
    ready: dict[str, int] = {}
    made: dict[str, int] = {}
    for name in members:
        v = values[name]
        if v.kind == "pick":  # complete with its reduce, at the end of its gather pass
            made[name], ready[name] = made[v.inputs[0]], ready[v.inputs[0]]
            continue
        at = max([ready.get(i, 0) for i in v.inputs], default=0)
        made[name] = at
        ready[name] = at + 1 if v.kind == "reduce" else at
    return ready, made


def regions_of(values: list[TileValue], read_outside: Iterable[str]) -> list[TiledRegion]:
    """The convex regions of the members of ``values`` (graph order), with their
    passes; ``read_outside`` are values the graph returns."""
    by_name = {v.name: v for v in values}
    members = {v.name for v in values if v.kind in MEMBER_KINDS}
    group = _convex_groups(values, members)
    returned = set(read_outside)
    readers: dict[str, list[str]] = {}
    for v in values:
        for i in v.inputs:
            readers.setdefault(i, []).append(v.name)
    out = []
    for g in sorted(set(group.values())):
        names = [v.name for v in values if group.get(v.name) == g]
        inside = set(names)
        if not any(by_name[n].kind == "local" for n in names):
            continue  # nothing spatial: left to the graph
        inputs = list(dict.fromkeys(i for n in names for i in by_name[n].inputs
                                    if i not in inside))
        outputs = [n for n in names if n in returned or
                   any(r not in inside for r in readers.get(n, []))]
        ready, made = _ready(by_name, names)
        sizes = [by_name[n].size for n in names if by_name[n].size is not None]
        grid = max(sizes, key=lambda s: s[0] * s[1] * s[2])
        out.append(TiledRegion(names, inputs, outputs, ready, made, grid,
                               {n: by_name[n].kind for n in names}))
    return out


def needed(region: TiledRegion, values: dict[str, TileValue], step: int, tile: Region,
           whole: set[str]) -> dict[str, Region]:
    """What pass ``step``'s targets need of each spatial value for ``tile`` (NOTE rule 4):
    the region of every member to compute and of every whole tensor to read (``whole``:
    inputs and members made whole in an earlier pass). Reduce members get their
    ``sums``'s owned part under their own name."""
    want: dict[str, Region] = {}

    def need(name: str, r: Region) -> None:
        if all(hi > lo for lo, hi in r):
            want[name] = union(want.get(name), r)

    inside = set(region.members)
    for name in region.members:
        v = values[name]
        if region.made[name] != step:
            continue
        if v.kind == "reduce":
            sums = values[v.sums] if v.sums else None
            if sums is not None and sums.size is not None:
                want[name] = owned_region(tile, region.grid, sums.size)
        elif v.kind == "local" and name in region.made_whole:
            assert v.size is not None
            need(name, owned_region(tile, region.grid, v.size))
    for name in reversed(region.members):
        v = values[name]
        if name not in want or (name in whole and v.kind == "local"):
            continue
        r = want[name]
        for i, rel in v.relations.items():
            size = values[i].size
            assert size is not None
            if i in inside or i in whole:
                need(i, input_region(rel, r, size))
    return want

"""Tiling layouts: which stages run tiled, with which tile, and which are fused.

Pure Python over the :class:`~remat3d.graph.CostGraph` and the :class:`StageModel` (no
torch). Used by ``optimal`` when no plan of keep / recompute / selective / offload decisions
fits the budget: recomputation cannot go below the working set of one full-resolution
layer, and tiling can (docs/tiling.md).

NOTE [ Tiling layouts ]
  1. A stage's *level* is how many times its largest spatial tensor (input or output) has
     been halved per axis relative to the largest tensor of the step: the full-resolution
     stages are level 0, the half-resolution ones level 1.
  2. A layout tiles every tileable stage of level < ``depth``. The output tile of a stage
     is the full-resolution tile scaled to the stage's output (a stage whose output is at
     half resolution gets half the edge), so the runs of one layout cut the volume alike.
  3. ``fuse`` (NOTE [ Fused tiled regions ]): ``"none"`` stores every tiled output;
     ``"chain"`` fuses a tiled stage whose output has exactly one reader, itself tiled and
     without normalisations (a decoder stage and its 1x1 head become one run: no
     full-resolution output and no gradient of it, and no pass more: a stage fused into
     a reader with normalisations would run again in each of their passes; nnU-Net v2's
     half-resolution decoder stage fused into the top one cost 3.3x the step's FLOPs
     where storing its 2 GiB output costs 2.3x); ``"all"`` fuses every tiled stage
     whose readers are all tiled (a skip connection read by an encoder run and a decoder
     run is recomputed in both: the least device memory without host memory, the most
     FLOPs). Only when offload is
     allowed: ``"host"`` keeps the output of every tiled stage whose readers are all
     tiled in host memory (NOTE [ Host-resident tiled outputs ]: the output and its
     gradient leave the device, nothing is recomputed, the price is copies);
     ``"chain+host"`` fuses as ``"chain"`` does and keeps the other such outputs there.
     ``"rebuild"`` stores the output of every tiled stage whose readers are all tiled
     only until its readers' forwards are done, and each reader's backward runs the
     stage's forward again (NOTE [ Rebuilt tiled outputs ]: a U-Net's skips are then
     absent through the decoder's backward, where the readers' backwards are far apart,
     for a forward per reader), except an output whose stage reads an output rebuilt at a
     higher resolution (each of its rebuilds would rebuild that one again: ResEnc-L's
     level-1 residual blocks, each a stage, chained to the full-resolution skip; its
     layouts with two levels took 24 s to verify at 5.4x the FLOPs before this rule);
     ``"chain+rebuild"`` fuses as ``"chain"`` does and rebuilds the other such outputs.
     Each tiled run that reads a rebuilt output computes it in tiles in its backward
     (rule 12), so a stage that ``"chain"`` fuses into its one reader costs that reader's
     backward the same whether rebuilt or fused, and fused it is never whole, nor is its
     gradient: ``"rebuild"`` is a layout only where ``"chain+rebuild"`` fuses nothing
     more (rule 5).
  4. Stages that are not tiled are recomputed (regions that keep only their inputs); the
     planner then verifies each layout on the meta device, cheapest expected first, and
     prunes the first that fits: each recomputed stage, costliest first, is kept (else
     recomputed keeping its convolution outputs) while the verified peak still fits
     (``planner/tiled_plans.py``, ``prune_tiled``). So a tiled plan mixes tile /
     recompute / keep.
  5. Expected cost order (cheapest first): level by level (fewer levels first), ``none``,
     ``host``, ``chain``, ``chain+host``; then ``rebuild``, ``chain+rebuild`` level by
     level (a rebuild costs a forward per reader: at 26-40 GiB nnU-Net v2's layouts
     without it, repaired or in the fine sweep, cost less); then ``all`` level by level;
     within each, larger tiles first; the fine sweep (below) after the coarse one, in
     each of the three parts.
     A ``"rebuild"`` layout that ``"chain+rebuild"`` differs from is not made (rule 3;
     at 512³ its verification took 10-20 s of nnU-Net v2's and ResEnc-L's searches and
     never fitted where the other did not).
     Full fusion comes last because it recomputes a stage with normalisations in every
     reader's run (each normalisation costs a pass over the run: nnU-Net at 512³, ``all``
     at one level costs 3.5x the FLOPs, two levels of ``none`` 2.5x); ``host`` copies
     instead of recomputing, ``chain`` fuses into a single reader (the cheapest fusion: a
     decoder stage into a 1x1 head adds nothing). Each normalisation inside a run costs
     extra passes over the run and fusion puts more normalisations in a run; smaller
     tiles add halo overlap. The order is a
     heuristic; the memory of each layout is measured, never guessed. The default tiles
     are a half and a quarter of the volume's shortest edge; after the layouts without
     full fusion with them, the same layouts with an eighth (the *fine* sweep, its
     repairs after the coarse ones'), and likewise for full fusion: where whole tensors
     dominate the peak a smaller tile lowers it little and costs more halo, so it is for
     the budgets the larger tiles cannot reach (ResEnc-L at 512³ bf16 without host
     memory: 8.41 GiB with 64³ tiles against 13.67 GiB at best with 128³); but a full
     fusion costs more than halos (nnU-Net v2 at 512³ bf16, 26 GiB without host memory:
     the skip stored, 64³ tiles, 2.3x the FLOPs; fused at 128³, 3.5x).
  6. Verifying a layout runs every tile of it on the meta device (tens of seconds at 64
     tiles), so layouts are passed over by dominance: a layout that keeps on the device
     every output another layout of the same stages and tiles keeps there, where that
     one keeps some in host memory instead, is taken to need at least its peak (a
     host-resident output leaves only its readers' slices on the device). Before a
     layout is verified, the one of its stages and tiles that keeps the most in host
     memory is, once; when it does not fit, the layouts it dominates are passed over
     unmeasured (``planner/tiled_plans.py``, ``first_fitting_layout``). So are larger
     tiles: the same stages with the same outputs in a larger tile hold the same whole
     tensors (inputs, outputs, their gradients, statistics, stashes) and a larger working
     set per tile, so the layout with the smallest tiles and the most in host memory is
     verified first, and when it does not fit, the larger tiles are passed over (at 512³
     with 24 GiB every half-edge layout is far above the budget: ResEnc-L's five of
     them, 9 s of its search). Across sweeps too, but the fine sweep's full fusion is not
     measured first (an eighth of the edge in runs with four or five normalisations
     takes up to a minute to measure at 512³); one measured already passes over the
     coarse ones all the same (the most frugal layouts are measured first when none
     fits, below: ResEnc-L at 512³ bf16, 1 GiB, 120 s -> 90 s, the same smallest). A
     coarse layout passed over for a fine one's miss is repaired (rule 7)
     from that miss's peak, in its own group. Fusion is not ordered so: a fused output is
     recomputed inside its readers' tiles, which then hold more at a time, and at small
     volumes that peak is the higher one. The plan chosen is always one that was
     measured. When none fits, the smallest peak the error names is sought in the
     reverse order (``smallest_only``): the most frugal layouts first, each repaired at
     once, so the first measured whole sets a low bar and the rest are measured only
     until they pass it (at 512³ bf16 and 1 GiB, with the shared bar of ``planning.py``
     NOTE rule 2: resenc-l 204 s -> 115 s, nnunetv2 82 s -> 45 s, the same smallest).
  7. Repair: a layout verified above the budget with its peak inside a stage it does not
     tile (the verifier names the module running at the peak) is tried again with that
     stage tiled too, by rules 2 and 3 (``extend_layout``): a level-0 layout whose peak
     moved into one half-resolution decoder stage needs that stage tiled, not every
     level-1 stage. Repairs are verified after the layouts of their group (rule 5's
     levels, fused or not) and before the next group's; a repaired layout that misses
     again is repaired again while its peak falls, at most three stages added. A layout
     measured only until it passed the budget names the module it passed it in; where
     that lay outside every stage (a parent's own ops, the loss), it is measured whole
     once to find its peak's stage (nnU-Net v2 at 512³ bf16 with offload, 3.29 GiB: its
     64³ layout passed the budget in the decoder's own ops, its peak lay in a decoder
     stage, and that stage tiled too fits, 3.28 GiB, in 19 s instead of 60).
  8. Storing what fits: a layout fuses or hosts its outputs all alike and the first that
     fits is taken, so it may leave room under the budget. Before the pruning of rule 4,
     each fused output is stored on the device instead where the verified peak still
     fits and the extra FLOPs fall, the largest expected saving first
     (``storing_saves``: a fused stage is recomputed with every pass of each reader's
     run; one fused into a single reader without normalisations, a 1x1 head, saves
     nothing by being stored and is left fused); then each host-resident output is
     stored on the device where it fits (no copies, the same FLOPs)
     (``planner/tiled_plans.py``, ``store_tiled_outputs``), and so is each rebuilt
     output (no rebuilds: fewer FLOPs; the costliest stage first). nnU-Net v2 at 512³
     bf16, 24 GiB, no offload: before rebuilt outputs, the ``fuse all`` layout at 16.00
     GiB and 5.0x the FLOPs became its decoder's two top stages stored; now ``chain+
     rebuild`` at an eighth of the edge (23.20 GiB, 3.5x) keeps its half-resolution
     decoder stage's output stored and both encoder skips rebuilt.
     A fused output stored is whole on the device from its forward until its last
     reader's backward, and so is its gradient from its first reader's backward until its
     own: where the verified peak was reached in backward between the two, outside the
     runs that read or compute it, and the fused run computing it read nothing but the
     model's input (nothing else whose gradient storing defers instead,
     ``stage_producers``), a trial needs room for both (ResEnc-L at 512³ bf16, 12 GiB: a
     2 GiB encoder skip stored failed at 12.41 GiB over an 8.41 GiB peak, three such
     trials 8 s of the search).
  9. Then each tiled stage whose output is stored on the device is run whole instead
     (recomputed, like the layout's untiled stages) where the verified peak still fits
     and the extra FLOPs fall, the most normalisation passes saved first (a tiled stage
     with k normalisations runs k + 1 passes forward and k + 1 recomputations backward;
     NOTE [ Tiled backward ]), none saving under 1 % of the step's FLOPs; a trial is
     verified only when the stage's recomputation working set by the stage model fits
     the room the budget leaves above what its tiled run held in backward
     (``untile_where_room``). A stage reading a fused or host-resident
     output stays tiled: run whole it would make that output whole on the device. The
     layouts tile every stage of a level alike (rule 2); this keeps tiled only the ones
     the budget needs.
  10. Stashes (NOTE [ Stashed passes ] in ``runtime/tiling/tiled.py``): a tiled run with
     normalisations may keep their inputs whole while its passes run, so that each pass
     starts from the last normalisation's input instead of recomputing from the run's
     inputs (nnU-Net's two-convolution stage: 2 convolutions forward instead of 5). With
     offload allowed, every layout's runs with normalisations stash in host memory (the
     device holds only the tiles' slices, as it does for host-resident outputs); without,
     after rule 9, each run stashes on the device where the verified peak still fits and
     the extra FLOPs fall, the most passes saved first, a trial verified only when its
     normalisation inputs fit the room the budget leaves above what that run held while
     its passes ran (``Plan.verified_tiled_peaks``: the largest above its forward
     passes, all but it above its backward's sums passes; the step's peak may lie
     elsewhere, in a pass that holds no stash) (``stash_where_room``). Where they do not
     all fit, one normalisation's input alone (``Region.stash_norms``), the one that saves
     the most by the stage model (its passes after it start there; of two tried at most)
     and fits: the last one's is whole in forward only. Then a run that took one takes a
     second beside it where both fit (one trial: the best by the same measure; both
     are whole in forward, the earlier in the sums passes too unless the later is the
     run's last). nnU-Net v2 at 512³ bf16, 24 GiB with offload: 2.39x the unplanned
     FLOPs without stashes, 1.82x with; without offload, the top decoder run (the skip
     and the decoder stage fused into the head, four 8 GiB normalisation inputs)
     stashing its third alone: 3.62x -> 2.99x; the encoder's half-resolution run a second
     one: 2.95x. With rebuilt skips (rule 3) every run with normalisations stashes, the
     top run its first normalisation's input alone: 2.50x at 23.84 GiB.
  11. Handed inputs: a rebuilt run that reads rebuilt outputs (the encoder's
     half-resolution stage reads the full-resolution skip) rebuilds them for each of its
     own readers' rebuilds and again for its own backward (NOTE [ Rebuilt tiled outputs
     ] rule 5). After rule 10, each such run hands what its last reader's rebuild made
     to its own backward (``Region.hand_inputs``, rule 6 there) where the verified peak
     still fits and the FLOPs fall, the costliest run first; one verified trial each.
     nnU-Net v2 at 512³ bf16, 24 GiB: 2.50x -> 2.42x at the same 23.84 GiB.
  12. Rebuilt inputs in tiles (NOTE [ Rebuilt tiled outputs ] rule 7): in a layout, every
     tiled run that reads a rebuilt output (itself or through a fused producer it
     computes) computes that output's parts in each of its tiles in its backward, never
     the whole of it (``Region.rebuild_in_tiles``): the least memory, the most FLOPs.
     After rule 10, each such run rebuilds whole instead where the verified peak still
     fits and the FLOPs fall, the most rebuilt FLOPs first, a trial verified only when
     the rebuilt outputs fit the room its backward left (``whole_rebuilds_where_room``).
     ResEnc-L at 512³ bf16, 24 GiB, no offload: the top decoder run's backward held the
     8 GiB skip rebuilt beside the skip's 8 GiB gradient; in tiles, 23.18 GiB at 2.54x
     the FLOPs (2.93x before, with the skip fused into both readers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from remat3d.decisions import TiledOutput
from remat3d.graph import CostGraph
from remat3d.planner.stages import StageModel

__all__ = ["FUSE_MODES", "MODEL_INPUT", "OUTPUTS", "Layout", "extend_layout", "layouts",
           "stage_at", "stage_levels", "stage_norms", "stage_producers", "stage_readers",
           "storing_saves"]

# rule 5's order in a level
FUSE_MODES = ("none", "host", "chain", "chain+host", "rebuild", "chain+rebuild", "all")
# where a tiled stage's output lives: stored on the device, fused into its readers, or
# stored in host memory
OUTPUTS = tuple(o.value for o in TiledOutput)


@dataclass(frozen=True)
class Layout:
    """One tiling layout: stage index -> (output tile edge per axis, where its output
    lives: one of :data:`OUTPUTS`)."""

    depth: int
    fuse: str
    tile: int  # full-resolution tile edge
    tiled: dict[int, tuple[tuple[int, int, int], str]] = field(default_factory=dict)
    added: tuple[str, ...] = ()  # stages tiled besides the levels' (rule 7), in order
    fine: bool = False  # of rule 5's second sweep, with the smallest tile

    @property
    def label(self) -> str:
        more = "".join(f" + {name}" for name in self.added)
        return f"tile {self.tile}, levels < {self.depth}{more}, fuse {self.fuse}"


def _volume(shape: list[int] | tuple[int, ...] | None) -> int:
    if not shape or len(shape) != 5:
        return 0
    return int(shape[2]) * int(shape[3]) * int(shape[4])


def _stage_members(graph: CostGraph, model: StageModel) -> dict[int, int]:
    """Graph node id -> stage index, for every node inside a stage."""
    out: dict[int, int] = {}
    for stage in model.stages:
        stack = [stage.node]
        while stack:
            k = stack.pop()
            out[k] = stage.index
            stack.extend(graph.nodes[k].children)
    return out


def stage_levels(graph: CostGraph, model: StageModel) -> list[int | None]:
    """NOTE rule 1: each stage's resolution level (None: no 5-D spatial tensor)."""
    member = _stage_members(graph, model)
    largest = [0] * len(model.stages)
    for stage in model.stages:
        largest[stage.index] = _volume(graph.nodes[stage.node].output_shape)
    for e in graph.edges:
        s = member.get(e.dst)
        if s is not None and member.get(e.src) != s:
            largest[s] = max(largest[s], _volume(e.shape))
    top = max(largest, default=0)
    if top == 0:
        return [None] * len(model.stages)
    return [None if v == 0 else round(math.log(top / v, 8)) for v in largest]


def stage_readers(graph: CostGraph, model: StageModel) -> list[set[int | None]]:
    """Per stage, the stages that read its outputs (None: glue or the loss)."""
    member = _stage_members(graph, model)
    readers: list[set[int | None]] = [set() for _ in model.stages]
    produced = [False] * len(model.stages)
    for e in graph.edges:
        s = member.get(e.src)
        if s is None or member.get(e.dst) == s:
            continue
        produced[s] = True
        readers[s].add(member.get(e.dst))
    for s, made in enumerate(produced):
        if not made:  # nothing reads it inside the step but the loss
            readers[s].add(None)
    return readers


MODEL_INPUT = -1  # a stage's producer: the model's input (the graph's edges' source -1)


def stage_producers(graph: CostGraph, model: StageModel) -> list[set[int | None]]:
    """Per stage, the stages whose outputs it reads (:data:`MODEL_INPUT`: the model's
    input; None: anything else, a parent's own ops)."""
    member = _stage_members(graph, model)
    producers: list[set[int | None]] = [set() for _ in model.stages]
    for e in graph.edges:
        s = member.get(e.dst)
        src = MODEL_INPUT if e.src == -1 else member.get(e.src)
        if s is not None and src != s:
            producers[s].add(src)
    return producers


def _edges(shape: list[int] | None) -> tuple[int, int, int] | None:
    if not shape or len(shape) != 5:
        return None
    return int(shape[2]), int(shape[3]), int(shape[4])


@dataclass(frozen=True)
class _Facts:
    """What layouts are made of: each stage's level, readers and output edges."""

    levels: list[int | None]
    readers: list[set[int | None]]
    full: list[tuple[int, int, int] | None]
    top_edges: tuple[int, int, int]
    norms: list[int]

    def tiled(self, chosen: list[int], fuse: str, t: int
              ) -> dict[int, tuple[tuple[int, int, int], str]]:
        """Rules 2 and 3: the chosen stages' tiles and where their outputs live."""
        tiled: dict[int, tuple[tuple[int, int, int], str]] = {}
        for s in chosen:
            edges = self.full[s]
            assert edges is not None
            size = tuple(max(1, min(e, round(t * e / top)))
                         for e, top in zip(edges, self.top_edges))
            rd = self.readers[s]
            inner = bool(rd) and None not in rd and all(r in chosen for r in rd)
            output = TiledOutput.DEVICE
            # rule 3: into its one reader, where that run gains no normalisation pass
            chain = fuse.startswith("chain") and len(rd) == 1 and all(
                r is not None and self.norms[r] == 0 for r in rd)
            if inner and (fuse == "all" or chain):
                output = TiledOutput.FUSED
            elif inner and fuse.endswith("host"):
                output = TiledOutput.HOST
            elif inner and fuse.endswith("rebuild") and not any(
                    s in self.readers[p] and out == TiledOutput.REBUILT
                    and (self.levels[p] or 0) < (self.levels[s] or 0)
                    for p, (_, out) in tiled.items()):
                # rule 3: not from an output rebuilt at a higher resolution (each of its
                # rebuilds would rebuild that one whole, or in tiles, again)
                output = TiledOutput.REBUILT
            tiled[s] = (size, output)  # type: ignore[assignment]
        return tiled


def _facts(graph: CostGraph, model: StageModel) -> _Facts | None:
    levels = stage_levels(graph, model)
    full = [_edges(graph.nodes[st.node].output_shape) for st in model.stages]
    top_edges = max((e for e, lv in zip(full, levels) if e and lv == 0),
                    key=lambda e: e[0] * e[1] * e[2], default=None)
    if top_edges is None:
        return None
    return _Facts(levels, stage_readers(graph, model), full, top_edges,
                  stage_norms(graph, model))


def layouts(graph: CostGraph, model: StageModel, tileable: list[bool],
            tiles: tuple[int, ...] | None = None, max_depth: int = 2,
            host: bool = False) -> list[Layout]:
    """Every layout to try, cheapest expected first (NOTE [ Tiling layouts ] rule 5).

    ``tileable[s]`` says whether stage ``s`` can run tiled (its ops are spatially local:
    checked on the torch side). ``tiles`` are full-resolution tile edges, one sweep; by
    default a half and a quarter of the largest volume's shortest edge, then a second
    sweep with an eighth (rule 5; each at least 16). ``host``: also the layouts that
    keep tiled outputs in host memory (rule 3).
    """
    facts = _facts(graph, model)
    if facts is None:
        return []
    sweeps: list[tuple[tuple[int, ...], bool]] = [(tuple(tiles or ()), False)]
    if tiles is None:
        shortest = min(facts.top_edges)
        coarse = tuple(sorted({t for t in (shortest // 2, shortest // 4) if t >= 16},
                              reverse=True))
        fine = tuple(t for t in (shortest // 8,) if t >= 16 and t not in coarse)
        sweeps = [(coarse, False), (fine, True)]
    out: list[Layout] = []
    seen: set[tuple] = set()
    # rule 5: level by level without full fusion or rebuilds, every sweep; then with
    # rebuilds; then full fusion
    partial = [(depth, fuse) for depth in range(1, max_depth + 1)
               for fuse in FUSE_MODES if fuse != "all" and "rebuild" not in fuse]
    rebuilt = [(depth, fuse) for depth in range(1, max_depth + 1)
               for fuse in FUSE_MODES if "rebuild" in fuse]
    full = [(depth, "all") for depth in range(1, max_depth + 1)]
    for (sizes, fine_), order in [(sweep, o) for o in (partial, rebuilt, full)
                                  for sweep in sweeps]:
        for depth, fuse in order:
            chosen = [s for s, lv in enumerate(facts.levels)
                      if lv is not None and lv < depth and tileable[s]
                      and facts.full[s] is not None]
            if not chosen or ("host" in fuse and not host):
                continue
            for t in sizes:
                tiled = facts.tiled(chosen, fuse, t)
                if fuse == "rebuild" and tiled != facts.tiled(chosen, "chain+rebuild", t):
                    continue  # rule 5: "chain+rebuild" is no costlier and holds less
                key = tuple(sorted(tiled.items()))
                if key in seen:  # e.g. "chain" equal to "none" on this graph
                    continue
                seen.add(key)
                out.append(Layout(depth=depth, fuse=fuse, tile=t, tiled=tiled,
                                  fine=fine_))
    return out


def stage_norms(graph: CostGraph, model: StageModel) -> list[int]:
    """Per stage, the normalisation modules it runs (each is a pass of a tiled run)."""
    count = [0] * len(model.stages)
    for k, s in _stage_members(graph, model).items():
        kind = graph.nodes[k].module_type
        count[s] += kind.endswith(("Norm1d", "Norm2d", "Norm3d")) or kind == "GroupNorm"
    return count


def storing_saves(graph: CostGraph, model: StageModel, tiled: set[int]) -> list[float]:
    """Rule 8: per stage, the forward FLOPs that storing its output would save, were it
    fused into its readers that are in ``tiled``. A tiled run makes one pass more than it
    has normalisations, each pass running the run's ops up to the normalisation it
    gathers; so a fused stage runs in each reader's run about ``1 + its norms + the
    reader's norms`` times, and in its own run ``1 + its norms`` times (0: no tiled
    reader, it is not fused). An estimate, for the order in which storing is tried:
    each trial is measured."""
    norms, readers = stage_norms(graph, model), stage_readers(graph, model)
    out = []
    for st in model.stages:
        inner = [r for r in readers[st.index] if r is not None and r in tiled]
        fused = sum(1 + norms[st.index] + norms[r] for r in inner)
        out.append(st.fwd_flops * (fused - (1 + norms[st.index])) if inner else 0.0)
    return out


def stage_at(graph: CostGraph, model: StageModel, module: str | None) -> int | None:
    """The stage whose invocations include module ``module`` (a verified peak's), if any."""
    if module is None:
        return None
    member = _stage_members(graph, model)
    for k, node in enumerate(graph.nodes):
        if node.name == module and k in member:
            return member[k]
    return None


def extend_layout(graph: CostGraph, model: StageModel, tileable: list[bool],
                  layout: Layout, peak_module: str | None) -> Layout | None:
    """Rule 7: ``layout`` with the stage that held its verified peak tiled too (the same
    tile, fusion mode and rules), or None when that stage is tiled already, cannot be
    tiled, or the peak was outside every stage."""
    s = stage_at(graph, model, peak_module)
    facts = _facts(graph, model)
    if s is None or facts is None or s in layout.tiled or not tileable[s] \
            or facts.full[s] is None:
        return None
    chosen = sorted({*layout.tiled, s})
    return Layout(depth=layout.depth, fuse=layout.fuse, tile=layout.tile,
                  tiled=facts.tiled(chosen, layout.fuse, layout.tile),
                  added=(*layout.added, model.stages[s].name), fine=layout.fine)

"""The tiled half of the search: tiling layouts as plan regions, the first that fits, pruned.

Used by the search (``searching.py``) when no plan of keep / recompute / selective / offload
decisions fits the budget; the layouts come from ``tiling.py`` (NOTE [ Tiling layouts ]).
Pure: candidates are measured through the ``check`` the search passes in.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

from remat3d.decisions import SELECTIVE_POLICY, Decision, TiledOutput
from remat3d.errors import TilingError
from remat3d.planner.measured import Limits
from remat3d.planner.registry import PlannerOptions
from remat3d.planner.stages import KEEP, RECOMPUTE, SELECTIVE, Stage, StageModel
from remat3d.planner.tiling import MODEL_INPUT, Layout
from remat3d.planspec import Plan, Region
from remat3d.units import format_bytes

__all__ = [
    "at_least_as_frugal",
    "beating",
    "extra_cost",
    "first_fitting_layout",
    "greedy_prune",
    "hand_rebuilt_inputs",
    "layout_regions",
    "prune_tiled",
    "staged_regions",
    "stash_where_room",
    "store_tiled_outputs",
    "untile_where_room",
    "whole_rebuilds_where_room",
]

log = logging.getLogger(__name__)


class Check(Protocol):
    """The search's check: a candidate with its verified numbers filled in, measured only
    until it passes one of the limits ``within`` where given (``_Search.check``)."""

    def __call__(self, candidate: Plan, within: Limits | None = None) -> Plan: ...


T = TypeVar("T")


def extra_cost(p: Plan) -> int:
    """Extra FLOPs of a verified plan (tiled plans: halos and passes too)."""
    return p.extra_flops if p.extra_flops is not None else (p.recompute_flops or 0)


def beating(current: Plan, budget: int) -> Limits:
    """Where a trial to replace ``current`` may stop being measured (NOTE [ Bounded
    measurements ] in ``instrument/tracker.py``): once its peak passes ``budget`` or its
    FLOPs pass ``current``'s, every trial's test here (and the search's) rejects it."""
    total = None if current.step_flops is None else current.step_flops + extra_cost(current)
    return Limits(budget, total)


def layout_regions(stages: StageModel, layout: Layout,
                   recomputable: list[bool] | None = None,
                   stash: str | None = None,
                   readers: list[set[int | None]] | None = None) -> list[Region]:
    """A tiling layout as plan regions: its stages tiled (and fused), every other stage
    recomputed where it may be (NOTE [ Tiling layouts ] rule 4); ``stash``: where each
    tiled run (every tiled stage but the fused ones, which run in their readers' runs)
    keeps its normalisations' inputs (rule 10; a run without any keeps nothing);
    ``readers`` (per stage, ``tiling.stage_readers``): each run that reads a rebuilt
    output computes it in tiles in its backward (rule 12)."""
    ok = recomputable or [True] * len(stages.stages)
    in_tiles = _reading_rebuilt(layout, readers) if readers is not None else set()
    regions = []
    for st in stages.stages:
        if st.index in layout.tiled:
            size, output = layout.tiled[st.index]
            regions.append(Region(st.name, calls=[st.call_index], decision=Decision.TILE,
                                  tile=list(size), fuse=output == TiledOutput.FUSED,
                                  host=output == TiledOutput.HOST,
                                  rebuild=output == TiledOutput.REBUILT,
                                  stash=None if output == TiledOutput.FUSED else stash,
                                  rebuild_in_tiles=st.index in in_tiles))
        elif ok[st.index]:
            regions.append(Region(st.name, calls=[st.call_index]))
    return regions


def _fused(plan: Plan, stages: StageModel) -> set[int]:
    """The stages ``plan`` fuses into their readers' tiled runs."""
    return {st.index for r, st in staged_regions(plan, stages)
            if r.decision == Decision.TILE and r.fuse}


def _fused_chain(p: int, fused: set[int], readers: list[set[int | None]]) -> set[int]:
    """Stage ``p`` and the ``fused`` stages its tiled run computes: those whose outputs
    it reads, and theirs in turn."""
    chain, todo = {p}, [p]
    while todo:
        reader = todo.pop()
        for q in fused - chain:
            if reader in readers[q]:
                chain.add(q)
                todo.append(q)
    return chain


def _reading_runs(p: int, readers: list[set[int | None]], fused: set[int]
                  ) -> tuple[set[int], set[int]] | None:
    """The stages that read stage ``p``'s output and are not ``fused`` (the runs that
    read it, themselves or through the fused stages they compute), and those fused
    stages; None where the loss or a parent's own ops read it."""
    runs: set[int] = set()
    through: set[int] = set()
    todo = [p]
    while todo:
        for s in readers[todo.pop()]:
            if s is None:
                return None
            if s in fused:
                through.add(s)
                todo.append(s)
            else:
                runs.add(s)
    return runs, through


def _runs_in_tiles(plan: Plan, stages: StageModel, p: int,
                   readers: list[set[int | None]] | None) -> list[Region] | None:
    """The tiled runs that read stage ``p``'s output (themselves or through fused
    producers they compute), where every one computes it in tiles (NOTE [ Tiling
    layouts ] rule 12); None where one does not, or something else reads it."""
    found = None if readers is None else _reading_runs(p, readers, _fused(plan, stages))
    if found is None:
        return None
    by_index = {st.index: r for r, st in staged_regions(plan, stages)}
    runs = [by_index.get(s) for s in sorted(found[0])]
    if not runs or any(r is None or r.decision != Decision.TILE for r in runs):
        return None  # glue or a stage run whole keeps it
    return runs if all(r.rebuild_in_tiles for r in runs) else None  # type: ignore[union-attr]


def _reading_rebuilt(layout: Layout, readers: list[set[int | None]]) -> set[int]:
    """The layout's tiled runs that read a rebuilt output, themselves or through the
    fused producers they compute (a fused stage's reader runs it)."""
    out: set[int] = set()
    todo = [p for p, (_, o) in layout.tiled.items() if o == TiledOutput.REBUILT]
    while todo:
        p = todo.pop()
        for r in readers[p]:
            if r is None or r not in layout.tiled or r in out:
                continue
            if layout.tiled[r][1] == TiledOutput.FUSED:
                todo.append(r)  # its readers' runs compute it, and read what it reads
            else:
                out.add(r)
    return out


def at_least_as_frugal(a: Layout, b: Layout, across_sweeps: bool = False) -> bool:
    """Whether ``a`` keeps no more on the device than ``b`` (NOTE [ Tiling layouts ] rule
    6): the same stages, each in a tile no larger than ``b``'s (the same whole tensors, a
    smaller working set per tile), each output where ``b`` has it or, where ``b`` stores
    it on the device, in host memory or rebuilt. (Not fused: a fused output is recomputed
    inside its readers' tiles, which hold more at a time; at small volumes that peak is
    the higher one.) With full fusion, of the same sweep unless ``across_sweeps``: what
    to measure first keeps the fine sweep's full fusion, up to a minute at 512³, for
    when the coarse one failed; a fine one measured already, for any reason, stands for
    the coarse one all the same."""
    if a.tiled.keys() != b.tiled.keys() or (
            not across_sweeps and a.fine != b.fine and "all" in (a.fuse, b.fuse)):
        return False
    for s, (size, out) in a.tiled.items():
        size_b, out_b = b.tiled[s]
        if any(x > y for x, y in zip(size, size_b)) or not (
                out == out_b or (out in (TiledOutput.HOST, TiledOutput.REBUILT)
                                 and out_b == TiledOutput.DEVICE)):
            return False
    return True


def _room(plan: Plan, budget: int, during: str | None = None,
          parts: tuple[str, ...] = ("sums", "final")) -> int:
    """The room ``budget`` leaves above ``plan``'s verified peak; ``during`` (a tiled
    region's label): above the most its run held while those ``parts`` of it ran
    (``verified_tiled_peaks``: what only that run holds, its working set or its stashes,
    is bounded by this room, not by the step's peak elsewhere)."""
    held = plan.verified_tiled_peaks.get(during, {}) if during is not None else {}
    peaks = [held[p] for p in parts if p in held]
    return budget - (max(peaks) if peaks else (plan.verified_peak_bytes or 0))


def _stored(layout: Layout) -> int:
    """How many of ``layout``'s tiled outputs stay on the device."""
    return sum(out == TiledOutput.DEVICE for _, out in layout.tiled.values())


def _key(layout: Layout) -> tuple:
    return tuple(sorted(layout.tiled.items()))


def _group(layout: Layout) -> tuple[bool, bool, bool, int]:
    """Rule 5's groups in their order: levels without full fusion or rebuilt outputs, the
    fine sweep's after the coarse one's; then with rebuilt outputs, likewise; then with
    full fusion, likewise."""
    return layout.fuse == "all", "rebuild" in layout.fuse, layout.fine, layout.depth


def first_fitting_layout(candidates: Iterable[Layout], stages: StageModel,
                         options: PlannerOptions, host_budget: int | None, budget: int,
                         fresh: Callable[[list[Region]], Plan], check: Check,
                         extend: Callable[[Layout, str | None], Layout | None] | None = None,
                         max_repairs: int = 3, stash: str | None = None,
                         readers: list[set[int | None]] | None = None,
                         smallest_only: bool = False, below: int = 1 << 62
                         ) -> tuple[Plan | None, int]:
    """The first tiling layout (cheapest expected first, NOTE [ Tiling layouts ]) whose
    verified peak fits ``budget`` (and whose host memory fits ``host_budget``), and the
    smallest verified peak among those measured whole that fit the host budget (1 << 62:
    none was).

    Each layout is measured only until its peak passes the budget (NOTE [ Bounded
    measurements ] in ``instrument/tracker.py``: at 512³ most layouts pass it in their
    forward, seconds before their step would end). ``smallest_only`` (the budget is known
    to be out of reach: what the error names is the point): each is measured until its
    peak passes the smallest measured whole so far (or ``below``, the smallest another
    search verified, where lower), so the smallest is that of every layout tried, found
    without measuring the larger ones to their end (1 << 62 where none went below
    ``below``).

    Each layout tiles its stages and recomputes every other stage (``prune_tiled`` then
    keeps what still fits); layouts whose verified peak exceeds the budget are passed
    over, and so is every layout that stores on the device all that one passed over
    stores there (rule 6): before a layout is verified, the one of its stages and tiles
    that keeps the most in host memory is, once. A layout whose peak lay in a stage it
    does not tile is repaired (rule 7): ``extend(layout, peak_module)`` is it with that
    stage tiled too, verified before the next group of layouts (up to ``max_repairs``
    stages added, while the peak goes down; a layout stopped at its limit names the
    module where it passed it, or, passed outside every stage, is measured whole to find
    its peak's; it counts as going down when it passed its limit later in the step: more
    FLOPs before it). ``fresh(regions)`` makes a plan with the
    search's header fields; ``stash`` and ``readers`` as ``layout_regions`` takes
    them."""
    ordered = list(candidates)
    smallest = 1 << 62
    measured: dict[tuple, Plan | None] = {}  # layout -> verified plan that fits, else None
    over: dict[tuple, Plan] = {}             # layout -> its verified plan above the budget
    failed: list[Layout] = []                # verified above the budget
    pending: list[Layout] = []               # of those, the ones to repair (rule 7)
    # of their plans, those stopped at a limit (by id; held, so no id is reused)
    stopped: dict[int, Plan] = {}

    def verify(layout: Layout, whole: bool = False) -> Plan | None:
        """``layout`` verified (``whole``: again, without a limit), None unless it fits."""
        key = _key(layout)
        if key in measured and not whole:
            return measured[key]
        nonlocal smallest
        candidate = fresh(layout_regions(stages, layout, options.recomputable, stash,
                                         readers))
        candidate.notes.append(f"tiling layout: {layout.label}")
        measured[key] = None
        bar = min(smallest, below)
        limit = None if whole else (None if bar == 1 << 62 else bar) if smallest_only \
            else budget
        try:
            check(candidate, None if limit is None else Limits(limit, None))
        except TilingError as exc:  # an op the probe did not see (shape-dependent code)
            log.info("tiling layout %s skipped: %s", layout.label, exc)
            return None
        peak = candidate.verified_peak_bytes or 0
        host = candidate.verified_host_bytes or 0
        if limit is not None and peak > limit:  # stopped there: a lower bound
            stopped[id(candidate)] = candidate
            log.info("tiling layout %s: passed %s in %s", layout.label, format_bytes(limit),
                     candidate.verified_peak_module or "-")
        else:
            log.info("tiling layout %s: verified peak %s (in %s), host %s, extra %.3g "
                     "FLOPs", layout.label, format_bytes(peak),
                     candidate.verified_peak_module or "-", format_bytes(host),
                     candidate.extra_flops or 0)
        if host_budget is not None and host > host_budget:
            return None
        if id(candidate) not in stopped:
            smallest = min(smallest, peak)
        if peak > budget:
            if key not in over:
                failed.append(layout)
            over[key] = candidate
            return None
        measured[key] = candidate
        return candidate

    def went_down(repaired: Plan, missed: Plan) -> bool:
        """Whether a repair (verified ``repaired``) lowered the peak of the layout it
        repaired (verified ``missed``): both measured whole, or the repair whole and the
        other stopped (at a limit no lower than the repair's); both stopped, whether the
        repair passed its limit later in the step."""
        if id(repaired) not in stopped:
            return id(missed) in stopped or \
                (repaired.verified_peak_bytes or 0) < (missed.verified_peak_bytes or 0)
        return id(missed) in stopped and extra_cost(repaired) > extra_cost(missed)

    def failure_over(layout: Layout) -> Layout | None:
        """The failed layout that passes ``layout`` over (rule 6), if any."""
        return next((f for f in failed if at_least_as_frugal(f, layout, across_sweeps=True)),
                    None)

    def passed_over(layout: Layout) -> bool:
        return failure_over(layout) is not None

    def repair(before: tuple[bool, bool, bool, int] | None) -> Plan | None:
        """Rule 7 for the pending layouts of groups before ``before`` (None: all)."""
        while pending and (before is None or _group(pending[0]) < before):
            parent = pending.pop(0)
            missed = over[_key(parent)]  # the parent's verified plan, above the budget
            for _ in range(max_repairs):
                assert extend is not None
                module = missed.verified_peak_module
                if not module and id(missed) in stopped:
                    # it passed its limit outside every stage: where its peak lies is
                    # what the repair needs, so it is measured whole once (``missed``
                    # stays the stopped measurement the repair is compared with)
                    chosen = verify(parent, whole=True)
                    if chosen is not None:
                        return chosen
                    module = over[_key(parent)].verified_peak_module \
                        if _key(parent) in over else None
                    over[_key(parent)] = missed
                child = extend(parent, module)
                if child is None or _key(child) in measured or passed_over(child):
                    break
                chosen = verify(child)
                if chosen is not None:
                    return chosen
                missed_again = over.get(_key(child))
                if missed_again is None or not went_down(missed_again, missed):
                    break
                parent, missed = child, missed_again
        return None

    def tried(layout: Layout) -> Plan | None:
        had = len(failed)
        chosen = verify(layout)
        if extend is not None:
            pending.extend(f for f in failed[had:] if not f.added)
            pending.sort(key=_group)  # (stable) repairs go by their group
        return chosen

    def most_frugal(layout: Layout, same_sweep: bool = False) -> Layout:
        """The layout of ``layout``'s stages with the smallest tiles and the most in host
        memory (it fits, or none it dominates does)."""
        j = min((j for j, other in enumerate(ordered) if at_least_as_frugal(other, layout)
                 and not (same_sweep and other.fine != layout.fine)),
                key=lambda j: (_stored(ordered[j]), ordered[j].tile, j))
        return ordered[j]

    def inherit(layout: Layout) -> None:
        """A layout passed over for a failure of the other sweep's tiles is repaired as
        the failure of its own sweep it stands for (rule 7, from that failure's peak)."""
        if extend is None or layout.added or _key(layout) in over:
            return
        failure = failure_over(layout)
        if failure is None or failure.fine == layout.fine or \
                most_frugal(layout, same_sweep=True) is not layout:
            return
        over[_key(layout)] = over[_key(failure)]
        pending.append(layout)
        pending.sort(key=_group)

    for layout in (reversed(ordered) if smallest_only else ordered):
        # smallest_only: the most frugal first, repaired at once, so the bar is low early
        repaired = repair(None if smallest_only else _group(layout))
        if repaired is not None:
            return repaired, smallest
        if passed_over(layout):
            inherit(layout)
            continue
        frugal = most_frugal(layout)
        if frugal is not layout:
            tried(frugal)
            if passed_over(layout):
                inherit(layout)
                continue
        chosen = tried(layout)
        if chosen is not None:
            return chosen, smallest
    return repair(None), smallest


def _gradient_at_peak(plan: Plan, stages: StageModel, p: int,
                      readers: list[set[int | None]] | None,
                      producers: list[set[int | None]] | None,
                      stage_of: Callable[[str | None], int | None] | None) -> int:
    """The bytes of fused stage ``p``'s output's gradient, whole at ``plan``'s verified
    peak once that output is stored (NOTE [ Tiling layouts ] rule 8), else 0: the peak
    was reached in backward at a stage after ``p`` and before the last run reading it
    (its gradient, whole from that run's backward until ``p``'s), outside those runs and
    the fused stages they compute, and the fused stages computing ``p`` read nothing but
    the model's input (a whole input's gradient would be deferred instead). ``stage_of``:
    the stage running a module (``tiling.stage_at``)."""
    if readers is None or producers is None or stage_of is None or \
            plan.verified_peak_phase != "backward":
        return 0
    s = stage_of(plan.verified_peak_module)
    fused = _fused(plan, stages)
    chain = _fused_chain(p, fused, readers)  # p and the fused stages its runs compute
    if any(q not in chain and q != MODEL_INPUT for c in chain for q in producers[c]):
        return 0
    found = _reading_runs(p, readers, fused)
    if found is None:
        return 0  # the loss or a parent's ops read it: its gradient's span unknown
    runs, through = found  # the fused readers are computed inside those runs too
    if s is None or not runs or not p < s < max(runs) or s in runs or s in chain \
            or s in through:
        return 0
    return stages.stages[p].output_bytes


def store_tiled_outputs(best: Plan, budget: int, stages: StageModel, check: Check,
                        saves: list[float],
                        readers: list[set[int | None]] | None = None,
                        producers: list[set[int | None]] | None = None,
                        stage_of: Callable[[str | None], int | None] | None = None) -> Plan:
    """A tiled plan's fused, rebuilt and host-resident outputs stored on the device where
    the verified peak still fits (NOTE [ Tiling layouts ] rule 8), the largest expected
    saving first.

    A layout fuses or hosts its tiled outputs all alike (rule 3), and the first layout
    that fits is taken, so it may leave room: nnU-Net v2 at 512³ bf16 with a 24 GiB budget
    verified 16 GiB with every full-resolution output fused, each recomputed, with its
    normalisation passes, inside every reader's tiles. A fused output stored instead is
    computed once; a host output stored on the device is not copied to the host and back.
    Fused outputs are tried by ``saves`` (per stage index, ``tiling.storing_saves``),
    largest first, those expected to save nothing not at all, and stored where that
    lowers the extra FLOPs; then rebuilt outputs (the costliest run first: storing saves
    its forward again), likewise; then host outputs, stored where the FLOPs do not grow. A
    trial is verified only when the output (stored, a whole tensor on the device) fits
    the room the budget has left above the verified peak, by the stage model's bytes
    (a rebuilt output that a reader rebuilds whole is whole in that reader's backward
    already: measured; one that every reader computes in tiles, rule 12, is never whole
    after its forward: checked; ``readers`` per stage, ``tiling.stage_readers``). A fused
    output's gradient is counted too where it would be whole at the verified peak
    (``_gradient_at_peak``; ``producers`` per stage, ``tiling.stage_producers``, and
    ``stage_of``, ``tiling.stage_at``).
    """
    steps = [(r, st) for r, st in staged_regions(best, stages)
             if r.decision == Decision.TILE and (r.fuse or r.host or r.rebuild)
             and (r.host or r.rebuild or saves[st.index] > 0)]
    # fused first, the largest saving first; then rebuilt outputs, the costliest run
    # first; then host outputs, the largest first
    steps.sort(key=lambda pair: (pair[0].host, pair[0].rebuild, -saves[pair[1].index],
                                 -pair[1].fwd_flops, -pair[1].output_bytes, pair[1].index))

    def trials(step: tuple[Region, Stage], current: Plan) -> Iterator[Plan]:
        region, st = step
        # the output, whole from its forward to its readers' backward (its gradient, whole
        # too, need not be alive at the peak: ResEnc-L at 512³, 24 GiB, stores a 2 GiB
        # output for 0.95 GiB more); a rebuilt output is whole in its readers' backwards
        # already, so what storing it adds is not bounded by its bytes: measured; one its
        # readers compute in tiles is never whole there: stored, it is whole until their
        # backwards end, and is checked against the room above what they held
        runs = _runs_in_tiles(current, stages, st.index, readers) if region.rebuild else None
        if region.rebuild and runs is None:
            added, room = 0, 0
        else:
            added = st.output_bytes
            if region.fuse:
                added += _gradient_at_peak(current, stages, st.index, readers, producers,
                                           stage_of)
            room = min((_room(current, budget, r.label) for r in runs or ()),
                       default=budget - (current.verified_peak_bytes or 0))
        if added > room:
            log.info("%s: its output%s (%s) does not fit the room left; not stored",
                     region.label, " and its gradient" if added > st.output_bytes else "",
                     format_bytes(added))
            return
        log.info("trying %s with its output stored on the device", region.label)
        yield check(_replaced(current, region, fuse=False, host=False, rebuild=False,
                              hand_inputs=False), beating(current, budget))

    def cheaper(candidate: Plan, current: Plan) -> bool:
        if (candidate.verified_peak_bytes or 0) > budget:
            return False
        stored = sum(r.fuse or r.rebuild for r in candidate.regions) < \
            sum(r.fuse or r.rebuild for r in current.regions)
        return extra_cost(candidate) < extra_cost(current) if stored else \
            extra_cost(candidate) <= extra_cost(current)

    return greedy_prune(best, steps, trials, cheaper)


def untile_where_room(best: Plan, budget: int, stages: StageModel, check: Check,
                      norms: list[int], readers: list[set[int | None]],
                      recomputable: list[bool] | None = None) -> Plan:
    """A tiled plan's tiled stages whose outputs are stored on the device, run whole
    instead (recomputed) where the verified peak still fits and the extra FLOPs fall
    (NOTE [ Tiling layouts ] rule 9): the most passes saved first (forward FLOPs times one
    more than the stage's normalisations, ``norms`` per stage index, from
    ``tiling.stage_norms``), none that would save under 1 % of the step's FLOPs. A stage
    reading a fused or host-resident output (``readers``: per stage index, the stages
    reading its outputs, ``tiling.stage_readers``) stays tiled: run whole, it would make
    that output whole on the device. A stage that may not be recomputed
    (``recomputable``, as in ``layout_regions``) is kept whole instead. A trial is
    verified only when the stage's recomputation working set above its input (the stage
    model's) fits the room the budget has left above what its tiled run held (``_room``;
    all it saves, when kept whole: above the verified peak)."""
    tiled = [(r, st) for r, st in staged_regions(best, stages) if r.decision == Decision.TILE]
    deferred = {st.index for r, st in tiled if r.fuse or r.host}
    reading = {s for d in deferred for s in readers[d] if s is not None}
    floor = (best.step_flops or 0) / 100
    steps = [(r, st) for r, st in tiled
             if not (r.fuse or r.host) and not r.segment
             and st.index not in reading and st.fwd_flops * (1 + norms[st.index]) >= floor]
    steps.sort(key=lambda pair: (-pair[1].fwd_flops * (1 + norms[pair[1].index]),
                                 pair[1].index))

    def trials(step: tuple[Region, Stage], current: Plan) -> Iterator[Plan]:
        region, st = step
        recompute = recomputable is None or recomputable[st.index]
        added = st.held_in_backward(RECOMPUTE) - st.input_bytes if recompute else \
            st.saved_bytes
        if added > _room(current, budget, region.label if recompute else None):
            log.info("%s: its working set run whole (%s) does not fit the room left",
                     region.label, format_bytes(added))
            return
        log.info("trying %s run whole", region.label)
        whole = [Region(st.name, calls=[st.call_index])] if recompute else []
        regions = [w for r in current.regions for w in (whole if _same(r, region) else [r])]
        yield check(dataclasses.replace(current, regions=regions, notes=list(current.notes)),
                    beating(current, budget))

    cheaper = _fits_with_fewer_flops(budget)

    return greedy_prune(best, steps, trials, cheaper)


def stash_where_room(best: Plan, budget: int, stages: StageModel, check: Check,
                     norms: list[int], readers: list[set[int | None]]) -> Plan:
    """A tiled plan's runs with normalisations that stash nothing, stashing their inputs
    on the device where the verified peak still fits and the extra FLOPs fall (NOTE
    [ Tiling layouts ] rule 10), the most passes saved first (the forward FLOPs of each
    stage of the run, its own and the fused producers' it computes, times its
    normalisations; ``norms`` per stage index, ``tiling.stage_norms``), none that would
    save under 1 % of the step's FLOPs. A trial is verified only when, by the stage
    model's output bytes of the run's stages, its largest normalisation input fits the
    room the budget has left above what the run's forward passes held, and all but that
    one the room above what its backward's sums passes held (``_room``: a stash lives
    only while its run's passes do; each is whole in forward, all but the last
    normalisation's at the end of the first sums pass)."""
    staged = staged_regions(best, stages)
    fused = _fused(best, stages)

    floor = (best.step_flops or 0) / 100
    steps = []
    for r, st in staged:
        if r.decision != Decision.TILE or r.fuse or r.stash is not None:
            continue
        # the stage and the fused producers it computes, producers first (they run first)
        run = [stages.stages[i] for i in sorted(_fused_chain(st.index, fused, readers))]
        saves = sum(s.fwd_flops * norms[s.index] for s in run)
        if saves >= floor:
            steps.append((r, _norm_inputs(run, norms), saves))
    steps.sort(key=lambda step: -step[2])

    def fits(region: Region, current: Plan, forward: int, sums: int) -> bool:
        return forward <= _room(current, budget, region.label, ("forward",)) and \
            sums <= _room(current, budget, region.label, ("sums",))

    def trials(step: tuple[Region, list[tuple[int, float]], float], current: Plan
               ) -> Iterator[Plan]:
        region, inputs, _ = step
        sizes = [size for size, _ in inputs]
        # each stash is whole in forward; all but one at the end of the first sums pass
        if fits(region, current, max(sizes), sum(sizes) - max(sizes)):
            log.info("trying %s with its normalisation inputs stashed on the device",
                     region.label)
            yield check(_replaced(current, region, stash="device", stash_norms=None),
                        beating(current, budget))
        else:
            log.info("%s: its normalisation inputs (%s) do not fit the room its passes "
                     "left; trying one", region.label, format_bytes(sum(sizes)))
        # one normalisation's input: the passes after it start there (forward), and the
        # backward's sums passes from it on; the two that save the most and fit
        k = len(inputs)
        one = sorted(range(k), key=lambda j: -_stash_saves(inputs, j))
        tried = 0
        for j in one:
            size = inputs[j][0]
            if k < 2 or tried == _SINGLE_STASHES or \
                    not fits(region, current, size, size if j < k - 1 else 0):
                continue
            tried += 1
            log.info("trying %s with normalisation %d's input stashed on the device",
                     region.label, j)
            yield check(_replaced(current, region, stash="device", stash_norms=[j]),
                        beating(current, budget))

    cheaper = _fits_with_fewer_flops(budget)

    def second(step: tuple[Region, list[tuple[int, float]], float], current: Plan
               ) -> Iterator[Plan]:
        # a run that took one normalisation's stash: one more, the one that saves the
        # most beside it and fits (both whole in forward; all but the later at the end
        # of the first sums pass)
        region, inputs, _ = step
        now = next((r for r in current.regions if _same(r, region)), None)
        if now is None or now.stash != "device" or now.stash_norms is None or \
                len(now.stash_norms) != 1:
            return
        j, k = now.stash_norms[0], len(inputs)
        for j2 in sorted((i for i in range(k) if i != j),
                         key=lambda i: -_stash_saves(inputs, i)):
            pair = sorted((j, j2))
            held = inputs[pair[0]][0] if pair[1] == k - 1 else \
                inputs[pair[0]][0] + inputs[pair[1]][0]
            if fits(now, current, inputs[j][0] + inputs[j2][0], held):
                log.info("trying %s with normalisations %s's inputs stashed on the device",
                         region.label, pair)
                yield check(_replaced(current, now, stash_norms=pair),
                            beating(current, budget))
                return

    once = greedy_prune(best, steps, trials, cheaper)
    return greedy_prune(once, steps, second, cheaper)


_SINGLE_STASHES = 2  # rule 10: single-normalisation stashes tried per run, at most


def _stash_saves(inputs: list[tuple[int, float]], j: int) -> float:
    """What stashing normalisation ``j``'s input saves, by the stage model (rule 10's
    order): the run's forward FLOPs up to it, for each pass that no longer recomputes
    them (forward passes after it, and the backward's sums passes from it on; the last
    normalisation's, its final forward pass only)."""
    k = len(inputs)
    return inputs[j][1] * (2 * k - 2 * j - 1 if j < k - 1 else 1)


def _norm_inputs(run: list[Stage], norms: list[int]) -> list[tuple[int, float]]:
    """A tiled run's normalisations in order (its stages in order, each's evenly after
    its share of the stage's convolutions): each's input bytes (the stage's output
    bytes) and the forward FLOPs of the run up to it (what a pass recomputes to reach
    it)."""
    out, before = [], 0.0
    for st in run:
        n = norms[st.index]
        out += [(st.output_bytes, before + st.fwd_flops * (i + 1) / n) for i in range(n)]
        before += st.fwd_flops
    return out


def _fits_with_fewer_flops(budget: int) -> Callable[[Plan, Plan], bool]:
    """The test of a trial in rules 9-12: it fits ``budget`` and costs fewer extra FLOPs
    than the plan it would replace."""
    def cheaper(candidate: Plan, current: Plan) -> bool:
        return (candidate.verified_peak_bytes or 0) <= budget and \
            extra_cost(candidate) < extra_cost(current)
    return cheaper


def _replaced(plan: Plan, region: Region, **changes: object) -> Plan:
    """A copy of ``plan`` with ``region``'s fields changed (a trial of rules 8 and 10)."""
    regions = [dataclasses.replace(r, **changes) if _same(r, region)  # type: ignore[arg-type]
               else r for r in plan.regions]
    return dataclasses.replace(plan, regions=regions, notes=list(plan.notes))


def hand_rebuilt_inputs(best: Plan, budget: int, stages: StageModel, check: Check,
                        readers: list[set[int | None]]) -> Plan:
    """A tiled plan's rebuilt runs that read rebuilt outputs, each handing the inputs its
    last reader's rebuild made to its own backward where the verified peak still fits
    (NOTE [ Tiling layouts ] rule 11; ``Region.hand_inputs``): one rebuild of those inputs
    fewer, for holding them across that reader's backward. Each trial is verified."""
    staged = staged_regions(best, stages)
    rebuilt = {st.index for r, st in staged if r.rebuild}
    steps = [(r, st) for r, st in staged if r.rebuild and not r.hand_inputs and any(
        st.index in readers[p] for p in rebuilt)]
    steps.sort(key=lambda pair: (-pair[1].fwd_flops, pair[1].index))

    def trials(step: tuple[Region, Stage], current: Plan) -> Iterator[Plan]:
        region, _ = step
        log.info("trying %s handing its rebuilt inputs to its own backward", region.label)
        yield check(_replaced(current, region, hand_inputs=True), beating(current, budget))

    cheaper = _fits_with_fewer_flops(budget)

    return greedy_prune(best, steps, trials, cheaper)


def whole_rebuilds_where_room(best: Plan, budget: int, stages: StageModel, check: Check,
                              readers: list[set[int | None]]) -> Plan:
    """A tiled plan's runs that compute the rebuilt outputs they read in tiles, each
    rebuilding them whole instead where the verified peak still fits and the extra FLOPs
    fall (NOTE [ Tiling layouts ] rule 12), the most rebuilt FLOPs read first. A trial is
    verified only when those outputs (whole, by the stage model) fit the room the budget
    leaves above what the run's backward held (``_room``)."""
    staged = staged_regions(best, stages)
    by_index = {st.index: r for r, st in staged}

    def read(st: Stage) -> list[Stage]:  # the rebuilt stages its run reads
        found, todo = [], [st.index]
        while todo:
            s = todo.pop()
            for p, r in by_index.items():
                if s in readers[p] and r.decision == Decision.TILE:
                    if r.rebuild:
                        found.append(stages.stages[p])
                    elif r.fuse:
                        todo.append(p)
        return found

    steps = [(r, read(st)) for r, st in staged if r.rebuild_in_tiles]
    steps.sort(key=lambda pair: -sum(p.fwd_flops for p in pair[1]))

    def trials(step: tuple[Region, list[Stage]], current: Plan) -> Iterator[Plan]:
        region, rebuilt = step
        added = sum(p.output_bytes for p in rebuilt)
        if added > _room(current, budget, region.label):
            log.info("%s: its rebuilt inputs whole (%s) do not fit the room left",
                     region.label, format_bytes(added))
            return
        log.info("trying %s rebuilding its rebuilt inputs whole", region.label)
        yield check(_replaced(current, region, rebuild_in_tiles=False),
                    beating(current, budget))

    cheaper = _fits_with_fewer_flops(budget)

    return greedy_prune(best, steps, trials, cheaper)


def staged_regions(plan: Plan, stages: StageModel) -> list[tuple[Region, Stage]]:
    """Each of ``plan``'s regions with the stage it runs (by module and first call; a
    region of no stage is left out)."""
    by_name = {(st.name, st.call_index): st for st in stages.stages}
    return [(r, st) for r in plan.regions
            if (st := by_name.get((r.module, (r.calls or [0])[0]))) is not None]


def _same(a: Region, b: Region) -> bool:
    """Whether two regions are the same stage's (the plan's edits replace regions)."""
    return (a.module, a.calls, a.segment) == (b.module, b.calls, b.segment)


def prune_tiled(best: Plan, budget: int, stages: StageModel, check: Check) -> Plan:
    """A tiled plan made cheaper like the search's ``prune`` does: each recomputed stage,
    costliest first, is kept instead, else recomputed keeping its convolution outputs,
    while the verified peak still fits and the extra FLOPs do not grow. So a tiled plan
    mixes keep, selective recomputation, recomputation and tiling (NOTE [ Tiling layouts ]
    rule 4 is where it starts). Tiled regions stay as they are.

    Verifying a tiled plan is slow at 512³ (tens of seconds), so a step is only tried
    for a stage that recomputes at least 1 % of the step's FLOPs, and when the bytes it
    would add to the stage's saved tensors, by the stage model, fit in what the budget
    has left above the verified peak. The steps whose bytes fit that room together are
    first tried at once (one verification where the layout left room); the others, or
    all of them when that does not fit, one at a time.
    """
    floor = (best.step_flops or 0) // 100
    recomputed = [(r, st) for r, st in staged_regions(best, stages)
                  if r.decision == RECOMPUTE and not r.segment and r.policy is None
                  and st.fwd_flops >= floor]

    def trials(step: tuple[Region, Stage], current: Plan) -> Iterator[Plan]:
        region, st = step
        others = [r for r in current.regions if r is not region]
        selective = dataclasses.replace(region, policy=SELECTIVE_POLICY)
        for decision, regions in ((KEEP, others), (SELECTIVE, [*others, selective])):
            slack = budget - (current.verified_peak_bytes or 0)
            if st.kept(decision) - st.kept(RECOMPUTE) <= slack:
                yield check(dataclasses.replace(current, regions=regions,
                                                notes=list(current.notes)),
                            beating(current, budget))

    def cheaper(candidate: Plan, current: Plan) -> bool:
        return (candidate.verified_peak_bytes or 0) <= budget and \
            extra_cost(candidate) <= extra_cost(current)

    steps = sorted(recomputed, key=lambda pair: -pair[1].fwd_flops)
    # first every step at once whose bytes fit the slack together (costliest first): where
    # the tiled layout left room, one verification keeps them all
    batch, room = [], budget - (best.verified_peak_bytes or 0)
    for region, st in steps:
        added = st.kept(KEEP) - st.kept(RECOMPUTE)
        if added <= room:
            batch.append(region)
            room -= added
    if len(batch) >= 2:
        kept = check(dataclasses.replace(
            best, regions=[r for r in best.regions if all(r is not b for b in batch)],
            notes=list(best.notes)), beating(best, budget))
        if cheaper(kept, best):
            best = kept
            steps = [(r, st) for r, st in steps if all(r is not b for b in batch)]
    return greedy_prune(best, steps, trials, cheaper)


def greedy_prune(best: Plan, steps: Iterable[T], trials: Callable[[T, Plan], Iterator[Plan]],
                 cheaper: Callable[[Plan, Plan], bool]) -> Plan:
    """Make ``best`` cheaper one verified step at a time: for each step (in the order
    given: costliest first), the first of its trial plans (made from the current best, and
    verified, one at a time: later ones only if earlier ones fail) that is ``cheaper``
    replaces it. Both prunings (stage plans in the search, tiled plans here) are this."""
    for step in steps:
        for candidate in trials(step, best):
            if cheaper(candidate, best):
                best = candidate
                break
    return best

"""Repeated tiles on meta are booked, not run (NOTE [ Repeats on meta ] in
``instrument/tracker.py``): what a tiled step measures is the same with and without.

Peaks, their breakdown and the module at the peak, every FLOP count, host memory, the most
live bytes in each tiled run's passes (what the planner reads) and the timeline's
high-water mark are compared on tiled plans (a replayed tile is one timeline event):
every kind of normalisation (batch statistics gathered over tiles, backward sums), fused
regions, host-resident outputs, a tile that does not divide the volume, and a plan the
planner chooses.
"""

from __future__ import annotations

import pytest
import torch

import remat3d
import remat3d.measurement
from remat3d.instrument.step import meta_copy, prepare_step, run_step
from remat3d.instrument.tracker import (
    LimitExceeded,
    MemoryTracker,
    Repeat,
    RepeatSeries,
    shared_repeat,
    shared_repeats,
    stop_above,
)
from remat3d.planspec import Plan, Region
from tests.tiling.test_norms import NORM_NAMES, _dynunet


def _measured(model, plan, shape, replays, amp=None):
    copy_ = remat3d.apply(meta_copy(model), plan)
    setup = prepare_step(copy_, (torch.empty(shape, device="meta"),), "meta", amp, None)
    tracker = run_step(setup, replays=replays)
    try:
        return {
            "peak": tracker.peak_bytes,
            "breakdown": tracker.peak_breakdown(),
            "at": tracker.peak_modules(),
            "flops": dict(tracker.flops),
            "host": tracker.host_peak_bytes,
            "windows": tracker.window_peaks(),
            "top": max(max(e.live_before, e.live_after) for e in tracker.timeline),
            "events": len(tracker.timeline),
        }
    finally:
        tracker.close()


def _numbers(measured):
    """What a measurement finds, without how many timeline events it took (a replayed
    tile is one)."""
    return {k: v for k, v in measured.items() if k != "events"}


def _same_with_and_without(model, plan, shape, amp=None):
    ran = _measured(model, plan, shape, replays=False, amp=amp)
    booked = _measured(model, plan, shape, replays=True, amp=amp)
    assert _numbers(booked) == _numbers(ran)
    return ran


@pytest.mark.parametrize("norm", ["instance", "group-affine", "batch"])
def test_a_tiled_step_measures_the_same_with_repeats_booked(norm):
    net = _dynunet(NORM_NAMES[norm], torch.float32)
    shape = (1, 1, 16, 16, 16)
    # 4 x 4 tiles (9 shapes), host-resident or fused; tiles that do not divide the volume
    for tile, host in (([16, 4, 4], False), ([16, 4, 4], True), ([16, 6, 5], False)):
        plan = Plan(regions=[
            Region("input_block", decision="tile", tile=tile, fuse=not host, host=host),
            Region("downsamples.0", decision="tile", tile=[t // 2 for t in tile]),
            Region("upsamples.1", decision="tile", tile=tile, host=host)])
        ran = _same_with_and_without(net, plan, shape)
        assert ran["flops"]["recompute"] > 0


@pytest.mark.parametrize("in_tiles", [False, True])
def test_rebuilt_outputs_measure_the_same_with_repeats_booked(in_tiles):
    """The skip rebuilt for its readers' backwards, whole or in parts their tiles compute
    (NOTE [ Rebuilt tiled outputs ] rule 7: a tile's key holds its parts' shapes too)."""
    net = _dynunet(NORM_NAMES["instance"], torch.float32)
    shape = (1, 1, 16, 16, 16)
    for tile in ([16, 4, 4], [16, 6, 5], [4, 4, 4]):  # cubic: rule 7 keys its parts too
        plan = Plan(regions=[
            Region("input_block", decision="tile", tile=tile, rebuild=True),
            Region("downsamples.0", decision="tile", tile=[t // 2 for t in tile],
                   rebuild_in_tiles=in_tiles),
            Region("upsamples.1", decision="tile", tile=tile, rebuild_in_tiles=in_tiles)])
        ran = _same_with_and_without(net, plan, shape)
        assert ran["flops"]["recompute"] > 0


def test_under_autocast_and_for_the_plan_the_planner_chooses():
    net = _dynunet(NORM_NAMES["instance"], torch.float32)
    shape = (1, 1, 32, 32, 32)
    plan = remat3d.plan(net, shape, budget="0.5x", graph=False)
    assert plan.tiled, plan.summary()
    _same_with_and_without(net, plan, shape)
    tiles = Plan(regions=[Region("input_block", decision="tile", tile=[32, 8, 8], fuse=True),
                          Region("upsamples.1", decision="tile", tile=[32, 8, 8])],
                 amp="bf16")
    _same_with_and_without(net, tiles, shape, amp="bf16")


def test_repeats_are_booked_where_measure_runs_and_save_work(monkeypatch):
    # what plans are verified with books repeats; the same numbers either way, and the
    # tiles it books are ops that did not run
    net = _dynunet(NORM_NAMES["instance"], torch.float32)
    plan = Plan(regions=[Region("input_block", decision="tile", tile=[32, 8, 8])])
    shape = (1, 1, 32, 32, 32)
    counts = {}
    for replays in (False, True):
        monkeypatch.setattr(remat3d.measurement, "_REPLAYS", replays)
        ops = []
        monkeypatch.setattr(remat3d.runtime.tiling.tiled.TiledRun, "run_tile", _counting(ops))
        m = remat3d.measure(remat3d.apply(meta_copy(net), plan),
                            torch.empty(shape, device="meta"), device="meta")
        counts[replays] = (len(ops), m.peak_bytes, m.flops)
    assert counts[True][1:] == counts[False][1:]
    assert counts[True][0] < counts[False][0] * 0.75  # 16 tiles a pass, 9 shapes


def _counting(calls):
    original = remat3d.runtime.tiling.tiled.TiledRun.run_tile

    def run_tile(self, k, *args, **kwargs):
        calls.append(k)
        return original(self, k, *args, **kwargs)

    return run_tile


def _shared_measured(net, plans, shape, calls):
    """Each plan measured in turn inside one ``shared_repeats()`` scope (rule 5), with
    the tiles each one ran counted."""
    out = []
    with shared_repeats():
        for plan in plans:
            calls.clear()
            measured = _measured(net, plan, shape, replays=True)
            measured["tiles"] = len(calls)
            out.append(measured)
    assert shared_repeat(("anything",)) is None  # nothing kept once the scope is left
    return out


@pytest.mark.parametrize(("norm", "host"), [("instance", False), ("instance", True),
                                            ("batch", False)])
def test_repeats_booked_across_measurements_measure_what_running_them_does(monkeypatch, norm,
                                                                            host):
    # NOTE [ Repeats on meta ] rule 5: what remat3d.plan verifies candidates under. A
    # plan measured after another that shares its tiled runs, and again after itself,
    # books their tiles; its peak (with the module at it), host peak and FLOPs are the
    # ones of measuring it alone, and it runs fewer tiles
    net = _dynunet(NORM_NAMES[norm], torch.float32)
    shape = (1, 1, 16, 16, 16)
    tile = [16, 4, 4]
    # the full-resolution stages' runs are the same in both plans; the second one tiles
    # the half-resolution stage too
    first = Plan(regions=[Region("input_block", decision="tile", tile=tile, host=host),
                          Region("upsamples.1", decision="tile", tile=tile, host=host)])
    second = Plan(regions=[*first.regions,
                           Region("downsamples.0", decision="tile", tile=[16, 2, 2])])
    calls = []
    monkeypatch.setattr(remat3d.runtime.tiling.tiled.TiledRun, "run_tile", _counting(calls))
    alone = _measured(net, second, shape, replays=True)
    ran_alone = len(calls)
    after_first, again = _shared_measured(net, [first, second, second], shape, calls)[1:]
    for booked in (after_first, again):
        for key in ("peak", "at", "host", "flops", "windows", "top"):
            assert booked[key] == alone[key], key
        assert sum(booked["breakdown"].values()) == booked["peak"]
    assert after_first["tiles"] < ran_alone
    assert again["tiles"] < after_first["tiles"]
    if host:
        assert alone["host"] > 0


def test_a_booked_repeat_raises_the_peak_where_it_passes_it():
    # recorded in one step, booked in another at a higher live level: the high-water mark
    # lands on top of what is live there, named after the module it was recorded in
    block = torch.nn.Sequential(torch.nn.Conv3d(1, 2, 3, padding=1))

    def piece():
        y = block(torch.empty(1, 1, 8, 8, 8, device="meta"))  # 2 KiB in, 4 KiB out
        del y

    block.to("meta")
    with MemoryTracker("meta", model=block, replays=True) as recorder:
        start = recorder.begin_repeat()
        piece()
        repeat = recorder.end_repeat(start)
    assert repeat is not None and repeat.high == 2048 + 4096
    assert repeat.at and repeat.at[0] == "0"
    with MemoryTracker("meta", replays=True) as tracker:
        held = torch.empty(1 << 16, device="meta")  # 256 KiB live
        tracker.book(repeat)
        assert tracker.peak_bytes == held.nbytes + repeat.high
        assert tracker.peak_modules() == repeat.at
        assert tracker.peak_breakdown()["transient"] == tracker.peak_bytes
        assert tracker.flops["forward"] == sum(f for _, f in repeat.flops) > 0
        assert tracker.live() == held.nbytes  # it leaves nothing behind
        bigger = torch.empty(1 << 18, device="meta")  # a later peak of its own
        assert tracker.peak_modules() == ()
        del bigger


@pytest.mark.parametrize("norm", ["instance", "batch"])
def test_a_pass_seen_before_books_its_middle_tiles_as_one_series(monkeypatch, norm):
    # rule 9: measured again in one shared scope, a plan books each pass's tiles between
    # the first and the last that runs as one series (one timeline event), and measures
    # what it does alone: peak, the module there, host peak, FLOPs, window peaks
    net = _dynunet(NORM_NAMES[norm], torch.float32)
    shape = (1, 1, 16, 16, 16)
    plan = Plan(regions=[Region("input_block", decision="tile", tile=[16, 4, 4]),
                         Region("upsamples.1", decision="tile", tile=[16, 4, 4])])
    alone = _measured(net, plan, shape, replays=True)
    series = []
    original = MemoryTracker.book_series

    def book_series(self, s):
        series.append(len(s.pieces))
        return original(self, s)

    monkeypatch.setattr(MemoryTracker, "book_series", book_series)
    first, again = _shared_measured(net, [plan, plan], shape, [])
    for key in ("peak", "at", "host", "flops", "windows", "top"):
        assert again[key] == first[key] == alone[key], key
    assert series and min(series) >= 2  # 16 tiles a pass: 14 or 15 booked at once
    assert again["events"] < first["events"]


def test_a_runs_geometry_is_laid_out_once_across_measurements(monkeypatch):
    # rule 10: within one shared scope, a run with the same trace and tile is laid out
    # once; measured again, the plan measures the same
    net = _dynunet(NORM_NAMES["instance"], torch.float32)
    shape = (1, 1, 16, 16, 16)
    plan = Plan(regions=[Region("input_block", decision="tile", tile=[16, 4, 4]),
                         Region("upsamples.1", decision="tile", tile=[16, 4, 4])])
    alone = _measured(net, plan, shape, replays=True)
    geometry = remat3d.runtime.tiling.tiled._Geometry
    laid_out = []
    original = geometry.of

    def of(tr, tile):
        laid_out.append(tile)
        return original(tr, tile)

    monkeypatch.setattr(geometry, "of", staticmethod(of))
    with shared_repeats():
        first = _measured(net, plan, shape, replays=True)
        once = len(laid_out)
        again = _measured(net, plan, shape, replays=True)
    assert once >= 2 and len(laid_out) == once  # none laid out again
    assert _numbers(first) == _numbers(alone)
    for key in ("peak", "at", "host", "flops", "windows", "top"):
        assert again[key] == alone[key], key
    _measured(net, plan, shape, replays=True)  # outside the scope: laid out anew
    assert len(laid_out) == 2 * once


def test_a_series_booked_under_a_limit_stops_where_its_tiles_one_by_one_do():
    # rule 9 under NOTE [ Bounded measurements ]: where booking a series at once could
    # pass a limit, its pieces are booked one by one: the same stop, at the same bytes
    # and FLOPs, as booking them in turn
    pieces = [Repeat(0, 0, [], high, 0, ("conv3d", "forward"), (f"tile{i}",),
                     (("forward", 10),)) for i, high in enumerate([100, 300, 200, 300])]
    series = RepeatSeries.of(pieces)
    assert series.joined.high == 300 and series.joined.at == ("tile1",)
    assert series.flops == 40

    def stopped(book):
        with stop_above(500, None), MemoryTracker("meta", replays=True) as tracker:
            held = torch.empty(64, device="meta")  # 256 bytes live: 256 + 300 > 500
            try:
                book(tracker)
            except LimitExceeded as stop:
                return stop.peak_bytes, stop.flops, tracker.peak_modules(), held.nbytes
        raise AssertionError("no stop")

    def one_by_one(tracker):
        for piece in pieces:
            tracker.book(piece)

    assert stopped(lambda t: t.book_series(series)) == stopped(one_by_one) == \
        (256 + 300, 20, ("tile1",), 256)  # at the second tile
    with MemoryTracker("meta", replays=True) as tracker:  # no limit: at once, one event
        tracker.book_series(series)
        assert tracker.peak_bytes == 300 and tracker.peak_modules() == ("tile1",)
        assert tracker.flops["forward"] == 40 and len(tracker.timeline) == 1


def test_the_shared_scope_is_gone_after_an_exception():
    with pytest.raises(RuntimeError), shared_repeats():
        shared_repeat(("key",), Repeat(0, 0, []))
        assert shared_repeat(("key",)) is not None
        raise RuntimeError("interrupted")
    assert shared_repeat(("key",)) is None


def test_the_shared_scope_is_its_own_threads():
    # two plan() calls on two threads (two models, perhaps with equal keys) keep apart
    import threading

    seen = []
    with shared_repeats():
        shared_repeat(("key",), Repeat(0, 0, []))
        other = threading.Thread(target=lambda: seen.append(shared_repeat(("key",))))
        other.start()
        other.join()
        assert shared_repeat(("key",)) is not None
    assert seen == [None]


def test_the_planner_chooses_the_same_plan_with_its_candidates_sharing_tiles(monkeypatch):
    # rule 5 inside remat3d.plan: every candidate it verifies measures the same booked or
    # run, so the search takes the same steps to the same plan
    import contextlib

    import remat3d.planning

    net = _dynunet(NORM_NAMES["instance"], torch.float32)
    shape = (1, 1, 32, 32, 32)
    plans = {}
    for shared in (True, False):
        remat3d.planning.clear_plan_cache()
        if not shared:
            monkeypatch.setattr(remat3d.planning, "shared_repeats", contextlib.nullcontext)
        plans[shared] = remat3d.plan(net, shape, budget="0.3x", graph=False)
    remat3d.planning.clear_plan_cache()
    assert plans[True].tiled, plans[True].summary()
    assert plans[True].to_dict() == plans[False].to_dict()


def test_a_far_edge_tile_is_keyed_as_its_mirror_image():
    """Rule 6: on a 4-tile axis the near and far edge tiles are one shape (mirror images),
    the two inner ones another: 8 shapes for 64 tiles, not 27. Booked so, a tiled step
    still measures what running every tile does."""
    from torch import nn

    from remat3d.runtime.tiling.tiled import TiledRun

    block = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.InstanceNorm3d(2),
                          nn.LeakyReLU(), nn.Conv3d(2, 1, 3, padding=1))
    run = TiledRun(block, [torch.randn(1, 1, 16, 16, 16)], 4)
    assert len(run.tiles) == 64 and len(set(run.shapes)) == 8
    net = _dynunet(NORM_NAMES["instance"], torch.float32)
    plan = Plan(regions=[Region("input_block", decision="tile", tile=[4, 4, 4]),
                         Region("upsamples.1", decision="tile", tile=[4, 4, 4])])
    _same_with_and_without(net, plan, (1, 1, 16, 16, 16))


def test_the_planner_chooses_the_same_plan_with_its_losing_candidates_stopped(monkeypatch):
    # NOTE [ Bounded measurements ]: candidates measured only until they pass the budget
    # or the FLOPs of the plan they would replace (the improvements of rules 8-12 and the
    # prune reject each stopped one as they would have rejected it measured whole; a
    # stopped layout is repaired from where it passed the budget): here the same plan
    import contextlib

    import remat3d.planning

    net = _dynunet(NORM_NAMES["instance"], torch.float32)
    shape = (1, 1, 32, 32, 32)
    stops: list[str] = []
    bounded = remat3d.planning.stop_above

    @contextlib.contextmanager
    def counted(peak_bytes=None, flops=None):
        with bounded(peak_bytes, flops):
            try:
                yield
            except remat3d.planning.LimitExceeded as exc:
                stops.append(exc.what)
                raise

    plans = {}
    for stop in (True, False):
        remat3d.planning.clear_plan_cache()
        monkeypatch.setattr(remat3d.planning, "stop_above",
                            counted if stop else lambda *a, **k: contextlib.nullcontext())
        plans[stop] = remat3d.plan(net, shape, budget="0.3x", graph=False)
    remat3d.planning.clear_plan_cache()
    assert plans[True].tiled and stops, plans[True].summary()
    assert plans[True].to_dict() == plans[False].to_dict()


def test_a_tile_with_its_axes_swapped_is_keyed_as_one_shape():
    """Rule 7: a stride-2 convolution makes the far edge no mirror of the near one (3
    kinds of position an axis, 27 shapes); on an isotropic run a tile and its axes
    swapped are one shape (10); an anisotropic run keeps every shape it has. Booked so,
    a tiled step still measures what running every tile does."""
    from torch import nn

    from remat3d.runtime.tiling.tiled import TiledRun

    def block(stride):
        return nn.Sequential(nn.Conv3d(1, 2, 3, stride=stride, padding=1),
                             nn.InstanceNorm3d(2), nn.LeakyReLU(),
                             nn.Conv3d(2, 2, 3, padding=1))

    x = torch.randn(1, 1, 32, 32, 32)
    run = TiledRun(block(2), [x], 4)
    assert len(run.tiles) == 64 and len(set(run.shapes)) == 27 and len(set(run.keys)) == 10
    run = TiledRun(block((2, 2, 1)), [torch.randn(1, 1, 32, 32, 16)], 4)
    assert run.keys == run.shapes
    net = _dynunet(NORM_NAMES["instance"], torch.float32)
    plan = Plan(regions=[Region("downsamples.0", decision="tile", tile=[2, 2, 2]),
                         Region("upsamples.1", decision="tile", tile=[4, 4, 4])])
    _same_with_and_without(net, plan, (1, 1, 16, 16, 16))


@pytest.mark.parametrize(("norm", "stash"), [("instance", "device"), ("instance", "host"),
                                             ("batch", "device")])
def test_a_stashed_run_books_the_passes_it_shares_with_the_unstashed_one(monkeypatch, norm,
                                                                         stash):
    # rule 8: a pass is keyed by what it does with stashes, not by the run's stashes. A
    # plan that stashes a normalisation's input, measured after the one that does not,
    # books the passes before that normalisation and the final backward pass, and
    # measures what it does alone
    net = _dynunet(NORM_NAMES[norm], torch.float32)
    shape = (1, 1, 16, 16, 16)
    plain = Plan(regions=[Region("input_block", decision="tile", tile=[16, 4, 4])])
    stashed = Plan(regions=[Region("input_block", decision="tile", tile=[16, 4, 4],
                                   stash=stash, stash_norms=[1])])
    calls = []
    monkeypatch.setattr(remat3d.runtime.tiling.tiled.TiledRun, "run_tile", _counting(calls))
    alone = _measured(net, stashed, shape, replays=True)
    ran_alone = len(calls)
    assert _numbers(alone) == _numbers(_measured(net, stashed, shape, replays=False))
    after_plain = _shared_measured(net, [plain, stashed], shape, calls)[1]
    for key in ("peak", "at", "host", "flops"):
        assert after_plain[key] == alone[key], key
    assert after_plain["tiles"] < ran_alone

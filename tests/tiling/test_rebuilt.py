"""Rebuilt tiled outputs (NOTE [ Rebuilt tiled outputs ] in runtime/tiling/tiled.py): the
tiled readers of an output do not keep it; the first of their backwards runs its forward
again. Bitwise the stored output's step, and the output absent between."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat3d
from remat3d.errors import PlanError
from remat3d.instrument.tracker import MemoryTracker
from remat3d.planspec import Plan, Region
from remat3d.runtime.tiling.tiled import labelled
from remat3d.runtime.tiling.trace import TilingError


def _modules(device: str = "cpu", batch_norm: bool = False,
             dtype: torch.dtype = torch.float64) -> list[nn.Module]:
    torch.manual_seed(0)
    norm: nn.Module = nn.BatchNorm3d(6) if batch_norm else nn.InstanceNorm3d(6, affine=True)
    stem = nn.Sequential(nn.Conv3d(1, 6, 3, padding=1), norm, nn.LeakyReLU(0.01))
    a = nn.Sequential(nn.Conv3d(6, 2, 3, padding=1), nn.InstanceNorm3d(2, affine=True),
                      nn.LeakyReLU(0.01))
    b = nn.Sequential(nn.Conv3d(6, 2, 3, stride=2, padding=1), nn.InstanceNorm3d(2),
                      nn.ReLU())
    # untiled work between the readers' forwards and their backwards (the decoder's)
    heavy = nn.Sequential(nn.Conv3d(2, 16, 3, padding=1), nn.ReLU(), nn.Conv3d(16, 2, 1))
    return [m.to(device, dtype) for m in (stem, a, b, heavy)]


def _step(mods: list[nn.Module], x: torch.Tensor, *, rebuild: bool | None,
          plain_reader: bool = False, stash: str | None = None,
          in_tiles: bool = False) -> torch.Tensor:
    """The loss; ``rebuild`` None: untiled."""
    stem, a, b, heavy = mods
    if rebuild is None:
        s = stem(x)
        ya, yb = a(s), b(s)
    else:
        s = remat3d.tile(stem, x, tile=5, share_grads=True, rebuild=rebuild, stash=stash)
        ya = remat3d.tile(a, s, tile=4, rebuild_in_tiles=in_tiles)
        yb = remat3d.tile(b, s, tile=3, rebuild_in_tiles=in_tiles)
    y = heavy(ya) * 2 + nn.functional.interpolate(yb, scale_factor=2)
    return y.square().sum() + (s.sin().sum() if plain_reader else 0)


def _grads(mods: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    out = [x.grad.clone(), *(p.grad.clone() for m in mods for p in m.parameters())]
    x.grad = None
    for m in mods:
        m.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("plain_reader", [False, True])
@pytest.mark.parametrize("stash", [None, "device"])
def test_rebuilt_outputs_give_the_stored_outputs_gradients_bitwise(
        plain_reader: bool, stash: str | None) -> None:
    """Bitwise the step with the output stored (a tiled run is deterministic), and the
    untiled step's up to rounding (float64); a reader outside the tiled runs keeps it."""
    mods = _modules()
    x = torch.randn(1, 1, 12, 10, 8, dtype=torch.float64, requires_grad=True)
    results = {}
    for rebuild in (None, False, True):
        _step(mods, x, rebuild=rebuild, plain_reader=plain_reader, stash=stash).backward()
        results[rebuild] = _grads(mods, x)
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)
    for got, want in zip(results[True], results[None]):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-10)


def test_running_statistics_and_counters_change_once() -> None:
    """A BatchNorm in the rebuilt run: its running statistics and num_batches_tracked are
    those of the stored output's step (the rebuild restores what it changes)."""
    buffers = []
    for rebuild in (False, True):
        mods = _modules(batch_norm=True)
        x = torch.randn(1, 1, 12, 10, 8, dtype=torch.float64, requires_grad=True)
        _step(mods, x, rebuild=rebuild).backward()
        buffers.append([b.clone() for b in mods[0].buffers()])
    assert int(buffers[1][-1]) == 1
    for got, want in zip(*buffers):
        assert torch.equal(got, want)


def test_backward_twice_with_retain_graph_rebuilds_again() -> None:
    mods = _modules()
    x = torch.randn(1, 1, 12, 10, 8, dtype=torch.float64, requires_grad=True)
    loss = _step(mods, x, rebuild=True)
    loss.backward(retain_graph=True)
    first = _grads(mods, x)
    loss.backward()
    for got, want in zip(_grads(mods, x), first):
        assert torch.equal(got, want)


def test_rebuilt_outputs_cannot_also_live_in_host_memory_and_only_they_hand_inputs() -> None:
    stem = _modules()[0]
    x = torch.randn(1, 1, 8, 8, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TilingError, match="host=True or rebuild=True"):
        remat3d.tile(stem, x, tile=4, host=True, rebuild=True)
    with pytest.raises(TilingError, match="host=True or rebuild=True"), torch.no_grad():
        remat3d.tile(stem, x, tile=4, host=True, rebuild=True)
    with pytest.raises(TilingError, match="give rebuild=True too"):
        remat3d.tile(stem, x, tile=4, hand_inputs=True)


def _meta_peak(rebuild: bool, in_tiles: bool = False) -> tuple[int, float]:
    mods = _modules("meta", dtype=torch.float32)
    x = torch.empty(1, 1, 32, 32, 32, device="meta")
    with MemoryTracker("meta") as tracker:
        tracker.register(list(nn.ModuleList(mods).parameters()), "param")
        tracker.register(x, "input")
        loss = _step(mods, x, rebuild=rebuild, in_tiles=in_tiles)
        tracker.phase = "backward"
        loss.backward()
    return tracker.peak_bytes, sum(tracker.flops.values())


def test_on_meta_the_output_is_absent_until_its_readers_backward() -> None:
    """The peak (in the untiled heavy block's backward, between the readers' forwards and
    their backwards) is lower by the whole output; the price is the run's forward again."""
    skip = 6 * 32 ** 3 * 4
    (stored, stored_flops), (rebuilt, rebuilt_flops) = _meta_peak(False), _meta_peak(True)
    assert stored - rebuilt >= skip
    assert rebuilt_flops > stored_flops


class _Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.a, self.b, self.heavy = _modules()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        return self.heavy(self.a(s)) * 2 + nn.functional.interpolate(self.b(s),
                                                                     scale_factor=2)


def test_a_plan_rebuilds_a_tiled_output() -> None:
    """Region(rebuild=True): the planned step's gradients are the step's with the output
    stored, bitwise; the plan says so when printed, and a rebuilt host output is refused."""
    x = torch.randn(1, 1, 12, 10, 8, dtype=torch.float64)
    grads = []
    for rebuild in (False, True):
        model = _Skip()
        plan = Plan(regions=[Region("stem", decision="tile", tile=[4, 5, 3], rebuild=rebuild),
                             *(Region(m, decision="tile", tile=[4, 4, 4]) for m in "ab")])
        remat3d.apply(model, plan)
        model(x).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for got, want in zip(*grads):
        assert torch.equal(got, want)
    assert "output rebuilt" in plan.summary()
    # the readers computing it in tiles (rule 7): the same up to rounding order
    model = _Skip()
    plan = Plan(regions=[Region("stem", decision="tile", tile=[4, 5, 3], rebuild=True),
                         *(Region(m, decision="tile", tile=[4, 4, 4], rebuild_in_tiles=True)
                           for m in "ab")])
    remat3d.apply(model, plan)
    model(x).square().sum().backward()
    for got, want in zip([p.grad for p in model.parameters()], grads[0]):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-11)
    assert "(rebuilt inputs in tiles)" in plan.summary()
    with pytest.raises(PlanError, match="rebuild_in_tiles applies"):
        Region("stem", decision="recompute", rebuild_in_tiles=True).check()
    with pytest.raises(PlanError, match="rebuild applies"):
        Region("stem", decision="tile", tile=[4], host=True, rebuild=True).check()
    with pytest.raises(PlanError, match="hand_inputs applies"):
        Region("stem", decision="tile", tile=[4], hand_inputs=True).check()


def _two_levels(device: str = "cpu", dtype: torch.dtype = torch.float64) -> list[nn.Module]:
    stem, a, _, heavy = _modules(device, dtype=dtype)
    torch.manual_seed(1)
    down = nn.Sequential(nn.Conv3d(6, 4, 3, stride=2, padding=1),
                         nn.InstanceNorm3d(4, affine=True), nn.ReLU()).to(device, dtype)
    both = nn.Conv3d(10, 2, 3, padding=1).to(device, dtype)
    return [stem, a, down, both, heavy]


def _two_level_loss(mods: list[nn.Module], x: torch.Tensor, rebuild: bool,
                    hand: bool = False, in_tiles: tuple[str, ...] = ()) -> torch.Tensor:
    """A skip at full resolution (read by ``down``, ``a`` and ``both``) and one at half
    resolution made from it (read by ``both``); ``in_tiles``: the readers that compute
    their rebuilt inputs in tiles."""
    stem, a, down, both, heavy = mods
    s0 = remat3d.tile(stem, x, tile=5, share_grads=True, rebuild=rebuild)
    s1 = remat3d.tile(down, s0, tile=3, share_grads=True, rebuild=rebuild, hand_inputs=hand,
                      rebuild_in_tiles="down" in in_tiles)
    r1 = remat3d.tile(lambda u, v: both(torch.cat(
        [u, nn.functional.interpolate(v, scale_factor=2)], 1)), s0, s1, tile=4,
        rebuild_in_tiles="both" in in_tiles)
    y = heavy(remat3d.tile(a, s0, tile=4, rebuild_in_tiles="a" in in_tiles)) + r1
    return y.square().sum()


@pytest.mark.parametrize("hand", [False, True])
def test_a_rebuilt_run_reading_a_rebuilt_output_rebuilds_it_for_itself(hand: bool) -> None:
    """Two levels: the half-resolution output is rebuilt from the full-resolution one,
    itself rebuilt (rule 5); a reader of both rebuilds the full-resolution one once for
    both; with ``hand_inputs`` the half-resolution run's own backward takes what its
    reader's rebuild made (rule 6). Bitwise the stored outputs' step."""
    mods = _two_levels()
    x = torch.randn(1, 1, 12, 10, 8, dtype=torch.float64, requires_grad=True)
    _two_level_loss(mods, x, rebuild=False).backward()
    want = _grads(mods, x)
    _two_level_loss(mods, x, rebuild=True, hand=hand).backward()
    for got, ref in zip(_grads(mods, x), want):
        assert torch.equal(got, ref)


def test_on_meta_handed_inputs_save_a_rebuild() -> None:
    flops = []
    for hand in (False, True):
        mods = _two_levels("meta", torch.float32)
        x = torch.empty(1, 1, 32, 32, 32, device="meta", requires_grad=True)
        with MemoryTracker("meta") as tracker:
            tracker.register(list(nn.ModuleList(mods).parameters()), "param")
            loss = _two_level_loss(mods, x, rebuild=True, hand=hand)
            tracker.phase = "backward"
            loss.backward()
        flops.append(sum(tracker.flops.values()))
    assert flops[1] < flops[0]


def test_a_rebuild_is_the_output_pass_alone() -> None:
    """Rule 3: a rebuild reuses the statistics its run's forward gathered, so each of the
    two readers' rebuilds costs one forward of the stage, not one per pass (the stem has
    a normalisation: two passes)."""
    from torch.utils.flop_counter import FlopCounterMode

    stem = _modules("meta", dtype=torch.float32)[0]
    with FlopCounterMode(display=False) as counter:
        stem(torch.empty(1, 1, 32, 32, 32, device="meta"))
    one_forward = counter.get_total_flops()
    (_, stored), (_, rebuilt) = _meta_peak(False), _meta_peak(True)
    assert rebuilt - stored == 2 * one_forward


@pytest.mark.parametrize("stash", [None, "device"])
def test_rebuilt_in_tiles_gives_the_stored_outputs_gradients(stash: str | None) -> None:
    """Rule 7: each reader's tiles compute their part of the output; the gradients are
    the stored output's step up to rounding order (float64), buffers included (the
    stem's BatchNorm: its running statistics and counter change once)."""
    results = {}
    for in_tiles in (False, True):
        mods = _modules(batch_norm=True)
        x = torch.randn(1, 1, 12, 10, 8, dtype=torch.float64, requires_grad=True)
        _step(mods, x, rebuild=True, stash=stash, in_tiles=in_tiles).backward()
        results[in_tiles] = [*_grads(mods, x), *(b.clone() for b in mods[0].buffers())]
    for got, want in zip(results[True], results[False]):
        assert got.dtype == want.dtype
        assert torch.allclose(got.double(), want.double(), rtol=1e-9, atol=1e-11)


def test_on_meta_an_output_rebuilt_in_tiles_is_never_whole_in_backward() -> None:
    """The peak of the readers' backwards is lower than with the whole rebuild (the
    first reader's backward holds the output whole there) and the FLOPs higher (the
    stem's ops once per pass of each reader's backward); the untiled heavy block's
    backward, above both, gives the step's peak, so the readers' windows are compared."""
    def windows(in_tiles: bool) -> tuple[int, float]:
        mods = _modules("meta", dtype=torch.float32)
        x = torch.empty(1, 1, 32, 32, 32, device="meta")
        with MemoryTracker("meta") as tracker:
            tracker.register(list(nn.ModuleList(mods).parameters()), "param")
            stem, a, _, _ = mods
            s = remat3d.tile(stem, x, tile=8, share_grads=True, rebuild=True)
            with labelled("reader"):
                y = remat3d.tile(a, s, tile=8, rebuild_in_tiles=in_tiles)
            tracker.phase = "backward"
            y.square().sum().backward()
        peaks = tracker.window_peaks()["reader"]
        return max(peaks["sums"], peaks["final"]), sum(tracker.flops.values())

    (whole, whole_flops), (tiles, tiles_flops) = windows(False), windows(True)
    output = 6 * 32 ** 3 * 4  # less what a tile's part of the stem holds
    assert whole - tiles >= 0.9 * output
    assert tiles_flops > whole_flops


@pytest.mark.parametrize("in_tiles", [("both",), ("both", "a", "down"), ("a", "down")])
@pytest.mark.parametrize("hand", [False, True])
def test_rebuilt_in_tiles_from_outputs_rebuilt_in_tiles_or_whole(
        in_tiles: tuple[str, ...], hand: bool) -> None:
    """Rule 7 with rules 5 and 6: a reader of both skips computes the half-resolution
    one's parts from parts of the full-resolution one; the other readers rebuild whole or
    in tiles, and hand on what they rebuilt whole. The stored outputs' step up to
    rounding order (float64)."""
    mods = _two_levels()
    x = torch.randn(1, 1, 12, 10, 8, dtype=torch.float64, requires_grad=True)
    _two_level_loss(mods, x, rebuild=False).backward()
    want = _grads(mods, x)
    _two_level_loss(mods, x, rebuild=True, hand=hand, in_tiles=in_tiles).backward()
    for got, ref in zip(_grads(mods, x), want):
        assert torch.allclose(got, ref, rtol=1e-9, atol=1e-11)


def test_a_run_reading_in_tiles_is_rebuilt_from_parts_of_its_inputs() -> None:
    """Rule 7: a run made with ``rebuild_in_tiles`` and rebuilt whole for its reader's
    backward reads its own rebuilt input in parts: the full-resolution output is never
    whole beside the half-resolution one while it is rebuilt. The stored step's gradients
    up to rounding order (float64)."""
    def step(mods: list[nn.Module], x: torch.Tensor, rebuild: bool, in_tiles: bool
             ) -> torch.Tensor:
        stem, _, down, _, _ = mods
        s0 = remat3d.tile(stem, x, tile=8, share_grads=True, rebuild=rebuild)
        with labelled("down"):
            s1 = remat3d.tile(down, s0, tile=4, share_grads=True, rebuild=rebuild,
                              rebuild_in_tiles=in_tiles)
        return remat3d.tile(nn.functional.relu, s1, tile=4).square().sum()

    mods = _two_levels()
    x = torch.randn(1, 1, 12, 10, 8, dtype=torch.float64, requires_grad=True)
    used = [mods[0], mods[2]]
    step(mods, x, False, False).backward()
    want = _grads(used, x)
    step(mods, x, True, True).backward()
    for got, ref in zip(_grads(used, x), want):
        assert torch.allclose(got, ref, rtol=1e-9, atol=1e-11)
    peaks = []
    for in_tiles in (False, True):
        mods = _two_levels("meta", torch.float32)
        x = torch.empty(1, 1, 32, 32, 32, device="meta")
        with MemoryTracker("meta") as tracker:
            tracker.register(list(nn.ModuleList(mods).parameters()), "param")
            loss = step(mods, x, True, in_tiles)
            tracker.phase = "backward"
            loss.backward()
        peaks.append(tracker.window_peaks()["down"]["rebuild"])
    assert peaks[0] - peaks[1] >= 0.9 * 6 * 32 ** 3 * 4  # the stem's output, less a part

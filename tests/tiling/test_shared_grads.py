"""Shared input gradients (NOTE [ Shared input gradients ] in runtime/tiling/tiled.py): the
tiled readers of a tiled output add into one gradient; exact, and one whole gradient
fewer on meta."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat3d
from remat3d.instrument.tracker import MemoryTracker
from remat3d.planspec import Plan, Region
from remat3d.runtime.tiling.tiled import GradSlot, grad_slot


def _block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), nn.InstanceNorm3d(cout, affine=True),
                         nn.LeakyReLU(0.01))


def _modules(dtype: torch.dtype = torch.float64, device: str = "cpu") -> list[nn.Module]:
    torch.manual_seed(0)
    return [_block(1, 6).to(device, dtype), _block(6, 2).to(device, dtype),
            nn.Sequential(nn.Conv3d(6, 2, 3, stride=2, padding=1), nn.InstanceNorm3d(2),
                          nn.ReLU()).to(device, dtype)]


def _loss(stem: nn.Module, a: nn.Module, b: nn.Module, x: torch.Tensor, *, tiled: bool,
          share: bool = True, plain_reader: bool = False, host: bool = False) -> torch.Tensor:
    if tiled:
        s = remat3d.tile(stem, x, tile=5, share_grads=share, host=host)
        ya, yb = remat3d.tile(a, s, tile=4), remat3d.tile(b, s, tile=3)
    else:
        s = stem(x)
        ya, yb = a(s), b(s)
    loss = (ya * ya).sum() + yb.sum() * 0.5
    return loss + (s.sin().sum() if plain_reader else 0)


def _grads(mods: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad.clone(), *(p.grad.clone() for m in mods for p in m.parameters())]


def _reset(mods: list[nn.Module], x: torch.Tensor) -> None:
    x.grad = None
    for m in mods:
        m.zero_grad(set_to_none=True)


def _untiled(mods: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """The untiled step's gradients (float64: the reference); all gradients reset after."""
    _reset(mods, x)
    _loss(*mods, x, tiled=False).backward()
    grads = _grads(mods, x)
    _reset(mods, x)
    return grads


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("plain_reader", [False, True])
def test_two_tiled_readers_share_the_gradient_exactly(plain_reader: bool) -> None:
    """float64: the shared gradient, with or without a reader outside the tiled runs (its
    part comes through autograd), equals the untiled step's and the unshared tiles'."""
    mods = _modules()
    x = torch.randn(1, 1, 12, 11, 10, dtype=torch.float64, requires_grad=True)
    results = []
    for tiled, share in [(False, False), (True, False), (True, True)]:
        _reset(mods, x)
        _loss(*mods, x, tiled=tiled, share=share, plain_reader=plain_reader).backward()
        results.append(_grads(mods, x))
    for got in results[1:]:
        for g, want in zip(got, results[0]):
            assert torch.allclose(g, want, rtol=1e-9, atol=1e-10)


def test_the_output_carries_a_slot_and_backward_leaves_it_empty() -> None:
    mods = _modules()
    x = torch.randn(1, 1, 8, 8, 8, dtype=torch.float64)
    s = remat3d.tile(mods[0], x, tile=4, share_grads=True)
    slot = grad_slot(s)
    assert isinstance(slot, GradSlot)
    assert grad_slot(remat3d.tile(mods[0], x, tile=4)) is None  # not asked: no slot
    loss = (remat3d.tile(mods[1], s, tile=4) ** 2).sum() + remat3d.tile(mods[2], s, tile=4).sum()
    loss.backward()
    assert slot.grads == {}


def test_backward_twice_with_retain_graph_starts_from_an_empty_slot() -> None:
    mods = _modules()
    x = torch.randn(1, 1, 10, 9, 8, dtype=torch.float64, requires_grad=True)
    once = _untiled(mods, x)
    loss = _loss(*mods, x, tiled=True)
    loss.backward(retain_graph=True)
    loss.backward()
    _assert_close(_grads(mods, x), [2 * g for g in once])


class _FailOnce(torch.autograd.Function):
    """Identity whose first backward raises (a backward that fails midway)."""

    failed = False

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return t.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not _FailOnce.failed:
            _FailOnce.failed = True
            raise RuntimeError("failing on purpose")
        return g


def test_a_slot_left_by_a_failed_backward_is_not_added_to() -> None:
    """The first reader's gradient from a backward that raised before the producer's
    backward ran is dropped, not summed into the next backward's (rule 3)."""
    stem, a, b = _modules()
    x = torch.randn(1, 1, 10, 9, 8, dtype=torch.float64, requires_grad=True)

    def loss_of(tiled: bool) -> torch.Tensor:
        s = remat3d.tile(stem, x, tile=5, share_grads=True) if tiled else stem(x)
        # autograd runs the later reader ``b`` first (it adds into the slot), then ``a``,
        # which reads ``s`` through _FailOnce: that raises before the producer runs
        ya = remat3d.tile(a, _FailOnce.apply(s), tile=4) if tiled else a(_FailOnce.apply(s))
        yb = remat3d.tile(b, s, tile=3) if tiled else b(s)
        return (ya * ya).sum() + yb.sum()

    _reset([stem, a, b], x)
    _FailOnce.failed = True
    loss_of(False).backward()
    want = _grads([stem, a, b], x)
    _reset([stem, a, b], x)
    _FailOnce.failed = False
    loss = loss_of(True)
    with pytest.raises(RuntimeError, match="failing on purpose"):
        loss.backward(retain_graph=True)
    _reset([stem, a, b], x)
    loss.backward()
    _assert_close(_grads([stem, a, b], x), want)


def test_host_outputs_share_their_gradient_on_the_host() -> None:
    mods = _modules()
    x = torch.randn(1, 1, 10, 9, 8, dtype=torch.float64, requires_grad=True)
    want = _untiled(mods, x)
    _loss(*mods, x, tiled=True, host=True).backward()
    _assert_close(_grads(mods, x), want)


def _meta_peak(share: bool) -> int:
    stem, a, b = _modules(torch.float32, "meta")
    x = torch.empty(1, 1, 32, 32, 32, device="meta")
    with MemoryTracker("meta") as tracker:
        tracker.register(list(nn.ModuleList([stem, a, b]).parameters()), "param")
        tracker.register(x, "input")
        s = remat3d.tile(stem, x, tile=8, share_grads=share)
        y = remat3d.tile(a, s, tile=8) * 2 + nn.functional.interpolate(
            remat3d.tile(b, s, tile=8), scale_factor=2)
        tracker.phase = "backward"
        y.backward(torch.ones_like(y))
    return tracker.peak_bytes


def test_on_meta_the_readers_hold_one_gradient_of_the_shared_output_not_two() -> None:
    """The measured peak is lower by at least one whole gradient of the stem's output
    (the readers' second one, and autograd's sum of the two)."""
    skip = 6 * 32 ** 3 * 4
    assert _meta_peak(False) - _meta_peak(True) >= skip


class _Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.a, self.b = _modules()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        return self.a(s) * 2 + nn.functional.interpolate(self.b(s), scale_factor=2)


def test_a_plan_tiles_with_shared_gradients() -> None:
    """A plan's tiled output carries a slot, and the planned step's gradients are the
    unplanned step's (float64)."""
    model = _Skip()
    x = torch.randn(1, 1, 12, 10, 8, dtype=torch.float64)
    model(x).square().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    remat3d.apply(model, Plan(regions=[Region(m, decision="tile", tile=[4, 5, 3])
                                       for m in ("stem", "a", "b")]))
    slots = []
    model.stem.register_forward_hook(lambda mod, args, out: slots.append(grad_slot(out)))
    model(x).square().sum().backward()
    assert slots and isinstance(slots[0], GradSlot)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want[n], rtol=1e-9, atol=1e-10), n

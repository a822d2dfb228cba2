"""Reversible couplings and sequences: gradients, memory, norms, RNG, autocast, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat3d
from remat3d.nn import (
    AdditiveCoupling,
    AffineCoupling,
    ReversibleBlock,
    ReversibleError,
    ReversibleSequence,
)
from tests.nn.nets import half, max_relative_error, ordinary, sequence, step


@pytest.mark.parametrize("affine", [False, True])
def test_gradients_match_the_ordinary_network_at_depth_16(affine):
    torch.manual_seed(0)
    seq = sequence(16, channels=4, affine=affine)
    x = torch.randn(1, 4, 32, 32, 32) if not affine else torch.randn(1, 4, 16, 16, 16)
    y_ref, dx_ref, grads_ref = step(ordinary(seq), x)
    y, dx, grads = step(seq, x)
    assert torch.equal(y, y_ref)  # the forward is the same computation
    assert max_relative_error(dx_ref, dx) <= 1e-4
    assert max_relative_error(grads_ref, grads) <= 1e-4
    with torch.no_grad():
        assert max_relative_error(x, seq.inverse(seq(x))) <= 1e-4


def test_only_the_output_is_kept_so_saved_bytes_do_not_grow_with_depth():
    def net(depth, reversible):
        seq = sequence(depth, channels=8)
        seq.reversible = reversible
        return nn.Sequential(nn.Conv3d(1, 8, 3, padding=1), seq, nn.Conv3d(8, 2, 1))

    shape = (1, 1, 32, 32, 32)
    rev4, rev32 = (remat3d.measure(net(d, True), shape, device="meta") for d in (4, 32))
    ord4, ord32 = (remat3d.measure(net(d, False), shape, device="meta") for d in (4, 32))
    assert abs(rev32.saved_bytes - rev4.saved_bytes) <= 0.05 * rev4.saved_bytes
    assert rev4.saved_bytes == 8 * 32**3 * 4 + 4  # the output (+ the loss's scalar)
    assert ord32.saved_bytes > 6 * ord4.saved_bytes  # grows linearly: 8x the blocks
    # backward re-runs F and G once: labelled as recomputation by the tracker
    assert ord32.recompute_flops == 0
    assert rev32.recompute_flops > 0.9 * (ord32.forward_flops - ord4.forward_flops)
    assert rev32.peak_bytes < ord32.peak_bytes / 5


def test_meta_autocast_step_keeps_constant_saved_bytes():
    shape = (1, 8, 16, 16, 16)
    a, b = (remat3d.measure(sequence(d, channels=8), shape, device="meta", amp="bf16")
            for d in (2, 8))
    assert a.saved_bytes == b.saved_bytes


@pytest.mark.parametrize("affine", [False, True])
def test_batchnorm_statistics_are_updated_once_per_step(affine):
    torch.manual_seed(0)
    seq = sequence(3, channels=4, norm="batch", affine=affine)
    twin = copy.deepcopy(seq)
    x = torch.randn(2, 4, 8, 8, 8)
    _, dx_ref, grads_ref = step(ordinary(twin), x)
    _, dx, grads = step(seq, x)
    for (name, a), b in zip(twin.named_buffers(), seq.buffers()):
        assert torch.equal(a, b), name
    assert max_relative_error(dx_ref, dx) <= 1e-4
    bns = [m for m in seq.modules() if isinstance(m, nn.BatchNorm3d)]
    assert bns and all(int(m.num_batches_tracked) == 1 for m in bns)
    assert max_relative_error(grads_ref, grads) <= 1e-4


def test_in_place_activations_inside_F_and_G():
    torch.manual_seed(0)
    seq = sequence(4, channels=4, norm="instance", inplace=True)
    x = torch.randn(1, 4, 8, 8, 8)
    _, dx_ref, grads_ref = step(ordinary(seq), x)
    _, dx, grads = step(seq, x)
    assert max_relative_error(dx_ref, dx) <= 1e-4
    assert max_relative_error(grads_ref, grads) <= 1e-4


def test_F_writing_into_its_input_is_a_clear_error():
    F = nn.Sequential(nn.ReLU(inplace=True), nn.Conv3d(2, 2, 3, padding=1))
    seq = ReversibleSequence(AdditiveCoupling(F, nn.Conv3d(2, 2, 3, padding=1)))
    with pytest.raises(ReversibleError, match=r"F of .* wrote in place into its input"):
        seq(torch.randn(1, 4, 4, 4, 4, requires_grad=True))


def test_dropout_masks_are_replayed_and_the_rng_stream_is_untouched():
    torch.manual_seed(0)
    seq = sequence(4, channels=4, dropout=0.3)
    x = torch.randn(1, 4, 8, 8, 8)
    _, dx_ref, grads_ref = step(ordinary(seq), x, seed=7)
    after_ordinary = torch.get_rng_state()
    _, dx, grads = step(seq, x, seed=7)
    assert torch.equal(torch.get_rng_state(), after_ordinary)  # backward drew nothing new
    assert max_relative_error(dx_ref, dx) <= 1e-4
    assert max_relative_error(grads_ref, grads) <= 1e-4
    # different masks would give very different gradients
    _, dx_other, _ = step(seq, x, seed=8)
    assert max_relative_error(dx_ref, dx_other) > 0.1


def test_autocast_bf16_on_cpu():
    torch.manual_seed(0)
    seq = sequence(4, channels=8)
    x = torch.randn(2, 8, 12, 12, 12)
    _, _, grads32 = step(ordinary(seq), x)
    y16_ref, dx16_ref, grads16_ref = step(ordinary(seq), x, amp=True)
    y16, dx16, grads16 = step(seq, x, amp=True)
    # The same ops in forward; the fp32 residual stream (x1 + bf16 F(x2) is fp32) keeps
    # reconstruction errors at fp32 rounding, but a rebuilt input may round to a
    # neighbouring bf16 value inside F: a few bf16 ulps (2^-8 = 4e-3) at worst.
    assert y16.dtype == torch.float32 and torch.equal(y16, y16_ref)
    assert max_relative_error(grads16_ref, grads16) <= 1e-2
    assert max_relative_error(dx16_ref, dx16) <= 1e-2
    # Against fp32: autocast's own error (about 1.5e-2 here), not more.
    own = max_relative_error(grads32, grads16_ref)
    assert max_relative_error(grads32, grads16) <= own + 1e-2


def test_as_a_checkpoint_region_and_with_checkpoint_regions_inside():
    torch.manual_seed(0)
    seq = sequence(3, channels=4, norm="batch", dropout=0.2)
    twin = copy.deepcopy(seq)
    x = torch.randn(2, 4, 8, 8, 8)

    class Around(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return remat3d.checkpoint(self.inner, x)

    _, dx_ref, grads_ref = step(ordinary(twin), x)
    _, dx, grads = step(Around(seq), x)
    assert max_relative_error(dx_ref, dx) <= 1e-4
    assert max_relative_error(grads_ref, {k.removeprefix("inner."): v
                                          for k, v in grads.items()}) <= 1e-4
    for a, b in zip(twin.buffers(), seq.buffers()):
        assert torch.equal(a, b)

    class Checkpointed(nn.Module):  # F and G are themselves recompute regions
        def __init__(self, body):
            super().__init__()
            self.body = body

        def forward(self, x):
            return remat3d.checkpoint(self.body, x)

    torch.manual_seed(0)
    blocks = [AdditiveCoupling(Checkpointed(half(2, norm="batch")),
                               Checkpointed(half(2, norm="batch"))) for _ in range(3)]
    inner = ReversibleSequence(*blocks)
    plain = copy.deepcopy(inner)
    _, dx_ref, grads_ref = step(ordinary(plain), x)
    _, dx, grads = step(inner, x)
    assert max_relative_error(dx_ref, dx) <= 1e-4
    assert max_relative_error(grads_ref, grads) <= 1e-4
    for a, b in zip(plain.buffers(), inner.buffers()):
        assert torch.equal(a, b)


def test_backward_is_a_recomputation():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(remat3d.is_recomputing())
            return x.sin()

    seq = ReversibleSequence(AdditiveCoupling(Probe(), nn.Identity()))
    seq(torch.randn(1, 2, 3, requires_grad=True)).sum().backward()
    assert seen == [False, True]
    assert not remat3d.is_recomputing()


def test_parameters_get_gradients_through_autograd_grad_and_frozen_inputs():
    torch.manual_seed(0)
    seq = sequence(2, channels=4)
    x = torch.randn(1, 4, 6, 6, 6)  # requires no grad: only the parameters do
    params = list(seq.parameters())
    grads = torch.autograd.grad(seq(x).square().sum(), params)
    assert all(p.grad is None for p in params)  # returned, not accumulated
    ref = torch.autograd.grad(ordinary(seq)(x).square().sum(), params)
    assert max_relative_error(dict(enumerate(ref)), dict(enumerate(grads))) <= 1e-4


def test_no_grad_and_eval_run_the_plain_forward():
    seq = sequence(2, channels=4, norm="batch").eval()
    x = torch.randn(1, 4, 6, 6, 6)
    with torch.no_grad():
        y = seq(x)
    assert torch.equal(y, ordinary(seq)(x).detach())


def test_F_that_changes_the_shape_is_a_clear_error():
    strided = nn.Conv3d(2, 2, 3, stride=2, padding=1)
    seq = ReversibleSequence(AdditiveCoupling(strided, nn.Identity()))
    with pytest.raises(ReversibleError, match=r"F of .*Conv3d.* must return a 1x2x8x8x8 "
                                              r"tensor .* returned 1x2x4x4x4"):
        seq(torch.randn(1, 4, 8, 8, 8, requires_grad=True))
    wider = AdditiveCoupling(nn.Identity(), nn.Conv3d(2, 3, 1))
    with pytest.raises(ReversibleError, match=r"G of .* returned 1x3x8x8x8"):
        wider(torch.randn(1, 4, 8, 8, 8))
    affine = AffineCoupling(nn.Conv3d(2, 2, 1), nn.Conv3d(2, 4, 1))
    with pytest.raises(ReversibleError, match=r"must return a 1x4x8x8x8 tensor"):
        affine(torch.randn(1, 4, 8, 8, 8))


def test_odd_channel_count_is_a_clear_error():
    seq = sequence(2, channels=4)
    with pytest.raises(ReversibleError, match="even channel count; got 5 channels"):
        seq(torch.randn(1, 5, 4, 4, 4, requires_grad=True))


def test_a_block_that_cannot_be_inverted_is_refused():
    with pytest.raises(ReversibleError, match="Block 1 .* is a Conv3d"):
        ReversibleSequence(AdditiveCoupling(nn.Identity(), nn.Identity()), nn.Conv3d(2, 2, 1))
    with pytest.raises(ReversibleError, match="at least one block"):
        ReversibleSequence()


def test_a_custom_reversible_block_uses_the_two_pass_default():
    class ScaleShift(ReversibleBlock):  # y = x * exp(s) + t, per channel
        def __init__(self, channels):
            super().__init__()
            self.s = nn.Parameter(0.1 * torch.randn(1, channels, 1, 1, 1))
            self.t = nn.Parameter(torch.randn(1, channels, 1, 1, 1))

        def forward(self, x, tape=None):
            return x * self.s.exp() + self.t

        def inverse(self, y, tape=None):
            return (y - self.t) * (-self.s).exp()

    torch.manual_seed(0)
    seq = ReversibleSequence(ScaleShift(4), *sequence(2, channels=4).blocks, ScaleShift(4))
    x = torch.randn(1, 4, 6, 6, 6)
    _, dx_ref, grads_ref = step(ordinary(seq), x)
    _, dx, grads = step(seq, x)
    assert max_relative_error(dx_ref, dx) <= 1e-4
    assert max_relative_error(grads_ref, grads) <= 1e-4


def test_writing_into_the_output_in_place_is_caught():
    seq = sequence(1, channels=4)
    y = seq(torch.randn(1, 4, 4, 4, 4, requires_grad=True))
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

"""The meta kernel cache: repeated functional ops skip their kernels, nothing else changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat3d
import remat3d.instrument.tracker as tracker_module
from remat3d.instrument.metacache import MetaKernelCache

aten = torch.ops.aten


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_a_repeated_functional_op_is_answered_with_the_kernels_metadata():
    cache = MetaKernelCache()
    x = _meta(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d)
    w = _meta(8, 3, 3, 3, 3)
    first = cache(aten.convolution.default, (x, w, None, [1] * 3, [1] * 3, [1] * 3, False,
                                             [0] * 3, 1), {})
    second = cache(aten.convolution.default, (x, w, None, [1] * 3, [1] * 3, [1] * 3, False,
                                              [0] * 3, 1), {})
    assert (cache.misses, cache.hits) == (1, 1)
    assert second.shape == first.shape and second.stride() == first.stride()
    assert second.dtype == first.dtype and second.device.type == "meta"
    assert second.untyped_storage()._cdata != first.untyped_storage()._cdata  # a fresh tensor
    # another stride, dtype or plain argument is another key
    cache(aten.convolution.default, (x.contiguous(), w, None, [1] * 3, [1] * 3, [1] * 3,
                                     False, [0] * 3, 1), {})
    cache(aten.convolution.default, (x, w, None, [2] * 3, [1] * 3, [1] * 3, False, [0] * 3,
                                     1), {})
    assert (cache.misses, cache.hits) == (3, 1)


def test_several_outputs_and_missing_ones_keep_their_places():
    cache = MetaKernelCache()
    g, x, w = _meta(2, 4, 3, 3, 3), _meta(2, 4, 3, 3, 3), _meta(4)
    mean, rstd = _meta(4), _meta(4)
    args = (g, x, w, None, None, mean, rstd, True, 1e-5, [True, False, True])
    a = cache(aten.native_batch_norm_backward.default, args, {})
    b = cache(aten.native_batch_norm_backward.default, args, {})
    assert cache.hits == 1 and isinstance(b, tuple) and len(b) == 3
    assert b[1] is None and a[1] is None
    assert [t.shape for t in (b[0], b[2])] == [t.shape for t in (a[0], a[2])]


@pytest.mark.parametrize("call", [
    lambda c, x: c(aten.view.default, (x, [6, 4]), {}),              # a view
    lambda c, x: c(aten.add.out, (x, x), {"out": x}),                # out=
    lambda c, x: c(aten.split.Tensor, (x, 1), {}),                   # views, listed
    lambda c, x: c(aten.bernoulli.default, (x,), {}),                # random
    lambda c, x: c(aten.bernoulli_.float, (x, 0.5), {}),             # random, in place
    lambda c, x: c(aten.unsqueeze_.default, (x, 0), {}),             # in-place view
    lambda c, x: c(aten.resize_.default, (x, [24]), {}),             # resizes
    lambda c, x: c(aten.set_.source_Tensor, (x, _meta(5)), {}),      # swaps storage
], ids=["view", "out", "split", "random", "random_", "unsqueeze_", "resize_", "set_"])
def test_ops_that_alias_mutate_or_draw_are_never_cached(call):
    cache = MetaKernelCache()
    x = _meta(2, 3, 4)
    call(cache, x)
    call(cache, x)
    assert len(cache) == 0 and cache.hits == 0


@pytest.mark.parametrize("func, extra", [
    (aten.leaky_relu_.default, (0.01,)), (aten.add_.Tensor, None), (aten.copy_.default, None),
    (aten.zero_.default, ())])
def test_a_repeated_in_place_op_returns_its_tensor_without_the_kernel(func, extra):
    """NOTE rule 5: the answer is the very tensor given, its metadata untouched."""
    cache = MetaKernelCache()
    x = _meta(2, 3, 4).transpose(0, 2)
    y = _meta(2, 3, 4).transpose(0, 2)
    args = (x, *((y,) if extra is None else extra))
    first = cache(func, args, {})
    again = (y, *((x,) if extra is None else extra))
    second = cache(func, again, {})
    assert first is x and second is y
    assert (cache.misses, cache.hits) == (1, 1)
    assert y.shape == (4, 3, 2) and y.stride() == (1, 4, 12)
    cache(func, (x.contiguous(), *args[1:]), {})  # another layout: another key
    assert (cache.misses, cache.hits) == (2, 1)


def test_only_plain_meta_tensors_under_no_other_mode_are_keyed():
    cache = MetaKernelCache()
    cpu = torch.ones(3)
    cache(aten.mul.Tensor, (cpu, cpu), {})
    assert len(cache) == 0  # real data

    seen = []

    class Below(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = _meta(3)
    cache(aten.mul.Tensor, (x, x), {})
    with Below():  # a mode below the caller must see every op
        cache(aten.mul.Tensor, (x, x), {})
    assert seen == [aten.mul.Tensor] and cache.hits == 0


def test_the_cache_is_bounded():
    cache = MetaKernelCache(limit=2)
    for n in range(1, 6):
        cache(aten.neg.default, (_meta(n),), {})
    assert len(cache) <= 2


def _unet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True),
                         nn.LeakyReLU(inplace=True), nn.Conv3d(4, 4, 3, padding=1),
                         nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv3d(4, 2, 1))


def test_a_tiled_meta_step_measures_the_same_with_and_without_the_cache(monkeypatch):
    plan = remat3d.Plan(regions=[remat3d.Region("0", decision="tile", tile=[4, 4, 4]),
                                 remat3d.Region("3", decision="tile", tile=[5, 5, 5])])

    def measured():
        model = _unet().to("meta")
        remat3d.apply(model, plan)
        # not cubic: rule 7 (NOTE [ Repeats on meta ]) books no tile from its axes swapped
        m = remat3d.measure(model, torch.empty(1, 1, 12, 12, 16, device="meta"),
                            device="meta", amp="bf16")
        return m.peak_bytes, m.flops, m.recompute_flops, m.breakdown

    cache = MetaKernelCache()
    monkeypatch.setattr(tracker_module, "META_KERNELS", cache)
    cached = measured()
    assert cache.hits > cache.misses  # the tiles repeat their ops
    monkeypatch.setattr(tracker_module, "META_KERNELS",
                        lambda func, args, kwargs: func(*args, **kwargs))
    assert measured() == cached

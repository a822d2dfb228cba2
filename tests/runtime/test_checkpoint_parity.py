"""``remat3d.checkpoint`` and applied plans where ``torch.utils.checkpoint`` works.

Each case runs the same computation three ways — unplanned, through
``torch.utils.checkpoint(use_reentrant=False)`` and through remat3d — and compares the
gradients (issue 19, point 1: each of these raised before).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat3d
from remat3d.errors import RecomputeDivergedError, Remat3dError

MODES = ["default", "ops"]


def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.SiLU(),
                         nn.Conv3d(3, 2, 3, padding=1), nn.Tanh())


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(1, 2, 6, 6, 6, requires_grad=True)


def _ours(mode: str) -> functools.partial:
    return functools.partial(remat3d.checkpoint, determinism_check=mode)


def _theirs(fn, *args, **kwargs):
    return torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)


def _grads(block: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]


def _clear(block: nn.Module, x: torch.Tensor) -> None:
    x.grad = None
    block.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mode", MODES)
def test_backward_twice_with_retain_graph(mode):
    block, x = _block(), _x()
    results = []
    for ck in (_theirs, _ours(mode)):
        _clear(block, x)
        loss = (ck(block, x) ** 2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        results.append(_grads(block, x))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("mode", MODES)
def test_autograd_grad_twice(mode):
    block, x = _block(), _x()
    out = []
    for ck in (_theirs, _ours(mode)):
        y = ck(block, x).sum()
        first = torch.autograd.grad(y, x, retain_graph=True)[0]
        second = torch.autograd.grad(y, x)[0]
        out.append((first, second))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("mode", MODES)
def test_double_backward_gradient_penalty(mode):
    block, x = _block(), _x()
    results = []
    for ck in (None, _theirs, _ours(mode)):
        _clear(block, x)
        y = (block(x) if ck is None else ck(block, x)).pow(2).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.pow(2).sum().backward()  # a gradient of the gradient
        results.append(_grads(block, x))
    for other in results[1:]:
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(results[0], other))
    assert all(torch.equal(a, b) for a, b in zip(results[1], results[2]))


def test_double_backward_through_an_applied_plan():
    net = nn.Sequential(_block(), nn.Conv3d(2, 2, 1))
    x = _x()
    y = net(x).pow(2).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    g.pow(2).sum().backward()
    want = _grads(net, x)
    _clear(net, x)
    remat3d.apply(net, remat3d.Plan(regions=[remat3d.Region("0")]))
    try:
        y = net(x).pow(2).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.pow(2).sum().backward()
    finally:
        remat3d.remove(net)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(want, _grads(net, x)))


def test_backward_twice_through_an_applied_plan():
    """retain_graph=True, then a second backward, through plan regions: twice the
    gradients, as without the plan."""
    net = nn.Sequential(_block(), nn.Conv3d(2, 2, 1), _block())
    x = _x()
    y = net(x).pow(2).sum()
    y.backward(retain_graph=True)
    y.backward()
    want = _grads(net, x)
    _clear(net, x)
    remat3d.apply(net, remat3d.Plan(regions=[remat3d.Region("0"), remat3d.Region("2")]))
    try:
        y = net(x).pow(2).sum()
        y.backward(retain_graph=True)
        y.backward()
    finally:
        remat3d.remove(net)
    assert all(torch.equal(a, b) for a, b in zip(want, _grads(net, x)))


def _hessian_vector(ck, block, x, v):
    y = (block(x) if ck is None else ck(block, x)).pow(2).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    return torch.autograd.grad((g * v).sum(), x)[0]


@pytest.mark.parametrize("mode", MODES)
def test_hessian_vector_product(mode):
    block, x = _block(), _x()
    v = torch.randn_like(x)
    want = _hessian_vector(_theirs, block, x, v)
    assert torch.equal(_hessian_vector(_ours(mode), block, x, v), want)


@pytest.mark.parametrize("children", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_region_whose_forward_runs_autograd_grad_over_nested_regions(mode, children):
    torch.manual_seed(0)
    inner = [nn.Linear(4, 4) for _ in range(children)]

    def body(ck, x):
        h = x
        for layer in inner:
            h = ck(layer, h).tanh()
        (g,) = torch.autograd.grad(h.sum(), x, create_graph=True)
        return (g * h).sum()

    torch.manual_seed(2)
    x = torch.randn(3, 4, requires_grad=True)
    results = []
    for ck in (_theirs, _ours(mode)):
        x.grad = None
        for layer in inner:
            layer.zero_grad(set_to_none=True)
        ck(functools.partial(body, ck), x).backward()
        results.append([x.grad.clone(), *(p.grad.clone() for m in inner
                                          for p in m.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("mode", MODES)
def test_record_function_inside_a_region(mode):
    block, x = _block(), _x()

    def profiled(t):
        with torch.autograd.profiler.record_function("block"):
            # the last op saves nothing: torch stops the recomputation inside the
            # context, whose exit then runs a profiler op
            return block(t) * 2

    results = []
    for ck in (_theirs, _ours(mode)):
        _clear(block, x)
        ck(profiled, x).sum().backward()
        results.append(_grads(block, x))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_torch_debug_mode_is_honoured_not_refused():
    block, x = _block(), _x()
    with torch.utils.checkpoint.set_checkpoint_debug_enabled(True):
        remat3d.checkpoint(block, x).sum().backward()
    assert x.grad is not None
    # torch's global setting is as it was inside and after
    assert torch.utils.checkpoint._checkpoint_debug_enabled is None


class _Diverging(nn.Module):
    """A block whose forward runs ``first`` on its first call and ``later`` after it: a
    forward that depends on a counter, as its recomputation sees it."""

    def __init__(self, first, later):
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 3, padding=1)
        self.pool = nn.MaxPool3d(2)
        self.calls = 0
        self.first, self.later = first, later

    def forward(self, x):
        self.calls += 1
        return (self.first if self.calls == 1 else self.later)(self, x)


def _flaky() -> _Diverging:
    """Same shapes, another op, in the recomputation."""
    return _Diverging(lambda m, x: m.conv(x), lambda m, x: m.conv(x * 2))


def test_diverging_recomputation_names_the_op_and_module():
    from remat3d.instrument.state import register_module_names

    model = nn.Sequential(_flaky())
    register_module_names(model)
    x = torch.randn(1, 1, 4, 4, 4, requires_grad=True)
    y = remat3d.checkpoint(model, x, name="flaky-block", determinism_check="ops")
    with pytest.raises(RecomputeDivergedError) as info:
        y.sum().backward()
    text = str(info.value)
    assert "flaky-block" in text and "op #0" in text and "aten.mul" in text
    assert "aten.convolution" in text and "module '0'" in text


def test_determinism_check_none_is_off_and_debug_compares_ops():
    x = torch.randn(1, 1, 4, 4, 4, requires_grad=True)
    remat3d.checkpoint(_flaky(), x, determinism_check="none").sum().backward()
    for kwargs in ({"debug": True}, {"determinism_check": "ops"}):
        y = remat3d.checkpoint(_flaky(), x, **kwargs)
        with pytest.raises(RecomputeDivergedError, match="aten.mul"):
            y.sum().backward()
    with pytest.raises(Remat3dError, match="determinism_check='sometimes'"):
        remat3d.checkpoint(_flaky(), x, determinism_check="sometimes")


def test_default_check_names_the_op_and_module_at_no_cost_per_op():
    from remat3d.instrument.state import register_module_names

    # another shape in the recomputation: it pools before its convolution
    model = nn.Sequential(_Diverging(lambda m, x: m.conv(x).relu(),
                                     lambda m, x: m.conv(m.pool(x)).relu()))
    register_module_names(model)
    x = torch.randn(1, 1, 4, 4, 4, requires_grad=True)
    y = remat3d.checkpoint(model, x, name="pooling-block")
    with pytest.raises(RecomputeDivergedError) as info:
        y.sum().backward()
    text = str(info.value)
    assert "pooling-block" in text and "saved tensor #1" in text  # #0: the input, equal
    assert "1x1x2x2x2 int64" in text and "aten.max_pool3d_with_indices" in text
    assert "module '0.pool'" in text and "determinism_check='ops'" in text


def test_default_check_names_a_recomputation_that_saves_fewer_tensors():
    x = torch.randn(1, 1, 4, 4, 4, requires_grad=True)
    shorter = _Diverging(lambda m, x: m.conv(x).sigmoid(), lambda m, x: m.conv(x))
    y = remat3d.checkpoint(shorter, x, name="short")
    with pytest.raises(RecomputeDivergedError, match="short.*fewer"):
        y.sum().backward()


def test_torch_options_are_accepted():
    block, x = _block(), _x()
    drop = nn.Sequential(block, nn.Dropout(0.5))
    ours = remat3d.checkpoint(drop, x, preserve_rng_state=False, use_reentrant=False,
                              early_stop=False)
    ours.sum().backward()
    with pytest.raises(Remat3dError, match="use_reentrant=True"):
        remat3d.checkpoint(block, x, use_reentrant=True)


def test_context_fn_is_entered_in_forward_and_recomputation():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.convs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.convs += func is torch.ops.aten.convolution.default
            return func(*args, **(kwargs or {}))

    modes = Count(), Count()
    block, x = _block(), _x()
    remat3d.checkpoint(block, x, context_fn=lambda: modes).sum().backward()
    assert (modes[0].convs, modes[1].convs) == (2, 2)
    with pytest.raises(Remat3dError, match="both an op policy and a context_fn"):
        remat3d.checkpoint(block, x, policy="save-compute-heavy", context_fn=lambda: modes)


def test_selective_checkpoint_context_fn_from_torch():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def keep_convs(ctx, func, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if func is torch.ops.aten.convolution.default
                else CheckpointPolicy.PREFER_RECOMPUTE)

    block, x = _block(), _x()
    results = []
    for ck in (_theirs, remat3d.checkpoint):
        _clear(block, x)
        ck(block, x, context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                  keep_convs)).sum().backward()
        results.append(_grads(block, x))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_keywords_named_like_remat3d_options_reach_the_function():
    def f(x, policy=1.0, offload=0.0, name=""):
        return x * policy + offload + len(name)

    x = torch.randn(3, requires_grad=True)
    y = remat3d.checkpoint(f, x, fn_kwargs={"policy": 2.0, "offload": 1.0, "name": "ab"})
    assert torch.equal(y, x * 2.0 + 1.0 + 2)
    # name= is the region's name, fn_kwargs' name is f's
    y = remat3d.checkpoint(f, x, name="region", fn_kwargs={"name": "abc"})
    assert torch.equal(y, x + 3)
    with pytest.raises(Remat3dError, match="given both directly and in fn_kwargs"):
        remat3d.checkpoint(lambda t, scale: t * scale, x, scale=2.0,
                           fn_kwargs={"scale": 3.0})


def test_an_applied_plan_runs_under_inference_mode():
    """nnU-Net validates and predicts under torch.inference_mode(): a planned network gives
    the unplanned outputs there (inference tensors have no version counter to check)."""
    net = nn.Sequential(_block(), nn.Conv3d(2, 2, 1), _block())
    x = _x().detach()
    with torch.inference_mode():
        want = net(x)
    remat3d.apply(net, remat3d.Plan(regions=[remat3d.Region("0"), remat3d.Region("2")]))
    try:
        with torch.inference_mode():
            got = net(x)
        assert torch.equal(got, want)
        with torch.inference_mode():
            assert torch.equal(remat3d.checkpoint(net[1], x), net[1](x))
    finally:
        remat3d.remove(net)


@pytest.mark.parametrize("mode", MODES)
def test_selective_cache_is_freed_with_the_graph_and_after_backward(mode):
    """PyTorch's ``test_sac_storage_lifetime``, through ``remat3d.checkpoint``: with the
    cyclic collector off, a kept op output in the selective-checkpoint cache is gone once
    the graph is gone without backward, and once backward consumed it (retain_graph
    too). A reference cycle (region -> its saves' count -> the region's method) kept it
    until the collector happened to run: memory no budget counted."""
    import gc
    import weakref

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils.checkpoint import CheckpointPolicy, _CachingTorchDispatchMode

    cached: list[weakref.ref] = []

    def fn(x):
        out = x.cos().exp()
        for caching in _get_current_dispatch_mode_stack():
            if isinstance(caching, _CachingTorchDispatchMode):
                (entry,) = [e for key, per_op in caching.storage.items()
                            if "exp" in str(key) for e in per_op.values()]
                assert not entry.val.requires_grad  # detached: no cycle through the graph
                cached.append(weakref.ref(entry.val))
        return out.sin()

    def must_save(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    enabled = gc.isenabled()
    gc.disable()
    try:
        out = _ours(mode)(fn, torch.randn(3, requires_grad=True), policy=must_save)
        assert cached[-1]() is not None
        del out
        assert cached[-1]() is None
        out = _ours(mode)(fn, torch.randn(3, requires_grad=True), policy=must_save)
        assert cached[-1]() is not None
        out.sum().backward(retain_graph=True)
        assert cached[-1]() is None
    finally:
        if enabled:
            gc.enable()

"""Plans measured with the tracker: they change memory, as intended."""

from __future__ import annotations

import gc

import torch

import remat3d
from remat3d import Plan, Region, zoo
from remat3d.runtime.offload import OffloadHooks

from .exactness import train_step


def _block_plan(graph, **kw):
    return Plan(regions=[Region(n, **kw) for n in dict.fromkeys(b.name for b in graph.blocks())])


def test_per_block_plan_on_nnunet_cuts_saved_bytes_fourfold_and_recomputes_once():
    model = zoo.build_model("nnunet")
    x = torch.randn(1, 1, 64, 64, 64)
    base = remat3d.measure(model, x, device="meta")
    graph = remat3d.profile(model, tuple(x.shape)).graph
    remat3d.apply(model, _block_plan(graph))
    planned = remat3d.measure(model, x, device="meta")
    assert base.saved_bytes >= 4 * planned.saved_bytes, (base.saved_bytes, planned.saved_bytes)
    assert planned.recompute_flops > 0 and base.recompute_flops == 0
    train_step(model, x)  # a real CPU step with the plan
    report = remat3d.report(model)
    assert len(report.regions) == 11  # 6 encoder blocks, 5 decoder (up) blocks
    assert all((r.forward_runs, r.recomputes) == (1, 1) for r in report.regions), str(report)


def test_offload_on_meta_frees_device_memory():
    model = zoo.build_model("unet", device="meta")
    shape = (1, 1, 64, 64, 64)
    base = remat3d.measure(model, shape, device="meta")
    graph = remat3d.profile(model, shape).graph
    remat3d.apply(model, _block_plan(graph, decision="offload"))
    planned = remat3d.measure(model, shape, device="meta")
    assert planned.saved_bytes < base.saved_bytes / 2
    assert planned.recompute_flops == 0


def test_meta_offload_holds_the_prefetched_copies_as_cuda_does():
    """On CUDA the first unpack of a region's tensors copies the previous region's back
    early; the meta step makes those copies at the same moment (NOTE [ Offload paths ]),
    so a verified offload plan's peak includes them."""
    prefetch: dict = {}
    first, second = (OffloadHooks(min_bytes=0, group=g, prefetch=prefetch) for g in (1, 2))
    a, b = torch.empty(1 << 20, device="meta"), torch.empty(1 << 21, device="meta")
    packed_a, packed_b = first._pack(a), second._pack(b)
    assert packed_a.prefetched is None
    second._unpack(packed_b)
    early = packed_a.prefetched
    assert early is not None and early.shape == a.shape and early.device.type == "meta"
    assert first._unpack(packed_a) is early and packed_a.prefetched is None

    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(512, 512),
                                                      torch.nn.Tanh()) for _ in range(3)))
    plan = Plan(regions=[Region(str(i), decision="offload") for i in range(3)],
                offload_min_bytes=0)
    remat3d.apply(model, plan)
    with_prefetch = remat3d.measure(model, (4096, 512), device="meta").peak_bytes
    without = OffloadHooks._prefetch
    try:
        OffloadHooks._prefetch = lambda self, group: None  # type: ignore[method-assign]
        no_prefetch = remat3d.measure(model, (4096, 512), device="meta").peak_bytes
    finally:
        OffloadHooks._prefetch = without  # type: ignore[method-assign]
    # the last region's backward runs while the middle region's tensors are back: its
    # Tanh output and Linear input (4096x512 fp32 each)
    assert with_prefetch - no_prefetch >= 2 * 4096 * 512 * 4, (with_prefetch, no_prefetch)


def test_the_measured_peak_does_not_depend_on_the_garbage_collector():
    """Nothing a plan's step makes may live in a reference cycle: its tensors would then be
    freed whenever Python's cyclic collector happens to run, and the same plan would verify
    at another peak each time (rebuild recipes once listed themselves in their own
    chain: 50.6 MB with the collector off, 50.3 MB with it on, for this plan)."""
    # PyTorch's default kernels: the deterministic trilinear upsampling's own spike would
    # hide the difference (the suite's fixture restores the setting)
    torch.use_deterministic_algorithms(False)
    shape = (1, 1, 32, 32, 32)
    model = zoo.build_model("segresnet", device="meta")
    plan = Plan(regions=[Region(m, decision="offload") for m in
                         ("convInit.conv", "up_samples.0.0.conv", "up_samples.1.0.conv",
                          "up_samples.2.0.conv", "conv_final.2.conv")])
    remat3d.apply(model, plan)
    threshold = gc.get_threshold()
    peaks = []
    try:
        for collect in (False, True, False):
            gc.collect()
            if collect:
                gc.enable()
                gc.set_threshold(1)  # collect at almost every allocation
            else:
                gc.disable()
            peaks.append(remat3d.measure(model, shape, device="meta").peak_bytes)
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
    assert len(set(peaks)) == 1, peaks


def test_host_budget_limits_offload():
    model = zoo.build_model("unet")
    x = torch.randn(2, 1, 32, 32, 32)
    graph = remat3d.profile(model, tuple(x.shape)).graph
    plan = _block_plan(graph, decision="offload")
    plan.offload_min_bytes = 0
    plan.host_budget_bytes = 100_000
    remat3d.apply(model, plan)
    train_step(model, x)
    report = remat3d.report(model)
    assert 0 < report.host_peak_bytes <= 100_000
    assert sum(r.kept_bytes for r in report.regions) > 0


def test_bf16_storage_halves_offloaded_bytes_and_stays_close():
    torch.manual_seed(0)
    model = zoo.build_model("basicunet")
    x = torch.randn(1, 1, 32, 32, 32)
    reference = train_step(model, x)
    graph = remat3d.profile(model, tuple(x.shape)).graph
    plan = _block_plan(graph, decision="keep", storage_dtype="bfloat16")
    remat3d.apply(model, plan)
    got = train_step(model, x)
    # relative to all gradients together: a conv bias before a norm has a near-zero grad
    want = torch.cat([g.flatten() for g in reference[1].values()])
    have = torch.cat([got[1][n].flatten() for n in reference[1]])
    assert float((have - want).norm() / want.norm()) < 0.02
    assert any(not torch.equal(got[1][n], g) for n, g in reference[1].items())

"""The tracker: storages counted once, frees subtracted, backward and modules attributed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat3d.instrument.ledger import allocation_bytes
from remat3d.instrument.tracker import PEAK_CATEGORIES, MemoryTracker


def test_views_share_storage_and_cost_nothing():
    with MemoryTracker("meta") as tr:
        x = torch.empty(1024, device="meta")
        live = tr.live()
        views = [x.view(32, 32), x[::2], x.reshape(4, 256), x.t() if x.dim() == 2 else x,
                 x.detach(), x.unsqueeze(0).expand(3, 1024), x.as_strided((10,), (2,))]
        assert tr.live() == live == 4096
        del views


def test_inplace_ops_allocate_nothing():
    with MemoryTracker("cpu") as tr:
        x = torch.zeros(256)
        before = tr.live()
        x.add_(1)
        torch.relu_(x)
        x.mul_(2).clamp_(max=3)
        assert tr.live() == before


def test_freed_tensors_are_subtracted_and_peak_is_kept():
    with MemoryTracker("meta") as tr:
        a = torch.empty(1000, device="meta")
        b = torch.empty(1000, device="meta")
        assert tr.live() == 8000
        del a
        assert tr.live() == 4000
        c = b + 1
        del b, c
        assert tr.live() == 0
    assert tr.peak_bytes == 8000


def test_resized_storage_is_reread():
    with MemoryTracker("cpu") as tr:
        x = torch.empty(0)
        x.resize_(100)
        assert tr.live() == 400
        y = torch.empty(0)
        torch.add(torch.ones(200), 1, out=y)  # an out= op grows its argument's storage
        assert tr.live() == 400 + 800  # the temporary ones(200) is already freed


def test_devices_are_tracked_separately():
    with MemoryTracker("meta") as tr:
        a = torch.empty(100, device="meta")
        b = torch.empty(100)  # cpu: not the tracked device
        assert tr.live() == 400
        assert tr.ledger.live_bytes["cpu"] == 400
        del a, b


def test_cuda_allocations_round_to_blocks():
    assert allocation_bytes(1, "cuda") == 512
    assert allocation_bytes(513, "cuda") == 1024
    assert allocation_bytes(513, "cpu") == 513


class TwoCalls(nn.Module):
    """One conv module called twice, and a functional op in the parent."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.conv(self.conv(x)) * 2)


def _step(model, x, device="cpu"):
    tr = MemoryTracker(device, model)
    tr.register_model(model)
    tr.register(x, "input")
    with tr:
        loss = model(x).sum()
        tr.mark_forward_end()
        tr.phase = "backward"
        loss.backward()
        del loss
    tr.mark_gradients(list(model.parameters()))
    tr.invocations.remove()
    return tr


def test_invocations_forward_and_backward_attribution():
    model = TwoCalls()
    x = torch.randn(1, 2, 8, 8, 8, requires_grad=True)
    tr = _step(model, x)
    invs = tr.invocations.invocations
    assert [(i.name, i.call_index) for i in invs] == [
        ("", 0), ("conv", 0), ("conv", 1), ("act", 0)]
    assert invs[1].parent == 0 and invs[2].parent == 0 and invs[1].depth == 1
    conv_ids = {1, 2}
    fwd = [e for e in tr.timeline if e.phase == "forward" and e.op.startswith("convolution")]
    assert {e.node for e in fwd} == conv_ids
    bwd = [e for e in tr.timeline if e.phase == "backward" and "convolution_backward" in e.op]
    assert len(bwd) == 2 and {e.node for e in bwd} == conv_ids
    # the functional multiply in the parent's forward belongs to the parent
    assert any(e.node == 0 and e.op.startswith("mul") for e in tr.timeline)
    # each conv call's forward and backward FLOPs are its own
    assert tr.node_flops[(1, "forward")] == tr.node_flops[(2, "forward")] > 0
    assert tr.node_flops[(1, "backward")] == 2 * tr.node_flops[(1, "forward")]


def test_breakdown_sums_to_peak_and_labels_gradients():
    model = TwoCalls()
    x = torch.randn(1, 2, 8, 8, 8)
    tr = _step(model, x)
    split = tr.peak_breakdown()
    assert set(split) == set(PEAK_CATEGORIES)
    assert sum(split.values()) == tr.peak_bytes
    assert split["parameters"] == sum(p.numel() * 4 for p in model.parameters())
    assert split["inputs"] == x.numel() * 4
    # after backward the live gradients are exactly the parameters' .grad tensors
    grads = [tr.ledger.lookup(p.grad) for p in model.parameters()]
    assert all(g is not None and g.category == "grad" for g in grads)


def test_peak_tensors_are_the_peaks_storages_with_their_makers():
    model = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 2, 1))
    x = torch.randn(1, 1, 8, 8, 8)
    tr = _step(model, x)
    every = tr.peak_tensors(limit=1000)
    assert sum(t.nbytes for t in every) == tr.peak_bytes  # no booked repeat here
    assert [t.nbytes for t in every] == sorted((t.nbytes for t in every), reverse=True)
    assert tr.peak_tensors(limit=3) == every[:3]
    split = tr.peak_breakdown()
    for category in PEAK_CATEGORIES:
        assert sum(t.nbytes for t in every if t.category == category) == split[category]
    # the ReLU's saved result, 4 channels of 8³ floats, made by it in forward
    assert any(t.nbytes == 4 * 8**3 * 4 and t.made_by == "1" and t.phase == "forward"
               and t.category == "saved" for t in every)
    assert any(t.category == "inputs" and t.made_by is None and t.phase == "setup"
               for t in every)


def test_measure_reports_the_peaks_largest_tensors():
    import remat3d

    model = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.ReLU())
    m = remat3d.measure(model, torch.randn(1, 1, 8, 8, 8))
    assert 0 < len(m.peak_tensors) <= 12
    assert m.peak_tensors[0].nbytes == max(t.nbytes for t in m.peak_tensors)
    assert sum(t.nbytes for t in m.peak_tensors) <= m.peak_bytes


def test_saved_bytes_are_what_autograd_keeps():
    model = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.ReLU())
    x = torch.randn(1, 1, 8, 8, 8)
    tr = _step(model, x)
    relu_out = 4 * 8**3 * 4  # ReLU saves its result; conv saves x and weight (not counted)
    loss = 4
    assert tr.saved_bytes == relu_out + loss


def test_recomputation_is_its_own_phase():
    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.ReLU())

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)

    model = Ckpt()
    x = torch.randn(1, 1, 8, 8, 8, requires_grad=True)
    tr = _step(model, x)
    recomputed = [i for i in tr.invocations.invocations if i.phase == "recompute"]
    assert [i.name for i in recomputed] == ["block", "block.0", "block.1"]
    assert tr.flops["recompute"] == tr.flops["forward"] > 0
    assert any(e.phase == "recompute" for e in tr.timeline)


def test_flops_agree_with_flop_counter_mode():
    """op_flops hands the registry's formulas shapes itself (no tree_map): the counts stay
    FlopCounterMode's, forward and backward, for convolutions, matmuls and attention."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    def step(device: str) -> None:
        x = torch.randn(2, 3, 8, 8, 8, device=device, requires_grad=True)
        conv = nn.Conv3d(3, 4, 3, padding=1).to(device)
        q = torch.randn(1, 2, 16, 8, device=device, requires_grad=True)
        w = torch.randn(8, 5, device=device, requires_grad=True)
        y = conv(x).sum() + F.scaled_dot_product_attention(q, q, q).sum() + (q @ w).sum()
        y = y + torch.addmm(w[:1], torch.randn(3, 8, device=device), w).sum()
        y.backward()

    with FlopCounterMode(display=False) as counter:
        step("meta")
    with MemoryTracker("meta") as tracker:
        step("meta")
    assert sum(tracker.flops.values()) == counter.get_total_flops() > 0


def test_map_leaves_is_tree_map_for_op_arguments():
    from collections import namedtuple

    from torch.utils._pytree import tree_map

    from remat3d.instrument.tensors import map_leaves

    pair = namedtuple("pair", "a b")
    t = torch.zeros(2)
    for value in ((t, [1, (t, 2.0)], {"k": t, "s": torch.Size([3])}),
                  [pair(t, 1), {"p": pair(2, t)}], None):
        got = map_leaves(lambda v: ("T", v.shape) if isinstance(v, torch.Tensor) else v, value)
        want = tree_map(lambda v: ("T", v.shape) if isinstance(v, torch.Tensor) else v, value)
        assert got == want and type(got) is type(want)


def test_a_failing_plan_leaves_the_garbage_collector_as_it_was():
    import gc

    import remat3d
    from remat3d.errors import Remat3dError

    before = gc.get_threshold()
    net = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 1, 1))
    with pytest.raises(Remat3dError):
        remat3d.plan(net, (1, 1, 8, 8, 8), budget="1B", tile=False)
    assert gc.get_threshold() == before


def test_rarer_full_collections_nest_and_overlap_across_threads():
    """The threshold is process-wide: blocks that overlap (nested, or in two threads that
    leave in the other order) put back what the first found when the last leaves."""
    import gc
    import threading

    from remat3d.instrument.step import rare_full_collections

    before = gc.get_threshold()
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with rare_full_collections():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with rare_full_collections():
        raised = gc.get_threshold()
        assert raised[2] >= 1000 and raised[:2] == before[:2]
        thread.start()
        assert entered.wait(10)
        with rare_full_collections():
            assert gc.get_threshold() == raised
    assert gc.get_threshold() == raised  # the other thread is still inside
    release.set()
    thread.join(10)
    assert gc.get_threshold() == before


def test_a_tracker_stops_where_its_limits_are_passed_and_unwinds():
    # NOTE [ Bounded measurements ]: the peak or the FLOPs past a limit stop the step;
    # what it reports are lower bounds, and no dispatch mode is left behind
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from remat3d.instrument.tracker import LimitExceeded, stop_above

    def step() -> None:
        with MemoryTracker("meta"):
            a = torch.empty(1000, device="meta")   # 4000 B
            b = a @ torch.empty(1000, 10, device="meta")  # 20000 FLOPs, 40 B more
            del a, b

    with stop_above(peak_bytes=3999), pytest.raises(LimitExceeded) as stopped:
        step()
    assert stopped.value.what == "memory" and stopped.value.peak_bytes >= 4000
    with stop_above(flops=19999), pytest.raises(LimitExceeded) as stopped:
        step()
    assert stopped.value.what == "FLOP" and stopped.value.flops == 20000
    assert not _get_current_dispatch_mode_stack()
    with stop_above(peak_bytes=10**6, flops=10**6):
        step()  # within its limits: measured whole
    step()  # the limits are gone with their scope


def test_the_peak_phase_is_when_the_peak_was_reached():
    # what the planner reads of a verified step (Plan.verified_peak_phase): the peak in
    # forward, then a higher one in backward; recomputation in backward is backward
    with MemoryTracker("meta") as tracker:
        assert tracker.peak_phase() is None  # nothing yet: the starting state
        x = torch.empty(1024, device="meta")
        y = x * 2
        del y
        assert tracker.peak_phase() == "forward"
        tracker.phase = "backward"
        g = torch.empty(4096, device="meta")
        assert tracker.peak_phase() == "backward"
        del g, x

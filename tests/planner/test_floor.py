"""The convolution floor (``planner/liveness.py``, NOTE [ The recompute floor ]): a bound on
every untiled plan's peak read from the module profile, and ``remat3d.plan`` tiling under
it without capturing the step's graph."""

from __future__ import annotations

import logging

import pytest
import torch

import remat3d
from remat3d import planning
from remat3d.capture.joint import capture
from remat3d.errors import InfeasibleBudgetError
from remat3d.instrument.amp import amp_dtype
from remat3d.planner.liveness import Floor, convolution_floor, recompute_floor
from remat3d.planning import clear_plan_cache
from remat3d.profiling import profile
from tests.capture.nets import ParentConcat
from tests.tiling.test_fused import TinyUNet

SHAPE = (1, 1, 32, 32, 32)


def _unet() -> torch.nn.Module:
    from monai.networks.nets import UNet

    return UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1,
                norm="instance")


@pytest.mark.parametrize("amp", [None, "bf16"])
@pytest.mark.parametrize("make", [ParentConcat, _unet, TinyUNet],
                         ids=["parent-concat", "monai-unet", "tiny-unet"])
def test_the_convolution_floor_is_at_or_below_the_recompute_floor(make, amp) -> None:  # type: ignore[no-untyped-def]
    """Every tensor it counts is alive at that convolution's backward op in the captured
    graph, so the graph's floor (itself below every recompute set's peak) is at or above
    it; and it is a real bound, above the parameters alone."""
    torch.manual_seed(0)
    model = make()
    graph = profile(model, SHAPE, device="meta", amp=amp).graph
    conv = convolution_floor(graph, amp, trainable=True)
    floor = recompute_floor(capture(model, SHAPE, amp=amp_dtype(amp)).graph)
    assert graph.param_bytes < conv.bytes <= floor.bytes, (conv, floor)
    assert "Conv" in next(n.module_type for n in graph.nodes if n.name == conv.node)
    assert conv.bytes <= graph.peak_bytes


def test_a_model_with_frozen_parameters_has_no_convolution_floor() -> None:
    """A frozen convolution makes no input gradient; the bound does not hold, so it is 0."""
    model = ParentConcat()
    model.enc[0].weight.requires_grad_(False)
    graph = profile(model, SHAPE, device="meta").graph
    assert convolution_floor(graph, None, trainable=False) == Floor(0, "")
    assert convolution_floor(graph, None, trainable=True).bytes > 0


def test_under_the_convolution_floor_plan_tiles_without_capturing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The same plan as when the captured graph's floor decides, and no capture."""
    torch.manual_seed(0)
    net = TinyUNet()
    with pytest.raises(InfeasibleBudgetError) as info:
        remat3d.plan(net, SHAPE, budget=1)
    smallest = info.value.smallest_feasible_bytes
    graph = profile(net, SHAPE, device="meta").graph
    assert convolution_floor(graph, None, trainable=True).bytes * 0.97 > smallest

    clear_plan_cache()
    with monkeypatch.context() as patched:
        patched.setattr(planning, "convolution_floor", lambda *args: Floor(0, ""))
        captured = remat3d.plan(net, SHAPE, budget=smallest)
    clear_plan_cache()

    def no_capture(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the step's graph was captured")

    monkeypatch.setattr(planning, "capture", no_capture)
    uncaptured = remat3d.plan(net, SHAPE, budget=smallest)
    assert uncaptured.regions == captured.regions
    assert uncaptured.verified_peak_bytes == captured.verified_peak_bytes
    assert "the backward of" in uncaptured.notes[-1], uncaptured.notes
    assert "every recompute set holds" in captured.notes[-1], captured.notes


def test_an_infeasible_budget_skips_what_cannot_lower_its_smallest(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """``planning.py`` NOTE [ Which plan optimal chooses ] rule 2: under the floor the
    untiled searches and the graph's run only for the error's smallest peak; where tiling
    reached below the floor they cannot lower it, so they do not run (nor is the graph
    captured), and the later tiled search measures its layouts only until they pass the
    earlier one's smallest. The error names the same smallest as with the floor unknown."""
    torch.manual_seed(0)
    net = ParentConcat("instance")  # its spans and its modules are searched
    clear_plan_cache()
    with monkeypatch.context() as patched:
        patched.setattr(planning, "convolution_floor", lambda *args: Floor(0, ""))
        patched.setattr(planning, "recompute_floor", lambda *args: Floor(0, ""))
        with pytest.raises(InfeasibleBudgetError) as everything:
            remat3d.plan(net, SHAPE, budget=1)
    clear_plan_cache()

    def no_capture(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the step's graph was captured")

    monkeypatch.setattr(planning, "capture", no_capture)
    with caplog.at_level(logging.INFO, logger="remat3d.planning"), \
            pytest.raises(InfeasibleBudgetError) as skipping:
        remat3d.plan(net, SHAPE, budget=1)
    smallest = skipping.value.smallest_feasible_bytes
    assert smallest == everything.value.smallest_feasible_bytes
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("module plans without tiling skipped") for m in messages)
    verified = [m for m in messages if m.startswith("verifying a candidate plan")]
    assert verified and all("tiled" in m for m in verified), verified  # none untiled

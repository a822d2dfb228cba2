"""``remat3d.predict`` on every network of the exactness sweep: the untiled plan is the
model's own forward bit for bit; a plan that tiles is judged against float64 as tiled
training steps are (at most twice the untiled fp32 forward's error); labels equal the
untiled argmax except where the two top logits tie within that tolerance."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import remat3d
from remat3d.capture.forward import capture_forward
from remat3d.errors import InfeasibleBudgetError, InputShapeError, PlanError
from remat3d.planner.forward_tiles import plan_forward
from remat3d.predicting import measure_plan, plan_prediction
from remat3d.runtime.tiled_forward import run_plan

from .sweep import NETWORKS

# the classifiers: a global pooling reads their whole feature map, and at these sizes the
# untiled forward is their smallest plan
WHOLE = {"DenseNet", "ResNet"}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _volume(net) -> torch.Tensor:
    return torch.randn(1, *net.shape[1:])


def _reference(model, x):
    exact = copy.deepcopy(model).double().eval()
    model.eval()
    with torch.no_grad():
        return _first(model(x)), _first(exact(x.double()))


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)


@pytest.mark.parametrize("net", NETWORKS, ids=[n.name for n in NETWORKS])
def test_untiled_predict_is_the_forward_bitwise(net):
    model = net.build()
    x = _volume(net)
    plain, _ = _reference(model, x)
    model.train()
    out = remat3d.predict(model, x)
    assert model.training  # the caller's mode is restored
    assert torch.equal(out, plain)


def _tiled_plan(model, x, output="logits"):
    """A plan that tiles whatever it measures (the planner at 0.6x of its untiled bound, or
    its smallest plan), measured on meta: what these tests judge is the tiled executor's
    arithmetic, and on tiny volumes tiling need not save memory."""
    base = plan_prediction(model, x.shape, output=output)  # the untiled plan
    graph = base.capture.graph
    try:
        plan = plan_forward(graph, int(0.6 * base.plan.peak_bytes))
    except InfeasibleBudgetError as exc:
        plan = plan_forward(graph, exc.smallest_feasible_bytes)
    tiled = dataclasses.replace(base, plan=plan)
    tracker = measure_plan(tiled, model)
    tiled.verified_peak_bytes = tracker.peak_bytes
    tiled.verified_host_peak_bytes = tracker.host_peak_bytes
    return tiled


@pytest.mark.parametrize("net", NETWORKS, ids=[n.name for n in NETWORKS])
def test_tiled_predict_within_float64_tolerance(net):
    model = net.build()
    x = _volume(net)
    plain, exact = _reference(model, x)
    plan = _tiled_plan(model, x)
    assert plan.plan.tiled == (net.name not in WHOLE)
    # the planner's bound holds the measured peak (NOTE [ Tiled forward plans ] rule 3)
    assert plan.verified_peak_bytes <= plan.plan.peak_bytes
    assert plan.verified_peak_bytes <= plan.plan.budget_bytes
    out = remat3d.predict(model, x, plan=plan)
    assert _relative(out, exact) <= 2 * _relative(plain, exact) + 1e-6


@pytest.mark.parametrize("name", ["PlainConvUNet-instance", "SegResNet-batch", "UNet-group"])
def test_labels_equal_the_untiled_argmax_but_for_ties(name):
    (net,) = [n for n in NETWORKS if n.name == name]
    model = net.build()
    x = _volume(net)
    plain, exact = _reference(model, x)
    plan = _tiled_plan(model, x, output="labels")
    assert plan.plan.tiled
    labels = remat3d.predict(model, x, plan=plan)
    assert labels.dtype == torch.uint8 and labels.shape == (1, *x.shape[2:])
    expected = plain.argmax(1)
    differ = labels.long() != expected
    top2 = exact.topk(2, dim=1).values
    gap = (top2[:, 0] - top2[:, 1]) / exact.abs().max()
    tolerance = 2 * _relative(plain, exact) + 1e-6
    assert bool((gap[differ] <= 2 * tolerance).all()), int(differ.sum())


def test_budgets_are_of_the_measured_untiled_peak_and_hold():
    """"0.9x" is of the untiled forward's measured peak; the plan that runs measures within
    it; below the smallest feasible budget the error names one that plans."""
    (net,) = [n for n in NETWORKS if n.name == "PlainConvUNet-instance"]
    model = net.build()
    x = _volume(net)
    untiled = plan_prediction(model, x.shape)
    assert not untiled.plan.tiled and untiled.verified_peak_bytes == untiled.untiled_peak_bytes
    plan = plan_prediction(model, x.shape, budget="0.9x")
    assert plan.plan.tiled and plan.untiled_peak_bytes == untiled.verified_peak_bytes
    assert plan.verified_peak_bytes <= 0.9 * untiled.verified_peak_bytes
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_prediction(model, x.shape, budget="0.1x")
    smallest = info.value.smallest_feasible_bytes
    assert smallest < untiled.verified_peak_bytes
    assert plan_prediction(model, x.shape, budget=smallest).verified_peak_bytes <= smallest


def test_probabilities_are_float16_softmax():
    (net,) = [n for n in NETWORKS if n.name == "DynUNet-instance"]
    model = net.build()
    x = _volume(net)
    plain, _ = _reference(model, x)
    plan = _tiled_plan(model, x, output="probabilities")
    assert plan.plan.tiled
    probabilities = remat3d.predict(model, x[0], plan=plan)
    assert probabilities.dtype == torch.float16 and probabilities.shape == plain.shape[1:]
    expected = torch.softmax(plain.float(), 1)[0]
    assert (probabilities.float() - expected).abs().max() < 1e-3


def test_host_resident_tensors_are_exact():
    """A plan for a device with host memory beside it, run on the CPU: the host tensors'
    path (slices copied in, tiles copied out) computes what the device path does."""
    (net,) = [n for n in NETWORKS if n.name == "PlainConvUNet-instance"]
    model = net.build().eval()
    x = _volume(net)
    plain, exact = _reference(model, x)
    capture = capture_forward(model, tuple(x.shape))
    whole = plan_forward(capture.graph, 1 << 40).peak_bytes
    plan = plan_forward(capture.graph, int(whole * 0.37), host_separate=True)
    assert plan.host and plan.tiled
    with torch.no_grad():
        out = run_plan(capture, plan, model, x, torch.device("cpu"))
    assert _relative(out, exact) <= 2 * _relative(plain, exact) + 1e-6


def test_bad_input_is_one_clear_error():
    (net,) = [n for n in NETWORKS if n.name == "UNet-batch"]
    model = net.build()
    with pytest.raises(PlanError, match="Unknown output 'masks'"):
        remat3d.predict(model, _volume(net), output="masks")
    with pytest.raises(InputShapeError, match="not a tensor of shape 16x16"):
        remat3d.predict(model, torch.zeros(16, 16))
    with pytest.raises(InputShapeError, match=r"cannot run on a volume of shape 1x3x16x16x16"):
        remat3d.predict(model, torch.zeros(1, 3, 16, 16, 16))
    with pytest.raises(InfeasibleBudgetError, match="smallest feasible budget") as info:
        remat3d.predict(model, _volume(net), budget="1KiB")
    assert info.value.smallest_feasible_bytes > 1024
    plan = plan_prediction(model, (1, 1, 16, 16, 16))
    with pytest.raises(PlanError, match="is for 1x1x16x16x16"):
        remat3d.predict(model, torch.zeros(1, 1, 32, 32, 32), plan=plan)

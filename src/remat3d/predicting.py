"""``remat3d.predict``: the model's forward on a whole volume, within a device budget.

The forward is traced once on fake tensors (``capture/forward.py``), planned on plain data
(``planner/forward_tiles.py``), the plan verified on meta under the tracker (the measured
peak, not the planner's bound, is what the budget is checked against), then run
(``runtime/tiled_forward.py``). Where nothing is tiled the result is bit for bit the model's
own forward in ``eval()`` mode; where it is tiled, every voxel is computed from the same
whole-volume statistics, equal up to floating-point rounding.

NOTE [ Measured prediction plans ]
  1. Every peak is the tracker's, on meta: a budget of ``"0.5x"`` is half the untiled
     forward's measured peak, a plan runs only if its measured peak is within the budget,
     and the smallest feasible budget an error names is a plan's measured peak.
  2. The planner's bound (``planner/forward_tiles.py``) only steers the search: the
     planner's smallest plan is measured first; if it does not fit, no plan does, and the
     smaller of its and the untiled forward's measured peaks is the smallest feasible
     budget named (on a small volume the smallest plan can measure above the untiled
     forward). Otherwise the planner's goal is bisected (geometrically) between the
     largest goal whose plan fitted and the smallest that did not (at first: the smallest
     plan's and the untiled plan's), starting at the budget times the untiled plan's
     bound-to-measured ratio, for at most ``_TRIES`` plans or until one measures within
     10 % of the budget. The loosest plan that fitted runs: fewer, larger tiles and less
     host memory than the smallest.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat3d.capture.forward import ForwardCapture, capture_forward
from remat3d.errors import (
    CaptureError,
    InfeasibleBudgetError,
    InputShapeError,
    PlanError,
    quoted,
)
from remat3d.instrument.amp import amp_dtype
from remat3d.instrument.step import meta_copy, model_device
from remat3d.instrument.tracker import MemoryTracker
from remat3d.planner.forward_tiles import ForwardPlan, plan_forward
from remat3d.planning import resolve_budget
from remat3d.runtime.tiled_forward import run_plan
from remat3d.runtime.tiling.host import host_empty
from remat3d.units import format_bytes, format_shape, parse_amp

__all__ = ["OUTPUTS", "PredictionPlan", "measure_plan", "plan_prediction", "predict"]

OUTPUTS = ("logits", "probabilities", "labels")
_TRIES = 5  # plans measured per search after the smallest (NOTE)
_SLACK = 0.9  # a fitting plan measured below this share of the budget is loosened


@dataclass
class PredictionPlan:
    """What :func:`predict` runs: the traced forward, its plan, the verified peaks."""

    capture: ForwardCapture
    plan: ForwardPlan
    shape: tuple[int, ...]
    amp: str | None
    output: str
    device: torch.device
    verified_peak_bytes: int = 0
    verified_host_peak_bytes: int = 0
    untiled_peak_bytes: int = 0  # the untiled forward's, measured the same way

    @property
    def tiled_steps(self) -> int:
        """How many of the plan's steps run tile by tile."""
        return sum(1 for s in self.plan.steps if s.tiled(self.capture.graph))

    def summary(self) -> str:
        return (f"predict {self.capture.graph.model} on {format_shape(self.shape)} "
                f"({self.output}, amp {self.amp or 'none'}): {len(self.plan.steps)} steps, "
                f"{self.tiled_steps} tiled, {len(self.plan.host)} tensors in host memory; device "
                f"peak {format_bytes(self.verified_peak_bytes)} verified (untiled "
                f"{format_bytes(self.untiled_peak_bytes)}), host "
                f"{format_bytes(self.verified_host_peak_bytes)}")


def _post(output: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What follows the network, traced with it (run tile by tile)."""
    if output == "logits":
        return None
    if output == "probabilities":
        return lambda y: torch.softmax(y.float(), dim=1).to(torch.float16)

    def labels(y: torch.Tensor) -> torch.Tensor:
        dtype = torch.uint8 if y.shape[1] <= 256 else torch.int16
        return torch.argmax(y, dim=1, keepdim=True).to(dtype)

    return labels


def _check(volume_shape: tuple[int, ...], output: str) -> tuple[int, ...]:
    if output not in OUTPUTS:
        raise PlanError(f"Unknown output {output!r}: predict makes one of "
                        f"{', '.join(OUTPUTS)}.")
    if len(volume_shape) == 4:
        return (1, *volume_shape)
    if len(volume_shape) != 5:
        raise InputShapeError(
            f"predict takes a volume (C, D, H, W) or a batch (N, C, D, H, W), not a tensor "
            f"of shape {format_shape(volume_shape)}.")
    return volume_shape


def measure_plan(prediction: PredictionPlan, model: nn.Module, *,
                 every_tile: bool = False) -> MemoryTracker:
    """The plan run on meta under the tracker: its representative tiles (what its device
    and host peaks need), or ``every_tile`` (what its FLOPs need, halos included)."""
    meta_model = meta_copy(model)
    input_name = prediction.capture.gm.graph.find_nodes(op="placeholder")[-1].name
    shape = prediction.shape
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    device = torch.device("meta")
    tracker = MemoryTracker("meta")
    tracker.register(list(meta_model.parameters()) + list(meta_model.buffers()), "param")
    with tracker, torch.no_grad():
        if input_name in prediction.plan.host:  # made under the tracker: booked as host
            volume = host_empty(shape, dtype, device)
        else:
            volume = torch.empty(shape, dtype=dtype, device="meta")
            tracker.register([volume], "input")
        out = run_plan(prediction.capture, prediction.plan, meta_model, volume, device,
                       verify=not every_tile)
        del out
    return tracker


def plan_prediction(model: nn.Module, shape: tuple[int, ...], *, budget: str | int | None
                    = None, amp: str | None = None, output: str = "logits",
                    device: str | torch.device | None = None) -> PredictionPlan:
    """Plan :func:`predict` for a volume of ``shape`` and verify it on meta."""
    shape = _check(tuple(shape), output)
    amp = parse_amp(amp)
    dtype = amp_dtype(amp)
    where = torch.device(device) if device is not None else (model_device(model) or
                                                              torch.device("cpu"))
    fake_device = "cpu" if where.type == "meta" else str(where)
    try:
        capture = capture_forward(model, shape, device=fake_device, amp=dtype,
                                  post=_post(output))
    except CaptureError as exc:
        cause = exc.__cause__ or exc
        raise InputShapeError(
            f"{type(model).__name__} cannot run on a volume of shape {format_shape(shape)}: "
            f"{type(cause).__name__}: {quoted(cause)} Check the channel count and that each "
            "spatial size is a multiple of the network's total downsampling (pad the volume)."
        ) from exc
    host_separate = where.type != "cpu"

    def measured(plan: ForwardPlan) -> PredictionPlan:
        prediction = PredictionPlan(capture, plan, shape, amp, output, where)
        tracker = measure_plan(prediction, model)
        prediction.verified_peak_bytes = tracker.peak_bytes
        prediction.verified_host_peak_bytes = tracker.host_peak_bytes
        return prediction

    # "0.5x" is of the untiled forward's peak as the tracker measures it, like every peak
    whole = measured(plan_forward(capture.graph, 1 << 62, host_separate=host_separate))
    untiled = whole.verified_peak_bytes
    target = resolve_budget(budget if budget is not None else "1.0x", untiled, str(where))
    best = whole if untiled <= target else _search(capture.graph, target, whole, measured,
                                                   host_separate)
    best.untiled_peak_bytes = untiled
    return best


def _search(graph: Any, target: int, whole: PredictionPlan,
            measured: Callable[[ForwardPlan], PredictionPlan], host_separate: bool,
            ) -> PredictionPlan:
    """The loosest plan found whose measured peak is within ``target`` (NOTE [ Measured
    prediction plans ])."""
    try:  # the planner's smallest plan (NOTE rule 2)
        plan_forward(graph, 0, host_separate=host_separate)
        raise AssertionError("a forward plan within 0 bytes")
    except InfeasibleBudgetError as exc:
        lo = exc.smallest_feasible_bytes
    best = measured(plan_forward(graph, lo, host_separate=host_separate))
    if best.verified_peak_bytes > target:
        least = min(best.verified_peak_bytes, whole.verified_peak_bytes)
        raise InfeasibleBudgetError(
            f"No prediction plan of {graph.model} fits {format_bytes(target)}: the smallest "
            f"feasible budget is {format_bytes(least)} (untiled "
            f"{format_bytes(whole.verified_peak_bytes)}). Raise the budget"
            + (", or predict on a device with host memory to spill to." if not host_separate
               else "."),
            smallest_feasible_bytes=least, unplanned_peak_bytes=whole.verified_peak_bytes)
    hi = whole.plan.peak_bytes  # the untiled plan's goal: measured over the target
    # first guess: the budget in the planner's units, by the untiled plan's ratio
    goal = target * whole.plan.peak_bytes // max(whole.verified_peak_bytes, 1)
    for _ in range(_TRIES):
        if best.verified_peak_bytes >= _SLACK * target or hi - lo <= lo // 32:
            break
        if not lo < goal < hi:
            goal = math.isqrt(lo * hi)
        plan = plan_forward(graph, goal, host_separate=host_separate)
        candidate = measured(plan)
        if candidate.verified_peak_bytes <= target:
            best, lo = candidate, goal
        else:
            hi = goal
        goal = math.isqrt(lo * hi)
    return best


def predict(model: nn.Module, volume: torch.Tensor, *, budget: str | int | None = None,
            amp: str | None = None, output: str | None = None,
            device: str | torch.device | None = None, plan: PredictionPlan | None = None,
            progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """``model``'s forward (``eval()`` mode, no gradients) on the whole ``volume`` within
    ``budget`` of device memory.

    Args:
        volume: ``(C, D, H, W)`` or ``(N, C, D, H, W)``, on the CPU or the device.
        budget: ``"8GiB"``, ``"0.5x"`` (of the untiled forward's peak), bytes, or
            ``"auto"``; default: the untiled forward's peak.
        amp: ``"bf16"`` / ``"fp16"``: the forward under autocast's rules.
        output: ``"logits"`` (the model's output; the default), ``"probabilities"``
            (softmax over channels, float16) or ``"labels"`` (argmax over channels, uint8;
            int16 above 256 classes; no channel axis); with ``plan``, the plan's.
        device: where to compute (default: the model's).
        plan: a :func:`plan_prediction` for this volume's shape, to skip planning.
        progress: called as ``progress(done, total)`` after each of the plan's steps.

    Returns the output on the device, or in host memory where the plan keeps it there;
    a batch axis only if ``volume`` had one.

    For example ``remat3d.predict(model, ct, budget="8GiB", amp="bf16", output="labels")``.
    """
    if not isinstance(volume, torch.Tensor):
        raise InputShapeError(f"predict takes the volume as a tensor, not a "
                              f"{type(volume).__name__}.")
    batched = volume.dim() == 5
    output = output or (plan.output if plan is not None else "logits")
    shape = _check(tuple(volume.shape), output)
    if plan is None:
        plan = plan_prediction(model, shape, budget=budget, amp=amp, output=output,
                               device=device)
    elif plan.shape != shape or plan.output != output:
        raise PlanError(f"The prediction plan is for {format_shape(plan.shape)} "
                        f"({plan.output}), not {format_shape(shape)} ({output}).")
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), _no_autocast():
            out = run_plan(plan.capture, plan.plan, model, volume.reshape(shape),
                           plan.device, progress=progress)
    finally:
        model.train(training)
    if output == "labels":
        out = out.squeeze(1)
    return out if batched else out.squeeze(0)


@contextlib.contextmanager
def _no_autocast() -> Any:
    from remat3d.capture.joint import _without_ambient_autocast

    with _without_ambient_autocast():
        yield

"""Check that a plan leaves a training step's arithmetic unchanged, on real data.

One step without the plan and one with it, from the same weights, buffers and RNG state;
the loss, every gradient and every buffer (BatchNorm running statistics) are compared
bitwise. On CPU in fp32 with deterministic algorithms they must be equal: a plan changes
memory and time, never the math.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat3d.planspec import Plan

__all__ = ["GradientCheck", "check_plan_gradients"]


@dataclass
class GradientCheck:
    equal: bool                 # loss, every gradient and every buffer bitwise equal
    tensors: int                # gradients and buffers compared
    max_abs_difference: float   # 0.0 when equal
    worst: str | None = None    # the tensor with the largest difference
    # with measure=True: the tracker's peak and live bytes after each op, per step
    peaks: dict[str, int] = field(default_factory=dict)          # "unplanned", "planned"
    timelines: dict[str, list[int]] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.equal:
            return (f"gradient check: loss, {self.tensors} gradients and buffers bitwise equal "
                    "to the unplanned step")
        return (f"gradient check FAILED: largest difference {self.max_abs_difference:.3g} in "
                f"{self.worst}")


def check_plan_gradients(model: nn.Module, plan: Plan, inputs: torch.Tensor,
                         loss_fn: Callable[[Any], torch.Tensor],
                         autocast: Callable[[], Any] | None = None,
                         measure: bool = False) -> GradientCheck:
    """Run one step of a copy of ``model`` without and with ``plan``; compare bitwise.

    ``measure=True`` runs both steps under the memory tracker (it observes, never changes
    the arithmetic) and records their peaks and timelines.
    """
    from remat3d.instrument.tracker import MemoryTracker

    peaks: dict[str, int] = {}
    timelines: dict[str, list[int]] = {}
    import remat3d
    from remat3d.runtime.apply import is_applied

    if is_applied(model):
        raise remat3d.Remat3dError("check_plan_gradients needs the model without a plan "
                                   "applied; call remat3d.remove(model) first.")

    def step(planned: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        net = copy.deepcopy(model)
        if planned:
            remat3d.apply(net, plan)
        net.train()
        for p in net.parameters():
            p.grad = None
        torch.set_rng_state(rng)
        tracker = None
        if measure:
            tracker = MemoryTracker(inputs.device)
            tracker.register_model(net)
            tracker.register([inputs], "input")
        with tracker if tracker is not None else contextlib.nullcontext():
            output, loss = _loss(net)
            loss.backward()
            del output
        if tracker is not None:
            key = "planned" if planned else "unplanned"
            peaks[key] = tracker.peak_bytes
            timelines[key] = [e.live_after for e in tracker.timeline]
            tracker.close()
        tensors = {f"grad {n}": p.grad for n, p in net.named_parameters() if p.grad is not None}
        tensors.update({f"buffer {n}": b for n, b in net.named_buffers()})
        return loss.detach(), tensors

    def _loss(net: nn.Module) -> tuple[Any, torch.Tensor]:
        # the output held through backward, as in a training step (instrument/step.py,
        # NOTE [ What a step holds ])
        with autocast() if autocast is not None else contextlib.nullcontext():
            output = net(inputs)
        return output, loss_fn(output)

    rng = torch.get_rng_state()
    loss_a, plain = step(False)
    loss_b, planned = step(True)
    torch.set_rng_state(rng)
    worst, largest = None, 0.0
    equal = bool(torch.equal(loss_a, loss_b)) and plain.keys() == planned.keys()
    if not torch.equal(loss_a, loss_b):
        worst, largest = "loss", float((loss_a - loss_b).abs())
    for name, a in plain.items():
        b = planned.get(name)
        if b is None or not torch.equal(a, b):
            equal = False
            diff = float((a.float() - b.float()).abs().max()) if b is not None else float("inf")
            if diff >= largest:
                worst, largest = name, diff
    return GradientCheck(equal, len(plain), largest, worst, peaks, timelines)


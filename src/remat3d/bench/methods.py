"""The methods a bench compares, each turned into a model ready for one training step.

Names (the ``method`` field of a record):

==========================  ============================================================
``none``                    no checkpointing
``torch-blocks``            ``torch.utils.checkpoint`` around every block (``baselines``)
``checkpoint-sequential``   ``checkpoint_sequential`` on every outermost ``nn.Sequential``
``compile``                 ``torch.compile`` at ``activation_memory_budget`` (``compiled``)
``remat3d:<strategy>``      ``remat3d.plan(..., strategy=<strategy>)`` applied
``remat3d:optimal+offload`` ``remat3d.plan(..., strategy="optimal", offload=True)``
==========================  ============================================================
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

import torch
from torch import nn

from remat3d import zoo
from remat3d.errors import BudgetError, Remat3dError
from remat3d.planning import plan
from remat3d.planspec import Plan
from remat3d.runtime.apply import apply

__all__ = [
    "Planned",
    "build",
    "case_shape",
    "plan_method",
    "smallest_feasible",
]

log = logging.getLogger(__name__)
_SMALLEST = re.compile(r"smallest feasible budget is [^(]*\((\d+) bytes\)")


def case_shape(model: str, size: int) -> tuple[int, ...]:
    """``(1, C, s, s, s)`` made legal for the model (padded up to its divisor, min size)."""
    preset = zoo.get_preset(model)
    return zoo.legal_shape(preset, (1, preset.in_channels, size, size, size))


def build(model: str, shape: tuple[int, ...], device: str, kwargs: dict | None = None,
          seed: int = 0) -> nn.Module:
    """The zoo model; on CPU with weights from ``seed`` (same weights for every method)."""
    if device != "meta":
        torch.manual_seed(seed)
    return zoo.build_model(model, kwargs or {}, spatial_size=tuple(shape[2:]), device=device)


@dataclass
class Planned:
    plan: Plan
    seconds: float


def plan_method(net: nn.Module, shape: tuple[int, ...], amp: str | None, strategy: str,
                budget: int, offload: bool = False) -> Planned:
    """``remat3d.plan`` timed (raises ``BudgetError`` when infeasible)."""
    start = time.perf_counter()
    result = plan(net, shape, budget=budget, strategy=strategy, offload=offload, amp=amp)
    return Planned(result, time.perf_counter() - start)


def smallest_feasible(net: nn.Module, shape: tuple[int, ...], amp: str | None,
                      offload: bool) -> tuple[int, float]:
    """remat3d's smallest feasible budget (from its infeasible-budget error) and seconds."""
    start = time.perf_counter()
    try:
        plan(net, shape, budget=1, strategy="optimal", offload=offload, amp=amp)
    except BudgetError as exc:
        found = _SMALLEST.search(str(exc))
        if found is None:
            raise Remat3dError(f"remat3d.plan's infeasible-budget error names no smallest "
                               f"budget in bytes: {exc}") from exc
        return int(found.group(1)), time.perf_counter() - start
    raise Remat3dError("remat3d.plan accepted a budget of 1 byte; cannot find the smallest.")


def applied(net: nn.Module, result: Plan) -> nn.Module:
    """``net`` with the plan installed (the same object)."""
    return apply(net, result)

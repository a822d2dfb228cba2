"""The methods a bench compares, each turned into a model ready for one training step.

Names (the ``method`` field of a record):

==========================  ============================================================
``none``                    no checkpointing
``torch-blocks``            ``torch.utils.checkpoint`` around every block (``baselines``)
``checkpoint-sequential``   ``checkpoint_sequential`` on every outermost ``nn.Sequential``
``compile``                 ``torch.compile`` at ``activation_memory_budget`` (``compiled``)
``remat3d:<strategy>``      ``remat3d.plan(..., strategy=<strategy>)`` applied
``remat3d:optimal+offload`` ``remat3d.plan(..., strategy="optimal", offload=True)``
``remat3d:graph``           ``remat3d.plan(..., graph=True)`` (``meta_cases``)
``remat3d:graph:flops``     the same with ``objective="flops"``: FLOPs as torch.compile's
                            partitioner counts them (at torch.compile's peaks)
==========================  ============================================================
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from remat3d import zoo
from remat3d.errors import InfeasibleBudgetError, Remat3dError
from remat3d.planning import plan
from remat3d.planspec import Plan
from remat3d.runtime.fingerprint import model_signature

__all__ = [
    "Planned",
    "build",
    "case_shape",
    "check_model",
    "is_spec",
    "plan_method",
    "smallest_feasible",
]



def is_spec(model: str) -> bool:
    """A ``package.module:Class`` or ``.py`` model spec rather than a preset name."""
    return ":" in model or model.endswith(".py")


def case_shape(model: str, size: int, kwargs: dict | None = None) -> tuple[int, ...]:
    """``(1, C, s, s, s)``, for a preset made legal (padded up to its divisor, min size)."""
    if is_spec(model):
        return (1, int((kwargs or {}).get("in_channels", 1)), size, size, size)
    preset = zoo.get_preset(model)
    return zoo.legal_shape(preset, (1, preset.in_channels, size, size, size))


def check_model(model: str, kwargs: dict | None = None) -> None:
    """Raise ``ModelSpecError`` now for a model the bench could not build (with the suite's
    ``kwargs`` for it)."""
    if is_spec(model):
        zoo.build_model(model, kwargs or {}, device="meta")
    else:
        zoo.get_preset(model)


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
                budget: int, offload: bool = False, graph: bool | None = None) -> Planned:
    """``remat3d.plan`` timed (raises ``BudgetError`` when infeasible)."""
    start = time.perf_counter()
    result = plan(net, shape, budget=budget, strategy=strategy, offload=offload, amp=amp,
                  tile=False, graph=graph)
    return Planned(result, time.perf_counter() - start)


_SMALLEST_FOUND: dict[tuple, tuple[int, float]] = {}


def smallest_feasible(net: nn.Module, shape: tuple[int, ...], amp: str | None,
                      offload: bool) -> tuple[int, float]:
    """remat3d's smallest feasible budget without tiling (from its
    ``InfeasibleBudgetError``; the suites compare checkpointing methods) and the
    seconds the search took. Remembered per model structure, shape, amp and offload, so
    a CPU case at a sweep's size reuses the sweep's search (and ``plan``'s cached plan)."""
    key = (model_signature(net), tuple(shape), amp, offload)
    if key not in _SMALLEST_FOUND:
        _SMALLEST_FOUND[key] = _search_smallest(net, shape, amp, offload)
    return _SMALLEST_FOUND[key]


def _search_smallest(net: nn.Module, shape: tuple[int, ...], amp: str | None,
                     offload: bool) -> tuple[int, float]:
    start = time.perf_counter()
    try:
        plan(net, shape, budget=1, strategy="optimal", offload=offload, amp=amp, tile=False)
    except InfeasibleBudgetError as exc:
        return exc.smallest_feasible_bytes, time.perf_counter() - start
    raise Remat3dError("remat3d.plan accepted a budget of 1 byte; cannot find the smallest.")


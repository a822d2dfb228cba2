"""``remat3d.plan``: profile the step, search a plan, verify it on meta, cache it.

The search itself is pure (``planner/searching.py``, NOTE [ The budget is a promise ]): this
module profiles the step, builds the stage model, resolves the budget, and hands the
search a verifier that replays each candidate on a meta copy of the model under the
tracker, and the list of stages that can run tiled (``runtime/tiling/probe.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat3d.errors import BudgetError, Remat3dError
from remat3d.instrument.step import meta_copy
from remat3d.measurement import measure
from remat3d.planner.registry import PlannerOptions
from remat3d.planner.searching import Measured, Problem, extra_cost, search
from remat3d.planner.stages import StageModel, build_stages
from remat3d.planspec import Plan
from remat3d.profiling import profile
from remat3d.runtime.apply import apply
from remat3d.runtime.fingerprint import model_fingerprint, model_signature
from remat3d.runtime.region import InPlaceInputError
from remat3d.units import parse_bytes

__all__ = ["clear_plan_cache", "plan", "resolve_budget"]

_CACHE: OrderedDict[tuple, Plan] = OrderedDict()
_CACHE_SIZE = 64
_ROUNDS = 8


def clear_plan_cache() -> None:
    _CACHE.clear()


def resolve_budget(budget: str | float, unplanned_peak: int,
                   device: str = "meta") -> int:
    """Bytes for ``"12GiB"``, ``"500MB"``, ``"0.25x"`` (of the unplanned peak), an int, or
    ``"auto"`` (free memory of the current CUDA device less 5 %)."""
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        if not torch.cuda.is_available():
            raise BudgetError(
                "Budget 'auto' means the free memory of the CUDA device, and there is no "
                "CUDA device here. Give a size ('12GiB') or a fraction ('0.25x')."
            )
        free, _total = torch.cuda.mem_get_info()
        return int(free * 0.95)
    if isinstance(budget, str) and budget.strip().lower().endswith("x"):
        try:
            fraction = float(budget.strip()[:-1])
        except ValueError:
            raise BudgetError(
                f"Cannot read budget {budget!r}: a fraction is written like '0.25x'."
            ) from None
        if not 0 < fraction:
            raise BudgetError(f"Budget fraction must be positive, got {budget!r}.")
        return int(unplanned_peak * fraction)
    if isinstance(budget, float):
        raise BudgetError(
            f"Budget {budget!r} is ambiguous: give bytes as an int, a size like '12GiB', or "
            "a fraction of the unplanned peak like '0.25x'."
        )
    return parse_bytes(budget)


def _verify(model: nn.Module, shapes: list[tuple[int, ...]], plan_: Plan, amp: str | None,
            loss_fn: Callable[[Any], torch.Tensor] | None) -> Measured:
    """Replay the plan on a meta copy under the tracker (the search's verifier)."""
    copy_ = meta_copy(model)
    apply(copy_, plan_)
    m = measure(copy_, *shapes, device="meta", amp=amp, loss_fn=loss_fn)
    return Measured(m.peak_bytes, m.recompute_flops, m.flops, m.host_bytes)


def plan(
    model: nn.Module,
    *inputs: Any,
    budget: str | int = "auto",
    strategy: str = "optimal",
    offload: bool = False,
    amp: str | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    verify: bool = True,
    tile: bool = True,
    host_budget: str | int | None = None,
) -> Plan:
    """Plan checkpointing so one training step of ``model`` fits ``budget``.

    Args:
        inputs: example inputs or their shapes (only shapes and dtypes matter: the step is
            measured on the meta device).
        budget: ``"12GiB"``, ``"500MB"``, ``"0.25x"`` (of the unplanned peak), bytes, or
            ``"auto"`` (free CUDA memory less 5 %).
        strategy: a name from the registry (``remat3d.planner.registry.STRATEGIES``).
        offload: allow host memory: saved tensors moved there, and (when tiling) tiled
            outputs that only tiled stages read kept there (``runtime/tiling/host.py``).
        amp: ``None``, ``"bf16"`` or ``"fp16"`` — the precision the step will run in.
        tile: let ``optimal`` tile full-resolution stages when no plan of keep /
            recompute / offload decisions fits (``planner/tiling.py``; exact, but each
            normalisation in a tiled run costs extra passes). ``False``: such a budget is
            an error naming the smallest budget without tiling.
        host_budget: the most host memory the plan may use (``"32GiB"``, bytes; ``None``:
            no limit): offloaded saved tensors past it stay on the device (and count
            there when the plan is verified), and tiling layouts whose tiled outputs
            hold more of it on the host are passed over.

    Returns a :class:`Plan` with ``verified_peak_bytes`` and ``recompute_flops`` measured.
    Plans are cached by (model structure and settings, input shapes, amp, budget, strategy,
    offload, tile, loss function, deterministic-algorithms mode, host budget): see
    :func:`remat3d.runtime.fingerprint.model_signature`.

    >>> import torch, remat3d
    >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Conv3d(4, 4, 3, padding=1),
    ...                             torch.nn.GroupNorm(2, 4), torch.nn.Conv3d(4, 4, 1))
    ...                             for _ in range(4)])
    >>> p = remat3d.plan(net, (1, 4, 32, 32, 32), budget="0.6x")
    >>> p.verified_peak_bytes <= p.budget_bytes
    True
    """
    shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x) for x in inputs]
    host_bytes = None if host_budget is None else parse_bytes(host_budget)
    key = _cache_key(model, shapes, amp, budget, strategy, offload, tile, loss_fn, host_bytes)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return copy.deepcopy(_CACHE[key])  # the caller's own: editing it changes no cache

    prof = profile(model, *shapes, device="meta", amp=amp, loss_fn=loss_fn)
    stages = build_stages(prof.graph)
    budget_bytes = resolve_budget(budget, prof.peak_bytes)
    header = Plan(model=type(model).__name__, model_fingerprint=model_fingerprint(model),
                  input_shapes=[list(s) for s in shapes], amp=amp, budget_bytes=budget_bytes,
                  strategy=strategy, host_budget_bytes=host_bytes)

    verifier, tileable = _torch_side(model, shapes, amp, loss_fn, stages)
    chosen = search(Problem(
        stages=stages, graph=prof.graph, budget=budget_bytes, strategy=strategy,
        options=PlannerOptions(offload=offload), header=header,
        step_flops=prof.graph.forward_flops + prof.graph.backward_flops,
        unplanned_peak=prof.peak_bytes, verify=verifier if verify else None,
        tileable=tileable if tile else None))
    if strategy == "optimal":
        chosen = _no_worse_than_known(chosen, key, budget_bytes)
    _CACHE[key] = chosen
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return copy.deepcopy(chosen)


def _torch_side(model: nn.Module, shapes: list[tuple[int, ...]], amp: str | None,
                loss_fn: Callable[[Any], torch.Tensor] | None, stages: StageModel
                ) -> tuple[Callable[[Plan], Measured], Callable[[], list[bool]]]:
    """What the pure search asks of torch: a verifier (each candidate replayed on a meta
    copy under the tracker) and which stages can run tiled (probed only when asked)."""
    def verifier(candidate: Plan) -> Measured:
        try:
            return _verify(model, shapes, candidate, amp, loss_fn)
        except InPlaceInputError as exc:
            raise Remat3dError(f"Plan could not be verified: {exc}") from exc

    def tileable() -> list[bool]:
        from remat3d.runtime.tiling.probe import tileable as probe

        return probe(model, shapes, amp, [(st.name, st.call_index) for st in stages.stages])

    return verifier, tileable


def _cache_key(model: nn.Module, shapes: list[tuple[int, ...]], *settings: Any) -> tuple:
    """What a cached plan must have been made for: the model's signature, the shapes, the
    call's settings, and the deterministic-algorithms switch (it changes which kernels,
    and temporaries, some ops use on meta). The loss function is among the settings, by
    identity: a new function plans again."""
    return (model_signature(model), tuple(shapes), *settings[:5],
            torch.are_deterministic_algorithms_enabled(), *settings[5:])


def _no_worse_than_known(chosen: Plan, key: tuple, budget: int) -> Plan:
    """A cheaper plan already verified under this budget (for a smaller budget) wins.

    This keeps a budget sweep monotone: more memory never costs more recomputation.
    """
    family = key[:3] + key[4:]
    for other_key, other in _CACHE.items():
        if other_key[:3] + other_key[4:] != family or other.verified_peak_bytes is None:
            continue
        if other.verified_peak_bytes <= budget and extra_cost(other) < extra_cost(chosen):
            chosen = dataclasses.replace(other, budget_bytes=budget,
                                         regions=list(other.regions))
    return chosen

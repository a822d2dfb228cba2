"""``remat3d.plan``: profile, solve, verify — a Plan whose measured peak fits the budget.

NOTE [ The budget is a promise ]
  1. The strategy solves on the stage model (``planner/stages.py``), which predicts.
  2. The plan is then replayed through the real executor on the meta device under the
     tracker; that verified peak is what is compared with the budget and stored in the plan.
  3. For ``optimal``, the model's budget is a search variable: targets are bisected, each
     plan verified, and the cheapest that fits is pruned one verified step at a time
     (``_search``, ``_prune``). The model errs both ways, so when its plan at the budget
     does not fit, targets somewhat above the budget are tried too. If nothing fits, or
     the budget is below the smallest peak any plan reaches, the error names the smallest
     feasible budget (itself verified).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat3d.errors import BudgetError, InfeasibleBudgetError, Remat3dError
from remat3d.instrument.step import meta_copy
from remat3d.measurement import measure
from remat3d.planner.optimal import min_peak
from remat3d.planner.registry import Decisions, Infeasible, PlannerOptions, get_strategy
from remat3d.planner.stages import KEEP, RECOMPUTE, SELECTIVE, StageModel, build_stages
from remat3d.planning_tiled import extra_cost, prune_tiled, tiled_plan
from remat3d.planspec import Plan, Region
from remat3d.profiling import profile
from remat3d.runtime.apply import apply, model_fingerprint, model_signature
from remat3d.runtime.region import InPlaceInputError
from remat3d.units import format_bytes, format_shape, parse_bytes

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


def _regions(model: StageModel, decisions: list[str], policies: dict[int, str],
             containers: list[tuple[str, int]] | None = None,
             segments: list[tuple[str, int, list[str]]] | None = None) -> list[Region]:
    regions = [Region(name, calls=[call]) for name, call in containers or []]
    regions += [Region(name, calls=[call], segment=list(children))
                for name, call, children in segments or []]
    for s, (stage, decision) in enumerate(zip(model.stages, decisions)):
        if decision == KEEP:
            continue
        policy = policies.get(s)
        if decision == SELECTIVE:
            decision, policy = RECOMPUTE, "save-compute-heavy"
        regions.append(Region(stage.name, calls=[stage.call_index], decision=decision,
                              policy=policy))
    return regions


def _verify(model: nn.Module, shapes: list[tuple[int, ...]], plan_: Plan, amp: str | None,
            loss_fn: Callable[[Any], torch.Tensor] | None) -> tuple[int, int, int, int]:
    """Replay the plan on a meta copy under the tracker: (peak bytes, recompute FLOPs,
    all FLOPs of the step, host bytes of host-resident tiled outputs)."""
    copy_ = meta_copy(model)
    apply(copy_, plan_)
    m = measure(copy_, *shapes, device="meta", amp=amp, loss_fn=loss_fn)
    return m.peak_bytes, m.recompute_flops, m.flops, m.host_bytes


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
    :func:`remat3d.runtime.apply.model_signature`.

    >>> import torch, remat3d
    >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Conv3d(4, 4, 3, padding=1),
    ...                             torch.nn.GroupNorm(2, 4), torch.nn.Conv3d(4, 4, 1))
    ...                             for _ in range(4)])
    >>> p = remat3d.plan(net, (1, 4, 32, 32, 32), budget="0.6x")
    >>> p.verified_peak_bytes <= p.budget_bytes
    True
    """
    shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x) for x in inputs]
    fingerprint = model_fingerprint(model)
    # deterministic algorithms change which kernels (and temporaries) some ops use on meta;
    # the loss function is part of the step (by identity: a new function plans again)
    host_bytes = None if host_budget is None else parse_bytes(host_budget)
    key = (model_signature(model), tuple(shapes), amp, budget, strategy, offload, tile,
           torch.are_deterministic_algorithms_enabled(), loss_fn, host_bytes)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]

    prof = profile(model, *shapes, device="meta", amp=amp, loss_fn=loss_fn)
    stages = build_stages(prof.graph)
    budget_bytes = resolve_budget(budget, prof.peak_bytes)
    options = PlannerOptions(offload=offload)
    solver = get_strategy(strategy)

    verified: dict[tuple, tuple[int, int, int, int]] = {}
    step_flops = prof.graph.forward_flops + prof.graph.backward_flops

    def measured(candidate: Plan) -> tuple[int, int, int, int]:
        """Verify ``candidate`` (once per distinct plan: searches revisit plans)."""
        signature = (candidate.prefetch, *(
            (r.module, tuple(r.calls or ()), tuple(r.segment or ()), r.decision,
             str(r.policy), tuple(r.tile or ()), r.fuse, r.host)
            for r in candidate.regions))
        if signature not in verified:
            try:
                verified[signature] = _verify(model, shapes, candidate, amp, loss_fn)
            except InPlaceInputError as exc:
                raise Remat3dError(f"Plan could not be verified: {exc}") from exc
        return verified[signature]

    def check(candidate: Plan) -> Plan:
        peak, recomputed, total, host = measured(candidate)
        if peak > budget_bytes and candidate.offloads:
            # NOTE [ Offload paths ]: without the prefetch the copies back are not hidden,
            # but the previous region's tensors are not held early either
            candidate.prefetch = False
            late = measured(candidate)
            if late[0] < peak:
                peak, recomputed, total, host = late
            else:
                candidate.prefetch = True
        candidate.verified_peak_bytes, candidate.recompute_flops = peak, recomputed
        candidate.verified_host_bytes = host or None
        candidate.extra_flops, candidate.step_flops = total - step_flops, step_flops
        return candidate

    def build(result: Decisions) -> Plan:
        candidate = Plan(
            regions=_regions(stages, result.decisions, result.policies, result.containers,
                             result.segments),
            model=type(model).__name__, model_fingerprint=fingerprint,
            input_shapes=[list(s) for s in shapes], amp=amp, budget_bytes=budget_bytes,
            strategy=strategy, predicted_peak_bytes=stages.peak(result.decisions),
            host_budget_bytes=host_bytes,
        )
        if verify:
            return check(candidate)
        candidate.recompute_flops = stages.recompute_flops(result.decisions)
        return candidate

    def make(target: int) -> Plan | None:
        try:
            return build(solver(stages, target, options))
        except Infeasible:
            return None

    if strategy != "optimal":
        chosen = make(budget_bytes)
    else:
        seeds = _search(stages, budget_bytes, options, make, build, verify)
        if verify:
            seeds = [_prune(seed, budget_bytes, stages, build) for seed in seeds]
        chosen = min(seeds, key=lambda p: p.recompute_flops or 0) if seeds else None
        if chosen is None:
            smallest = _smallest_feasible(stages, options, make, build)
            if verify and tile:
                # below every plan of keep/recompute/offload decisions: tile
                # (planner/tiling.py)
                header = Plan(model=type(model).__name__, model_fingerprint=fingerprint,
                              input_shapes=[list(s) for s in shapes], amp=amp,
                              budget_bytes=budget_bytes, strategy=strategy,
                              host_budget_bytes=host_bytes)
                chosen, tiled_smallest = tiled_plan(model, shapes, amp, prof.graph, stages,
                                                options, budget_bytes, check, header)
                smallest = min(smallest, tiled_smallest)
                if chosen is not None:
                    chosen = prune_tiled(chosen, budget_bytes, stages, check)
        if chosen is None:
            raise InfeasibleBudgetError(
                f"Budget {format_bytes(budget_bytes)} is infeasible for "
                f"{type(model).__name__} {' '.join(format_shape(s) for s in shapes)} "
                f"(amp={amp or 'none'}{', offload' if offload else ''}"
                f"{'' if host_bytes is None else ', host memory ' + format_bytes(host_bytes)}"
                "): the smallest "
                f"feasible budget is {format_bytes(smallest)} ({smallest} bytes); the "
                f"unplanned peak is {format_bytes(prof.peak_bytes)}."
                + ("" if offload else " Allowing offload (offload=True) may lower it.")
                + ("" if tile else " Allowing tiling (tile=True; --tile) may lower it.")
                + ("" if host_bytes is None or not offload
                   else " A larger host budget (host_budget) may lower it."),
                smallest_feasible_bytes=smallest, unplanned_peak_bytes=prof.peak_bytes,
            )
    assert chosen is not None
    if strategy == "optimal":
        chosen = _no_worse_than_known(chosen, key, budget_bytes)
    _CACHE[key] = chosen
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return chosen


def _search(stages: StageModel, budget: int, options: PlannerOptions,
            make: Callable[[int], Plan | None], build: Callable[[Decisions], Plan],
            verify: bool) -> list[Plan]:
    """The plans that ``_prune`` starts from: the cheapest verified plans under ``budget``
    (see NOTE rule 3), at most two, cheapest first; empty when none fits.

    The model's targets are searched by bisection between the most frugal plan's predicted
    peak and the unplanned one: a larger target allows less recomputation, and each
    candidate is verified; the cheapest one that fits wins. When the model's plan at the
    budget itself does not fit, a second bisection also tries targets up to 1/8 above the
    budget: the model errs both ways, and such a target can verify under the budget with
    less recomputation. Its winner is pruned too, beside the first bisection's, because
    pruning can end cheaper from either.
    """
    first = make(budget)
    unplanned = max(stages.unplanned_peak, stages.peak([KEEP] * len(stages.stages))) + 1
    if first is not None and (not verify or (first.verified_peak_bytes or 0) <= budget):
        if not first.regions:
            return [first]
        # fits at the real budget: try looser targets only
        seeds = [_bisect(first, budget, unplanned, budget, make)]
    else:
        frugal = min_peak(stages, offload=options.offload,
                          recomputable=options.recomputable)[0]
        seeds = [_bisect(None, frugal, budget, budget, make)]
        if verify:
            seeds.append(_bisect(None, frugal, budget + budget // 8, budget, make))
    # the chain dynamic program's region trees (nested regions, which the MILP does not
    # choose): its model is approximate, so its target moves by the verified error
    others: list[Plan] = []
    if verify:
        target = budget
        for _ in range(3):
            tree = build(get_strategy("recursive")(stages, target, options))
            peak = tree.verified_peak_bytes or 0
            if peak <= budget:
                others.append(tree)
            if abs(budget - peak) <= max(1, budget // 1000):
                break
            target += budget - peak
    # the fixed strategies and the most frugal plans compete too: optimal never costs more
    # than any of them at a budget they keep
    others += [p for p in _candidates(stages, options, make, build)
               if (p.verified_peak_bytes or 0) <= budget]
    found: list[Plan] = []
    for seed in seeds:
        best = seed
        for other in others:
            if best is None or (other.recompute_flops or 0) < (best.recompute_flops or 0):
                best = other
        if best is not None and all(best is not f for f in found):
            found.append(best)
    return sorted(found, key=lambda p: p.recompute_flops or 0)


def _bisect(best: Plan | None, low: int, high: int, budget: int,
            make: Callable[[int], Plan | None]) -> Plan | None:
    """The cheapest plan under ``budget`` among the model's plans at targets bisected
    between ``low`` and ``high`` (a target whose plan fits raises ``low``)."""
    for _ in range(_ROUNDS):
        if high - low <= max(1, budget // 1000):
            break
        mid = (low + high) // 2
        candidate = make(mid)
        if candidate is None:
            low = mid
            continue
        if (candidate.verified_peak_bytes or 0) <= budget:
            if best is None or (candidate.recompute_flops or 0) <= (best.recompute_flops or 0):
                best = candidate
            low = mid
        else:
            high = mid
    return best


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


def _prune(best: Plan, budget: int, stages: StageModel,
           build: Callable[[Decisions], Plan]) -> Plan:
    """Make the plan cheaper one verified step at a time, costliest region first.

    The stage model is conservative, so the solver's plan may recompute more than needed.
    Each region is first dropped, else downgraded from a full recompute to a selective one
    (keeping its convolution outputs); a step is taken only if the verified peak still
    fits and the recomputed FLOPs do not grow. Regions on containers and segments (nested
    plans) stay.
    """
    by_name = {(st.name, st.call_index): st for st in stages.stages}
    decisions: dict[tuple[str, int], str] = {}
    containers: list[tuple[str, int]] = []
    segments: list[tuple[str, int, list[str]]] = []
    for r in best.regions:
        key = (r.module, (r.calls or [0])[0])
        if r.segment:
            segments.append((r.module, key[1], list(r.segment)))
        elif key not in by_name:
            containers.append(key)
        else:
            decisions[key] = SELECTIVE if r.policy == "save-compute-heavy" else r.decision
    order = sorted(decisions, key=lambda k: -by_name[k].fwd_flops
                   if decisions[k] == RECOMPUTE else -by_name[k].saved_bytes)

    def attempt(trial: dict[tuple[str, int], str]) -> Plan | None:
        candidate = build(Decisions([trial.get((st.name, st.call_index), KEEP)
                                     for st in stages.stages], containers=containers,
                                    segments=segments))
        if (candidate.verified_peak_bytes or 0) <= budget and \
                (candidate.recompute_flops or 0) <= (best.recompute_flops or 0):
            return candidate
        return None

    for key in order:
        dropped = {k: v for k, v in decisions.items() if k != key}
        found = attempt(dropped)
        if found is None and decisions[key] == RECOMPUTE:
            dropped = {**decisions, key: SELECTIVE}
            found = attempt(dropped)
        if found is not None:
            best, decisions = found, dropped
    return best


def _candidates(stages: StageModel, options: PlannerOptions,
                make: Callable[[int], Plan | None],
                build: Callable[[Decisions], Plan]) -> list[Plan]:
    """Plans every budget search also considers: the model's most frugal one, every
    stage, every stage inside nested regions on every container (the deepest
    recomputation), and the fixed strategies (blocks, uniform, sqrt, balanced, recursive)."""
    plans = []
    frugal = make(min_peak(stages, offload=options.offload,
                           recomputable=options.recomputable)[0])
    if frugal is not None:
        plans.append(frugal)
    ok = options.recomputable or [True] * len(stages.stages)
    every = [RECOMPUTE if ok[st.index] else KEEP for st in stages.stages]
    plans.append(build(Decisions(every)))
    nested = [(name, call) for name, call, covered in stages.containers
              if all(ok[i] for i in covered)]
    if nested:
        plans.append(build(Decisions(every, containers=nested)))
    for name in ("blocks", "uniform", "sqrt", "balanced", "recursive"):
        plans.append(build(get_strategy(name)(stages, None, options)))
    return plans


def _smallest_feasible(stages: StageModel, options: PlannerOptions,
                       make: Callable[[int], Plan | None],
                       build: Callable[[Decisions], Plan]) -> int:
    """The smallest verified peak among the plans every search considers (``build``
    measures each distinct plan once, so the search's candidates are not measured again)."""
    return min(p.verified_peak_bytes or 0 for p in _candidates(stages, options, make, build))

"""One registry of planning strategies, each a pure function of the stage model.

A strategy gets the :class:`StageModel`, the budget in bytes (``None`` when it ignores
budgets) and the options, and returns one decision per stage plus an optional op policy
per stage. Adding a strategy touches this file only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from remat3d.decisions import SELECTIVE_POLICY
from remat3d.errors import Remat3dError
from remat3d.planner.optimal import Costs, solve
from remat3d.planner.recursive import recursive_tree
from remat3d.planner.segments import equal_cost, equal_count, segment_regions, sqrt_count
from remat3d.planner.stages import KEEP, RECOMPUTE, StageModel

__all__ = [
    "STRATEGIES",
    "Decisions",
    "Infeasible",
    "PlannerOptions",
    "get_strategy",
    "register",
]


class Infeasible(Exception):
    """The strategy cannot meet the budget under the memory model."""


@dataclass
class PlannerOptions:
    offload: bool = False
    costs: Costs = field(default_factory=Costs)
    recomputable: list[bool] | None = None  # per stage; False: must not be recomputed
    segments: int = 4  # for `uniform`


@dataclass
class Decisions:
    decisions: list[str]
    policies: dict[int, str] = field(default_factory=dict)
    # extra recompute regions on containers (name, call index): they nest around stages
    containers: list[tuple[str, int]] = field(default_factory=list)
    # recompute regions on runs of an nn.Sequential's children (name, call, child names)
    segments: list[tuple[str, int, list[str]]] = field(default_factory=list)


StrategyFn = Callable[[StageModel, "int | None", PlannerOptions], Decisions]
STRATEGIES: dict[str, StrategyFn] = {}
DESCRIPTIONS: dict[str, str] = {}


def register(name: str, description: str) -> Callable[[StrategyFn], StrategyFn]:
    def add(fn: StrategyFn) -> StrategyFn:
        STRATEGIES[name] = fn
        DESCRIPTIONS[name] = description
        return fn

    return add


def get_strategy(name: str) -> StrategyFn:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise Remat3dError(
            f"Unknown strategy {name!r}. Available: {', '.join(sorted(STRATEGIES))}."
        ) from None


def _allowed(model: StageModel, options: PlannerOptions) -> list[bool]:
    return options.recomputable or [True] * len(model.stages)


@register("none", "no checkpointing (the baseline)")
def _none(model: StageModel, budget: int | None, options: PlannerOptions) -> Decisions:
    return Decisions([KEEP] * len(model.stages))


@register("blocks", "recompute every block: the MONAI/HF/timm practice")
def _blocks(model: StageModel, budget: int | None, options: PlannerOptions) -> Decisions:
    ok = _allowed(model, options)
    return Decisions([RECOMPUTE if s.is_block and ok[s.index] else KEEP
                      for s in model.stages])


@register("selective", "every block recomputed except its convolution/matmul outputs")
def _selective(model: StageModel, budget: int | None, options: PlannerOptions) -> Decisions:
    chosen = _blocks(model, budget, options)
    chosen.policies = {i: SELECTIVE_POLICY for i, d in enumerate(chosen.decisions)
                       if d == RECOMPUTE}
    return chosen


def _segmented(model: StageModel, options: PlannerOptions,
               segments: list[tuple[int, int]]) -> Decisions:
    decisions, containers = segment_regions(model, segments, _allowed(model, options))
    return Decisions(decisions, containers=containers)


@register("uniform",
          "k segments of equal stage count (checkpoint_sequential); k = options.segments")
def _uniform(model: StageModel, budget: int | None, options: PlannerOptions) -> Decisions:
    return _segmented(model, options, equal_count(len(model.stages), options.segments))


@register("sqrt", "sqrt(n) segments of equal count (Chen et al. 2016)")
def _sqrt(model: StageModel, budget: int | None, options: PlannerOptions) -> Decisions:
    n = len(model.stages)
    return _segmented(model, options, equal_count(n, sqrt_count(n)))


@register("balanced", "sqrt(n) segments of equal saved bytes")
def _balanced(model: StageModel, budget: int | None, options: PlannerOptions) -> Decisions:
    costs = [s.saved_bytes for s in model.stages]
    return _segmented(model, options, equal_cost(costs, sqrt_count(len(costs))))


@register("recursive", "the chain dynamic program over the stages as nested regions: "
          "revolve's binomial schedule (log n checkpoints) without a budget, the cheapest "
          "expressible region tree within it with one")
def _recursive(model: StageModel, budget: int | None, options: PlannerOptions) -> Decisions:
    ok = _allowed(model, options)
    tree = None if budget is None else recursive_tree(model, budget, ok, options.costs)
    if tree is None:  # no budget, or none fits it: the binomial (most frugal) schedule
        tree = recursive_tree(model, None, ok, options.costs)
    if tree is None:
        # a stage that cannot be a region (its module writes into its input) leaves no
        # schedule of the chain model: every stage that can be is a region of its own
        return Decisions([RECOMPUTE if ok[s.index] else KEEP for s in model.stages])
    return Decisions(tree.decisions, containers=tree.containers, segments=tree.segments)


@register("optimal", "least recompute (and transfer) cost whose peak fits the budget")
def _optimal(model: StageModel, budget: int | None, options: PlannerOptions) -> Decisions:
    if budget is None:
        raise Remat3dError("Strategy 'optimal' needs a budget.")
    decisions = solve(model, budget, offload=options.offload, costs=options.costs,
                      recomputable=_allowed(model, options))
    if decisions is None:
        raise Infeasible(budget)
    return Decisions(decisions)

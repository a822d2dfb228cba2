"""``optimal``: the least recompute cost whose predicted peak fits the budget (a MILP).

Decisions per stage: keep, recompute, selective (recompute but keep convolution/matmul
outputs: policy ``save-compute-heavy``), and offload when allowed. Costs are in FLOPs;
memory-bound work (recomputed norms and activations, host transfers that do not overlap
compute) is converted to FLOP-equivalents with the device figures in :class:`Costs`.

One binary per (stage, decision); the memory model of ``stages.py`` is linear in them, so
``scipy.optimize.milp`` (HiGHS) finds the exact optimum of the model in milliseconds for
the tens of stages a 3D network has.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from remat3d.planner.stages import KEEP, OFFLOAD, RECOMPUTE, SELECTIVE, Stage, StageModel
from remat3d.planspec import OBJECTIVES

__all__ = ["Costs", "min_peak", "solve"]

# under the "flops" objective, memory-bound recompute costs this share of its traffic:
# enough to choose between plans of equal FLOPs, too little to outweigh any convolution
_TIE_BREAK = 1e-6


@dataclass(frozen=True)
class Costs:
    """Turns memory-bound recompute and offload transfers into recompute-equivalent FLOPs.

    An offloaded stage moves its saved bytes to the host and back; the copies overlap the
    stage's own compute, and only what does not overlap costs time.

    ``objective`` is what a plan minimises. ``"time"`` (the default): FLOPs, and
    memory-bound ops (norms, activations, ``cat``: no FLOPs counted) their traffic at
    memory bandwidth, for the time they take when run unfused. ``"flops"``: FLOPs as
    torch's ``FlopCounterMode`` counts them (convolutions and matmuls), which is what
    torch.compile's partitioner minimises; memory-bound recompute then only breaks ties
    (``_TIE_BREAK`` of its traffic). Offload costs its unhidden transfer time under both.
    """

    device_flops: float = 1.0e14  # FLOP/s the device sustains (bf16 on a recent GPU)
    host_bandwidth: float = 2.5e10  # bytes/s each way over PCIe/NVLink-C2C
    memory_bandwidth: float = 3.0e12  # bytes/s of device memory
    objective: str = "time"

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective {self.objective!r} is not one of {OBJECTIVES}")

    def pointwise_cost(self, nbytes: int) -> float:
        """Recomputing memory-bound ops (norms, activations) over ``nbytes`` of output,
        in FLOP-equivalents: reading and writing them at memory bandwidth (under the
        ``"flops"`` objective a tie-breaking share of that)."""
        traffic = 2 * nbytes / self.memory_bandwidth * self.device_flops
        return traffic if self.objective == "time" else traffic * _TIE_BREAK

    def offload_cost(self, saved_bytes: int, compute_flops: int) -> float:
        transfer = 2 * saved_bytes / self.host_bandwidth
        overlap = compute_flops / self.device_flops
        return max(0.0, transfer - overlap) * self.device_flops + 1e-6 * saved_bytes


def decision_cost(stage: Stage, decision: str, costs: Costs) -> float:
    """The objective's cost of one stage's decision (FLOPs and FLOP-equivalents)."""
    pointwise = costs.pointwise_cost(max(0, stage.saved_bytes - stage.heavy_bytes))
    if decision == RECOMPUTE:
        return stage.fwd_flops + pointwise + 1.0  # +1: among equal costs, fewer regions
    if decision == SELECTIVE:
        return pointwise + 2.0
    if decision == OFFLOAD:
        return costs.offload_cost(stage.saved_bytes, 3 * stage.fwd_flops)
    return 0.0


def _decisions(offload: bool, stage_ok: list[bool]) -> list[list[str]]:
    choices = []
    for ok in stage_ok:
        options = [KEEP]
        if ok:
            options += [RECOMPUTE, SELECTIVE]
        if offload:
            options.append(OFFLOAD)
        choices.append(options)
    return choices


def _system(model: StageModel, options: list[list[str]]):
    index = [(s, d) for s, opts in enumerate(options) for d in opts]
    col = {key: i for i, key in enumerate(index)}
    n = len(index)
    rows, upper = [], []
    stages = model.stages
    for s, stage in enumerate(stages):
        prefix = model.base + model.glue_saved[s]
        forward = np.zeros(n)
        backward = np.zeros(n)
        for t in range(s):
            for d in options[t]:
                kept = stages[t].kept(d)
                forward[col[(t, d)]] = kept
                backward[col[(t, d)]] = kept
        for d in options[s]:
            backward[col[(s, d)]] = stage.held_in_backward(d)
        rows.append(forward)
        upper.append(-(prefix + stage.fwd_delta))  # moved to the right-hand side below
        rows.append(backward)
        upper.append(-(prefix + model.grads_after[s] + model.pending[s]))
    one_each = np.zeros((len(stages), n))
    for (s, _d), i in col.items():
        one_each[s, i] = 1
    return index, col, np.array(rows), np.array(upper, dtype=float), one_each


def solve(model: StageModel, budget: int, *, offload: bool = False,
          costs: Costs = Costs(), recomputable: list[bool] | None = None,
          ) -> list[str] | None:
    """Decisions minimising recompute cost with predicted peak <= budget (None: infeasible)."""
    if not model.stages:
        return []
    ok = recomputable or [True] * len(model.stages)
    options = _decisions(offload, ok)
    index, _col, rows, const, one_each = _system(model, options)
    c = np.array([decision_cost(model.stages[s], d, costs) for s, d in index])
    if model.base > budget:
        return None
    constraints = [
        LinearConstraint(rows, -np.inf, budget + const),
        LinearConstraint(one_each, 1, 1),
    ]
    result = milp(c, constraints=constraints, integrality=np.ones(len(index)),
                   bounds=Bounds(0, 1))
    if result.x is None or not result.success:
        return None
    decisions = [KEEP] * len(model.stages)
    for i, (s, d) in enumerate(index):
        if result.x[i] > 0.5:
            decisions[s] = d
    return decisions


def min_peak(model: StageModel, *, offload: bool = False,
             recomputable: list[bool] | None = None,
             costs: Costs | None = None) -> tuple[int, list[str]]:
    """The smallest predicted peak any decisions reach, and the cheapest such decisions."""
    ok = recomputable or [True] * len(model.stages)
    options = _decisions(offload, ok)
    if not model.stages:
        return model.base, []
    index, _col, rows, const, one_each = _system(model, options)
    n = len(index)
    # variables: the decisions, then the peak P; minimise P (then cost, lexicographically)
    c = np.zeros(n + 1)
    c[n] = 1.0
    a = np.hstack([rows, -np.ones((rows.shape[0], 1))])
    constraints = [
        LinearConstraint(a, -np.inf, const),
        LinearConstraint(np.hstack([one_each, np.zeros((one_each.shape[0], 1))]), 1, 1),
    ]
    integrality = np.concatenate([np.ones(n), [0]])
    bounds = Bounds(np.zeros(n + 1), np.concatenate([np.ones(n), [np.inf]]))
    result = milp(c, constraints=constraints, integrality=integrality, bounds=bounds)
    peak = int(np.ceil(result.x[n])) if result.x is not None else model.unplanned_peak
    decisions = solve(model, max(peak, model.base), offload=offload, recomputable=ok,
                      costs=costs or Costs())
    if decisions is None:
        decisions = [RECOMPUTE if k else KEEP for k in ok]
    return model.peak(decisions), decisions

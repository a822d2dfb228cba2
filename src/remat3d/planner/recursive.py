"""``recursive``: the chain dynamic program on the stages, as nested regions of the model.

Pure Python (no torch). The stages in forward order form a chain (``chain.py``); its
optimal schedule is a tree of nested recompute regions. A region of the tree must be
something the executor can run:

1. one stage (its module invocation);
2. a container invocation that holds exactly those stages (a U-Net level, for example);
3. a contiguous run of one ``nn.Sequential``'s children holding exactly those stages (a
   segment region; segments of one Sequential may nest).

The dynamic program is solved over trees of such regions only (``allowed``), so the plan
is the optimum among the expressible trees under the chain model — exact on an
``nn.Sequential`` of stages, where every range is expressible, and an approximation on a
U-Net, whose skip connections the chain model does not see (the ranges a U-Net's module
tree expresses are its stages and its nested levels). Every plan is verified on meta.

Without a budget the schedule is revolve's binomial one on the stage *count* (every
stage costs 1 and every activation 1 unit, like ``sqrt`` uses counts) with
``ceil(log2 n)`` checkpoints (the input among them), or the fewest the expressible regions allow:
logarithmic
memory for ``O(n log n)`` recomputation on a chain. With a budget the program runs on the
measured bytes and FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from remat3d.planner.chain import Chain, ChainSchedule, discretise, solve_chain
from remat3d.planner.optimal import Costs, decision_cost
from remat3d.planner.stages import KEEP, RECOMPUTE, StageModel

__all__ = ["RegionTree", "expressible_ranges", "recursive_tree", "stage_chain"]

SLOTS = 500  # memory discretisation of the dynamic program (rotor's default)


@dataclass
class RegionTree:
    """A chain schedule as plan pieces: per-stage decisions, container and segment
    regions, and the chain model's prediction."""

    decisions: list[str]
    containers: list[tuple[str, int]]
    segments: list[tuple[str, int, list[str]]]
    schedule: ChainSchedule


def expressible_ranges(model: StageModel, ok: list[bool]) -> dict[tuple[int, int], tuple]:
    """Stage ranges ``[start, stop)`` that one region can cover, and how:
    ``("stage", index)``, ``("container", name, call)`` or
    ``("segment", name, call, [child names])``."""
    out: dict[tuple[int, int], tuple] = {}
    for name, call, children in model.sequences:
        for i in range(len(children)):
            if not children[i][1]:
                continue
            covered: list[int] = []
            for j in range(i, len(children)):
                covered = covered + children[j][1]
                if not children[j][1] or j == i and len(covered) < 2:
                    continue
                start, stop = covered[0], covered[-1] + 1
                if covered == list(range(start, stop)) and all(ok[k] for k in covered):
                    out[(start, stop)] = ("segment", name, call,
                                          [c for c, _ in children[i:j + 1]])
    for name, call, covered in model.containers:
        start, stop = covered[0], covered[-1] + 1
        if covered == list(range(start, stop)) and all(ok[k] for k in covered):
            out[(start, stop)] = ("container", name, call)
    for stage in model.stages:
        if ok[stage.index]:
            out[(stage.index, stage.index + 1)] = ("stage", stage.index)
    return out


def stage_chain(model: StageModel, costs: Costs) -> Chain:
    """The stages as a chain in bytes and FLOP-equivalents (NOTE [ The chain model ]):
    ``a[i]`` is stage ``i``'s input, the tape what it saves beyond its input."""
    stages = model.stages
    x = [s.input_bytes for s in stages] + [stages[-1].output_bytes]
    tape = [max(0, s.saved_bytes - s.input_bytes) for s in stages]
    return Chain(
        f=tuple(decision_cost(s, RECOMPUTE, costs) for s in stages),
        b=(0.0,) * len(stages),
        x=tuple(x),
        tape=tuple(tape),
        fwd_extra=tuple(max(0, s.fwd_delta - s.output_bytes - t)
                        for s, t in zip(stages, tape)),
        bwd_extra=tuple(max(0, s.bwd_delta - s.input_bytes) for s in stages),
    )


def _counted(n: int, slots: int) -> tuple[Chain, int]:
    """Revolve's setting on ``n`` stages: unit costs and sizes, one tape at a time; the
    budget that holds ``slots`` checkpoints (see ``tests/planner/test_chain.py``)."""
    tape = n + 4
    chain = Chain(f=(1.0,) * n, b=(0.0,) * n, x=(1,) * (n + 1), tape=(tape,) * n,
                  fwd_extra=(0,) * n, bwd_extra=(0,) * n)
    return chain, slots + 3 + tape


def recursive_tree(model: StageModel, budget: int | None, ok: list[bool],
                   costs: Costs | None = None) -> RegionTree | None:
    """The cheapest expressible region tree under ``budget`` bytes (``None``: revolve's
    binomial schedule with logarithmic checkpoints); ``None`` if nothing fits."""
    n = len(model.stages)
    if n == 0:
        return RegionTree([], [], [], ChainSchedule(0, 0, [], []))
    ranges = expressible_ranges(model, ok)

    def allowed(start: int, stop: int) -> bool:
        return (start, stop) in ranges

    schedule: ChainSchedule | None = None
    if budget is None:
        for slots in range(max(1, math.ceil(math.log2(max(n, 2)))), n + 2):
            schedule = solve_chain(*_counted(n, slots), allowed=allowed)
            if schedule is not None:
                break
    else:
        chain = stage_chain(model, costs or Costs())
        # what the chain does not hold itself: glue, parameter gradients, and gradients of
        # skip connections (pending less the chain's own gradient to the next stage)
        fixed = max(g + max(0, p - chain.x[i + 1]) + a for i, (g, p, a) in enumerate(
            zip(model.glue_saved, model.pending, model.grads_after)))
        room = budget - model.base - fixed
        if room <= 0:
            return None
        sizes, units = discretise(list(chain.x) + list(chain.tape) + list(chain.fwd_extra)
                                  + list(chain.bwd_extra), room, SLOTS)
        k = n + 1
        scaled = Chain(f=chain.f, b=chain.b, x=tuple(sizes[:k]),
                       tape=tuple(sizes[k:k + n]), fwd_extra=tuple(sizes[k + n:k + 2 * n]),
                       bwd_extra=tuple(sizes[k + 2 * n:]))
        schedule = solve_chain(scaled, units, allowed=allowed)
    if schedule is None:
        return None
    decisions = [KEEP] * n
    containers: list[tuple[str, int]] = []
    segments: list[tuple[str, int, list[str]]] = []
    for span in schedule.regions:
        how = ranges[span]
        if how[0] == "stage":
            decisions[how[1]] = RECOMPUTE
        elif how[0] == "container":
            containers.append((how[1], how[2]))
        else:
            segments.append((how[1], how[2], list(how[3])))
    return RegionTree(decisions, containers, segments, schedule)

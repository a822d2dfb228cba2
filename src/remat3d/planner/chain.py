"""Optimal checkpointing of a heterogeneous chain: a rotor-style dynamic program.

Pure Python and numpy; never imports torch.

NOTE [ The chain model ]
  A chain has layers ``1..n``; layer ``i`` maps activation ``a[i-1]`` to ``a[i]``. Per
  layer: forward cost ``f[i]``, backward cost ``b[i]``, output bytes ``x[i]`` (``x[0]`` is
  the input), tape bytes ``tape[i]`` (what a taped forward keeps for the backward, beyond
  the input), forward and backward transients ``fwd_extra[i]``, ``bwd_extra[i]``. The
  gradient of ``a[i]`` has ``x[i]`` bytes. Memory is an integer number of units.

  State: the stored activations (``a[0]`` always), the tapes, the current gradient
  ``delta[g]`` (``delta[n]`` at the start). Operations, each with the memory it needs
  on top of the state's (the *peak* must stay ``<= budget``):
  1. ``F(i)``    plain forward: needs ``a[i-1]``; stores ``a[i]``.
                 Peak: state + ``x[i] + fwd_extra[i]``. Cost ``f[i]``.
  2. ``Ftape(i)`` taped forward: as ``F(i)``, and keeps tape ``i``.
                 Peak: state + ``x[i] + tape[i] + fwd_extra[i]``. Cost ``f[i]``.
  3. ``B(i)``    backward: needs ``delta[i]`` current, tape ``i`` and ``a[i-1]``; frees tape
                 ``i`` and ``delta[i]``, makes ``delta[i-1]`` current.
                 Peak: state + ``x[i-1] + bwd_extra[i]``. Cost ``b[i]``.
  4. ``free a[i]`` (``i >= 1``), no cost, unless tape ``i+1`` is held: a tape references
     its layer's input (as autograd's saved tensors do), so the input lives as long as it.
  The goal is ``delta[0]``. A schedule's cost is the sum of its operations' costs; every
  layer runs ``Ftape`` and ``B`` once, so ``cost - sum(f) - sum(b)`` is the recomputation.

  The dynamic program solves ``C(s, t, m)``: reverse layers ``s..t`` given ``a[s-1]``
  stored and ``delta[t]`` current, using at most ``m`` units (``a[s-1]`` and the gradient
  included; what the caller holds is already subtracted), ending with ``a[s-1]`` stored and
  ``delta[s-1]`` current. Either tape layer ``s`` first, then solve ``s+1..t`` (``a[s]``
  stored) and run ``B(s)``; or run ``F`` over ``s..k-1`` keeping only ``a[k-1]``, solve
  ``k..t``, free ``a[k-1]``, then solve ``s..k-1`` (Beaumont et al. 2019, "Optimal
  checkpointing for heterogeneous chains"). ``tests/planner/test_chain.py`` checks it
  against a shortest-path search over every schedule of the operations above.

  Every schedule of the program is a tree of nested regions (checkpoints) on the chain:
  the second choice is a recompute region over layers ``s..k-1`` whose own schedule is
  ``C(s, k-1, .)``; a taped layer is a layer run normally inside its enclosing region.
  ``ChainSchedule.regions`` is that tree, and :func:`region_tree_cost` its cost. PyTorch's
  non-reentrant checkpoint with early stop
  runs such a tree with exactly this schedule: a region's recomputation stops at the input
  of its last sub-region (NOTE [ Nestable Checkpoint ] in ``torch.utils.checkpoint``).

>>> schedule = solve_chain(Chain.homogeneous(6), budget=5)
>>> schedule.recompute, schedule.regions
(5.0, [(0, 3), (3, 5)])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np

__all__ = [
    "Chain",
    "ChainSchedule",
    "discretise",
    "revolve_closed_form",
    "revolve_recurrence",
    "solve_chain",
]

_INF = float("inf")


@dataclass(frozen=True)
class Chain:
    """Per-layer figures of a chain (lists indexed by layer ``0..n-1``; ``x`` has ``n+1``)."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    x: tuple[int, ...]
    tape: tuple[int, ...]
    fwd_extra: tuple[int, ...]
    bwd_extra: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.f)
        if len(self.x) != n + 1 or not all(
                len(v) == n for v in (self.b, self.tape, self.fwd_extra, self.bwd_extra)):
            raise ValueError(f"Chain of {n} layers needs n+1 = {n + 1} sizes x and n of "
                             f"every other figure; got x of {len(self.x)}.")
        if any(v < 0 for seq in (self.x, self.tape, self.fwd_extra, self.bwd_extra)
               for v in seq):
            raise ValueError("Chain sizes must be non-negative.")

    @property
    def n(self) -> int:
        return len(self.f)

    @classmethod
    def homogeneous(cls, n: int, *, f: float = 1, size: int = 1) -> Chain:
        """``n`` equal layers: unit cost, activations of ``size`` units, no tape or
        transient, free backward (the setting of revolve)."""
        return cls(f=(f,) * n, b=(0,) * n, x=(size,) * (n + 1), tape=(0,) * n,
                   fwd_extra=(0,) * n, bwd_extra=(0,) * n)


@dataclass
class ChainSchedule:
    """The optimum of :func:`solve_chain`.

    Attributes:
        cost: total cost of the schedule (every forward and backward run).
        recompute: ``cost - sum(f) - sum(b)``: the forward work done more than once.
        regions: recompute regions as half-open layer ranges ``(start, stop)`` (0-based
            layers), outer before inner, in forward order; they are nested or disjoint.
        operations: the schedule, e.g. ``[("F", 1), ("Ftape", 2), ("free", 2), ("B", 2),
            ...]`` (1-based layers as in the NOTE; ``("free", i)`` frees ``a[i]``).
    """

    cost: float
    recompute: float
    regions: list[tuple[int, int]]
    operations: list[tuple[str, int]]


def discretise(sizes: list[int], budget: int, slots: int = 500) -> tuple[list[int], int]:
    """Byte sizes and budget in memory units of ``ceil(budget / slots)`` bytes.

    Sizes round up and the budget rounds down, so a schedule that fits in units fits in
    bytes (rotor's discretisation; the optimum is exact up to this rounding).
    """
    unit = max(1, math.ceil(budget / slots))
    return [math.ceil(v / unit) for v in sizes], budget // unit


def solve_chain(chain: Chain, budget: int,
                allowed: Callable[[int, int], bool] | None = None) -> ChainSchedule | None:
    """The least-cost schedule of ``chain`` within ``budget`` units (``None``: none fits).

    ``allowed(start, stop)`` (0-based, half-open layer range) says which recompute regions
    may be used (default: any); with it, the result is the optimum among the region trees
    made of allowed regions (e.g. those the module tree can express). Tables are numpy
    arrays over the memory left, so the work is ``O(n^3)`` vector operations of length
    ``budget``.

    NOTE [ One function ]: the recurrence, its tables and the backtracking share the same
    local arrays (``cost``, ``choice``, the shifted memory axis); split apart, every part
    would take all of them as arguments, so the DP stays one function.
    """
    n = chain.n
    if n == 0:
        return ChainSchedule(0, 0, [], [])
    m_len = budget + 1
    if m_len <= 0:
        return None
    x, f, b, tape = chain.x, chain.f, chain.b, chain.tape
    fx, bx = chain.fwd_extra, chain.bwd_extra
    memory = np.arange(m_len)
    # cost[s][t][m] and the choice: 0 = tape s first, k > s = plain forward to a[k-1]
    cost: dict[tuple[int, int], np.ndarray] = {}
    choice: dict[tuple[int, int], np.ndarray] = {}

    def shifted(table: np.ndarray, by: int) -> np.ndarray:
        """``table[m - by]`` (infinite where ``m - by < 0``)."""
        out = np.full(m_len, _INF)
        if by < m_len:
            out[by:] = table[:m_len - by] if by >= 0 else table[-by:]
        return out

    for length in range(1, n + 1):
        for s in range(1, n - length + 2):
            t = s + length - 1
            need_bwd = x[s - 1] + tape[s - 1] + x[s] + x[s - 1] + bx[s - 1]
            need_tape = x[s - 1] + x[t] + x[s] + tape[s - 1] + fx[s - 1]
            fits = (memory >= max(need_bwd, need_tape))
            if s == t:
                best = np.where(fits, f[s - 1] + b[s - 1], _INF)
                cost[(s, t)] = best
                choice[(s, t)] = np.zeros(m_len, dtype=np.int64)
                continue
            best = np.where(fits, f[s - 1] + b[s - 1]
                            + shifted(cost[(s + 1, t)], x[s - 1] + tape[s - 1]), _INF)
            pick = np.zeros(m_len, dtype=np.int64)
            sweep, sweep_need = 0.0, 0
            for k in range(s + 1, t + 1):
                j = k - 1  # plain forward of layer j adds a[j]
                sweep += f[j - 1]
                held = x[j - 1] if j > s else 0
                sweep_need = max(sweep_need, x[s - 1] + x[t] + held + x[j] + fx[j - 1])
                if allowed is not None and not allowed(s - 1, k - 1):
                    continue
                trial = sweep + shifted(cost[(k, t)], x[s - 1]) + cost[(s, k - 1)]
                trial = np.where(memory >= sweep_need, trial, _INF)
                better = trial < best
                best = np.where(better, trial, best)
                pick = np.where(better, k, pick)
            cost[(s, t)] = best
            choice[(s, t)] = pick
    total = float(cost[(1, n)][budget])
    if total == _INF:
        return None
    regions: list[tuple[int, int]] = []
    operations: list[tuple[str, int]] = []

    def unfold(s: int, t: int, m: int) -> None:
        k = int(choice[(s, t)][m])
        if s == t:
            operations.extend([("Ftape", s), ("free", s), ("B", s)])
        elif k == 0:
            operations.append(("Ftape", s))
            unfold(s + 1, t, m - x[s - 1] - tape[s - 1])
            operations.extend([("free", s), ("B", s)])
        else:
            for j in range(s, k):
                operations.append(("F", j))
                if j > s:
                    operations.append(("free", j - 1))
            unfold(k, t, m - x[s - 1])
            operations.append(("free", k - 1))
            regions.append((s - 1, k - 1))
            unfold(s, k - 1, m)

    unfold(1, n, budget)
    regions.sort(key=lambda r: (r[0], -r[1]))
    recompute = total - sum(f) - sum(b)
    return ChainSchedule(total, recompute, regions, operations)


def region_tree_cost(chain: Chain, regions: list[tuple[int, int]]) -> float:
    """Forward work of running ``chain`` under nested recompute ``regions`` (0-based
    half-open layer ranges, nested or disjoint) with early-stopping recomputation.

    One forward of every layer, plus, per region, the recomputation of its body up to
    the input of its last sub-region (or through its last layer when that layer is not in
    a sub-region). Independent of :func:`solve_chain`: used to check that a DP schedule
    and its region tree cost the same.
    """
    total = float(sum(chain.f))
    for start, stop in regions:
        inner = [r for r in regions if r != (start, stop) and start <= r[0] and r[1] <= stop]
        children = [r for r in inner if not any(
            o != r and o[0] <= r[0] and r[1] <= o[1] for o in inner)]
        end = stop
        last = max(children, key=lambda r: r[0], default=None)
        if last is not None and last[1] == stop:
            end = last[0]
        total += sum(chain.f[start:end])
    return total


@cache
def revolve_recurrence(steps: int, slots: int) -> int:
    """``T(l, s) = min_k [k + T(l-k, s-1) + T(k, s)]``, ``T(1, s) = 0``,
    ``T(l, 1) = l(l-1)/2``: the least number of forward steps (advances) that reverse
    ``l`` steps with ``s`` checkpoints, the initial state among them; the taped forward
    that each reversal step includes is not counted."""
    if steps <= 1:
        return 0
    if slots <= 1:
        return steps * (steps - 1) // 2
    return min(k + revolve_recurrence(steps - k, slots - 1) + revolve_recurrence(k, slots)
               for k in range(1, steps))


def revolve_closed_form(steps: int, slots: int) -> int:
    """Griewank & Walther's minimal forward steps ``p(l, s) = t*l - C(s+t, t-1)``, with
    ``t`` the smallest integer with ``C(s+t, s) >= l`` (same convention as
    :func:`revolve_recurrence`)."""
    if steps <= 1:
        return 0
    t = 0
    while math.comb(slots + t, slots) < steps:
        t += 1
    return t * steps - math.comb(slots + t, t - 1)

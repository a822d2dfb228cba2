"""Segment strategies: ``uniform`` (equal count), ``sqrt`` (Chen), ``balanced`` (equal memory).

The classic strategies cut a chain into segments and keep only each segment's input. On
the module tree a segment becomes regions the executor can run: the largest containers
that lie inside the segment (one region keeps one input), and every other stage of the
segment on its own. On an ``nn.Sequential`` of stages this is exactly segment
checkpointing; on a U-Net, whose levels nest, it is the closest module-aligned form.
Pure Python.
"""

from __future__ import annotations

import bisect
import math

from remat3d.planner.stages import KEEP, RECOMPUTE, StageModel

__all__ = ["equal_cost", "equal_count", "segment_regions"]


def equal_count(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous segments ``[start, stop)`` of ``n`` items whose sizes differ by <= 1."""
    k = max(1, min(k, n))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k) if bounds[i] < bounds[i + 1]]


def equal_cost(costs: list[int], k: int) -> list[tuple[int, int]]:
    """``k`` contiguous segments whose cost sums are as even as possible.

    Cuts start where the running sum is nearest each multiple of ``total / k``; then any
    single cut is moved by one item while that narrows the spread (largest minus smallest
    segment sum). The result's spread is at most the largest single cost (tested on random
    inputs).
    """
    n = len(costs)
    k = max(1, min(k, n))
    total = sum(costs)
    if total == 0 or k == 1:
        return equal_count(n, k)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    cuts = [0]
    for j in range(1, k):
        goal = total * j / k
        best = min(range(cuts[-1] + 1, n - (k - j) + 1), key=lambda i: abs(prefix[i] - goal))
        cuts.append(best)
    cuts.append(n)

    def spread(c: list[int]) -> int:
        sums = [prefix[c[i + 1]] - prefix[c[i]] for i in range(len(c) - 1)]
        return max(sums) - min(sums)

    improved = True
    while improved:
        improved = False
        for j in range(1, k):
            for step in (-1, 1):
                trial = list(cuts)
                trial[j] += step
                if trial[j - 1] < trial[j] < trial[j + 1] and spread(trial) < spread(cuts):
                    cuts, improved = trial, True
    if spread(cuts) > max(costs):
        exact = _within(prefix, k, max(costs))
        if exact is not None:
            cuts = exact
    return [(cuts[i], cuts[i + 1]) for i in range(k)]


def _within(prefix: list[int], k: int, width: int) -> list[int] | None:
    """Cuts of ``k`` non-empty segments with all sums in ``[low, low + width]`` for some
    ``low`` among the possible segment sums (exhaustive over ``low``, a DP for each)."""
    n = len(prefix) - 1
    lows = sorted({prefix[b] - prefix[a] for a in range(n) for b in range(a + 1, n + 1)})
    for low in lows:
        parent: list[dict[int, int]] = [{0: -1}]
        for _j in range(k):
            nxt: dict[int, int] = {}
            for i in parent[-1]:
                lo = bisect.bisect_left(prefix, prefix[i] + low, i + 1)
                hi = bisect.bisect_right(prefix, prefix[i] + low + width, i + 1)
                for end in range(lo, min(hi, n + 1)):
                    nxt.setdefault(end, i)
            parent.append(nxt)
        if n in parent[k]:
            cuts, at = [n], n
            for j in range(k, 0, -1):
                at = parent[j][at]
                cuts.append(at)
            return cuts[::-1]
    return None


def segment_regions(model: StageModel, segments: list[tuple[int, int]],
                    ok: list[bool]) -> tuple[list[str], list[tuple[str, int]]]:
    """Decisions and container regions that realise ``segments`` on the module tree."""
    decisions = [KEEP] * len(model.stages)
    containers: list[tuple[str, int]] = []
    for start, stop in segments:
        covered: set[int] = set()
        for name, call, members in model.containers:  # outermost first
            if all(start <= m < stop and ok[m] for m in members) and \
                    not covered.intersection(members):
                containers.append((name, call))
                covered.update(members)
        for i in range(start, stop):
            if i not in covered and ok[i]:
                decisions[i] = RECOMPUTE
    return decisions, containers


def sqrt_count(n: int) -> int:
    return max(1, round(math.sqrt(n)))

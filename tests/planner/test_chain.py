"""The chain dynamic program against an independent search over every schedule, and
against revolve's closed form. Pure Python: no torch."""

from __future__ import annotations

import heapq
import math
import random

import pytest

from remat3d.planner.chain import (
    Chain,
    discretise,
    region_tree_cost,
    revolve_closed_form,
    revolve_recurrence,
    solve_chain,
)


def every_schedule_optimum(chain: Chain, budget: int) -> float | None:
    """Least cost over all schedules of the operations in NOTE [ The chain model ]:
    Dijkstra over states (stored activations, tapes, current gradient). Written from the
    operational model alone; shares nothing with the dynamic program."""
    n = chain.n

    def memory(stored: frozenset[int], tapes: frozenset[int], grad: int) -> int:
        return (sum(chain.x[i] for i in stored) + sum(chain.tape[i - 1] for i in tapes)
                + chain.x[grad])

    start = (frozenset({0}), frozenset(), n)
    if memory(*start) > budget:
        return None
    best = {start: 0.0}
    queue: list[tuple[float, int, tuple]] = [(0.0, 0, start)]
    tie = 0
    while queue:
        cost, _, state = heapq.heappop(queue)
        if cost > best[state]:
            continue
        stored, tapes, grad = state
        if grad == 0:
            return cost
        held = memory(stored, tapes, grad)
        moves = []
        for i in range(1, n + 1):
            if i - 1 not in stored:
                continue
            if i not in stored:  # plain forward
                peak = held + chain.x[i] + chain.fwd_extra[i - 1]
                moves.append((peak, chain.f[i - 1], (stored | {i}, tapes, grad)))
            if i not in tapes:  # taped forward (a second a[i] is dropped at once)
                peak = held + chain.x[i] + chain.tape[i - 1] + chain.fwd_extra[i - 1]
                moves.append((peak, chain.f[i - 1], (stored | {i}, tapes | {i}, grad)))
        if grad in tapes and grad - 1 in stored:  # backward of the current layer
            peak = held + chain.x[grad - 1] + chain.bwd_extra[grad - 1]
            moves.append((peak, chain.b[grad - 1], (stored, tapes - {grad}, grad - 1)))
        for i in stored - {0}:
            if i + 1 not in tapes:  # a tape references its layer's input
                moves.append((held, 0.0, (stored - {i}, tapes, grad)))
        for peak, step, nxt in moves:
            if peak > budget:
                continue
            if cost + step < best.get(nxt, math.inf):
                best[nxt] = cost + step
                tie += 1
                heapq.heappush(queue, (cost + step, tie, nxt))
    return None


def random_chain(rng: random.Random, n: int) -> Chain:
    return Chain(
        f=tuple(rng.randint(1, 9) for _ in range(n)),
        b=tuple(rng.randint(0, 9) for _ in range(n)),
        x=tuple(rng.randint(0, 4) for _ in range(n + 1)),
        tape=tuple(rng.randint(0, 6) for _ in range(n)),
        fwd_extra=tuple(rng.randint(0, 3) for _ in range(n)),
        bwd_extra=tuple(rng.randint(0, 3) for _ in range(n)),
    )


def replay(chain: Chain, operations, budget: int) -> float:
    """Run a schedule through the operational model; fail on any broken rule."""
    stored, tapes, grad = {0}, set(), chain.n
    cost = 0.0

    def held() -> int:
        return (sum(chain.x[i] for i in stored) + sum(chain.tape[i - 1] for i in tapes)
                + chain.x[grad])

    for op, i in operations:
        if op == "free":
            assert i in stored and i != 0 and i + 1 not in tapes
            stored.discard(i)
        elif op in ("F", "Ftape"):
            assert i - 1 in stored and i not in stored
            extra = chain.x[i] + chain.fwd_extra[i - 1]
            extra += chain.tape[i - 1] if op == "Ftape" else 0
            assert held() + extra <= budget
            stored.add(i)
            if op == "Ftape":
                tapes.add(i)
            cost += chain.f[i - 1]
        else:
            assert op == "B" and grad == i and i in tapes and i - 1 in stored
            assert held() + chain.x[i - 1] + chain.bwd_extra[i - 1] <= budget
            tapes.discard(i)
            grad = i - 1
            cost += chain.b[i - 1]
    assert grad == 0
    return cost


@pytest.mark.parametrize("seed", range(60))
def test_dp_equals_search_over_every_schedule(seed):
    rng = random.Random(seed)
    chain = random_chain(rng, rng.randint(1, 5))
    floor = chain.x[0] + chain.x[-1]
    for budget in range(floor, floor + 26, 3):
        want = every_schedule_optimum(chain, budget)
        got = solve_chain(chain, budget)
        assert (got is None) == (want is None), (budget, want, got)
        if got is not None:
            assert got.cost == pytest.approx(want), (budget, chain)
            assert got.recompute == pytest.approx(got.cost - sum(chain.f) - sum(chain.b))


def revolve_chain(steps: int, slots: int) -> tuple[Chain, int]:
    """A homogeneous chain in revolve's setting, and the budget that means ``slots``
    checkpoints. Activations and gradients are 1 unit; a tape is so large that only one
    fits at a time, so a step is taped only just before its backward (revolve's adjoint
    step). The budget holds the ``slots`` checkpoints plus the input of the step being
    reversed, its output and its input's gradient, plus one tape: ``slots + 3 + tape``."""
    tape = slots + 4
    chain = Chain(f=(1,) * steps, b=(0,) * steps, x=(1,) * (steps + 1),
                  tape=(tape,) * steps, fwd_extra=(0,) * steps, bwd_extra=(0,) * steps)
    return chain, slots + 3 + tape


@pytest.mark.parametrize(("steps", "slots", "forward_steps"), [(100, 10, 222), (100, 20, 178)])
def test_revolve_anchor_values(steps, slots, forward_steps):
    assert revolve_closed_form(steps, slots) == forward_steps
    assert revolve_recurrence(steps, slots) == forward_steps
    chain, budget = revolve_chain(steps, slots)
    schedule = solve_chain(chain, budget)
    assert schedule is not None and schedule.recompute == forward_steps


def test_recurrence_equals_closed_form():
    for steps in range(1, 61):
        for slots in range(1, 12):
            assert revolve_recurrence(steps, slots) == revolve_closed_form(steps, slots)


def test_dp_reproduces_revolve_on_homogeneous_chains():
    for steps in range(1, 31):
        for slots in range(1, 7):
            chain, budget = revolve_chain(steps, slots)
            schedule = solve_chain(chain, budget)
            assert schedule is not None
            assert schedule.recompute == revolve_closed_form(steps, slots), (steps, slots)
        # below one checkpoint (the input) plus the step being reversed, nothing fits
        chain, budget = revolve_chain(steps, 1)
        assert (solve_chain(chain, budget - 1) is None) == (steps > 1)


@pytest.mark.parametrize("seed", range(30))
def test_schedule_replays_within_budget_and_is_its_region_tree(seed):
    rng = random.Random(100 + seed)
    chain = random_chain(rng, rng.randint(1, 9))
    budget = chain.x[0] + chain.x[-1] + rng.randint(4, 30)
    schedule = solve_chain(chain, budget)
    if schedule is None:
        return
    assert replay(chain, schedule.operations, budget) == pytest.approx(schedule.cost)
    for a, b in schedule.regions:  # nested or disjoint
        for c, d in schedule.regions:
            assert b <= c or d <= a or (a <= c and d <= b) or (c <= a and b <= d)
    forward = sum(chain.f[i - 1] for op, i in schedule.operations if op in ("F", "Ftape"))
    assert region_tree_cost(chain, schedule.regions) == pytest.approx(forward)


def test_more_memory_never_costs_more():
    rng = random.Random(7)
    chain = random_chain(rng, 12)
    enough = 2 * sum(chain.x) + sum(chain.tape) + max(chain.fwd_extra) + max(chain.bwd_extra)
    costs = [s.cost if (s := solve_chain(chain, m)) else math.inf
             for m in range(enough + 1)]
    assert costs == sorted(costs, reverse=True)
    assert costs[-1] == sum(chain.f) + sum(chain.b)


def test_discretise_is_conservative():
    units, budget = discretise([1000, 1, 2999], 10_000, slots=10)
    assert budget == 10 and units == [1, 1, 3]


def tree_operations(n: int, regions: list[tuple[int, int]]) -> list[tuple[str, int]]:
    """The schedule that nested recompute regions (0-based half-open ranges) run, written
    from the executor's rules: a scope sweeps its items forward (a region runs plainly,
    keeping its input; a layer outside sub-regions is taped), then walks them back (a
    region recomputes its own scope). A region that ends where its scope ends is the same
    as its items inlined (early stop)."""
    ops: list[tuple[str, int]] = []

    def scope(s: int, t: int, inner: set[tuple[int, int]]) -> None:  # layers s..t, 1-based
        inner = {r for r in inner if r[1] != t}  # inline regions ending at the scope's end
        top = sorted(r for r in inner if not any(o != r and o[0] <= r[0] and r[1] <= o[1]
                                                 for o in inner))
        items: list[tuple[int, int]] = []  # (first, last) layers, 1-based
        j = s
        while j <= t:
            region = next((r for r in top if r[0] + 1 == j), None)
            items.append((j, region[1]) if region else (j, j))
            j = region[1] + 1 if region else j + 1
        is_region = {it: it[1] > it[0] or (it[0] - 1, it[1]) in top for it in items}
        for first, last in items:
            if is_region[(first, last)]:
                for k in range(first, last + 1):
                    ops.append(("F", k))
                    if k > first:
                        ops.append(("free", k - 1))
            else:
                ops.append(("Ftape", first))
        ops.append(("free", t))
        for first, last in reversed(items):
            if is_region[(first, last)]:
                scope(first, last, {r for r in inner if first - 1 <= r[0] and r[1] <= last
                                    and r != (first - 1, last)})
            else:
                ops.append(("B", first))
            if first - 1 != s - 1:
                ops.append(("free", first - 1))

    scope(1, n, set(regions))
    return ops


def peak_and_cost(chain: Chain, operations) -> tuple[int, float]:
    stored, tapes, grad, cost, peak = {0}, set(), chain.n, 0.0, 0

    def held() -> int:
        return (sum(chain.x[i] for i in stored) + sum(chain.tape[i - 1] for i in tapes)
                + chain.x[grad])

    for op, i in operations:
        if op == "free":
            assert i in stored and i + 1 not in tapes
            stored.discard(i)
        elif op in ("F", "Ftape"):
            assert i - 1 in stored and i not in stored
            extra = chain.x[i] + chain.fwd_extra[i - 1]
            extra += chain.tape[i - 1] if op == "Ftape" else 0
            peak = max(peak, held() + extra)
            stored.add(i)
            if op == "Ftape":
                tapes.add(i)
            cost += chain.f[i - 1]
        else:
            assert grad == i and i in tapes and i - 1 in stored
            peak = max(peak, held() + chain.x[i - 1] + chain.bwd_extra[i - 1])
            tapes.discard(i)
            grad = i - 1
            cost += chain.b[i - 1]
    assert grad == 0 and stored == {0} and not tapes
    return max(peak, held()), cost


def laminar_families(ranges: list[tuple[int, int]]):
    for mask in range(1 << len(ranges)):
        family = [r for k, r in enumerate(ranges) if mask >> k & 1]
        if all(b <= c or d <= a or (a <= c and d <= b) or (c <= a and b <= d)
               for (a, b) in family for (c, d) in family):
            yield family


@pytest.mark.parametrize("seed", range(12))
def test_dp_with_allowed_regions_equals_best_region_tree(seed):
    """Restricted to some regions (as the module tree restricts them), the DP finds the
    cheapest tree of those regions; unrestricted, it equals the best tree of any regions."""
    rng = random.Random(300 + seed)
    n = rng.randint(2, 4)
    chain = random_chain(rng, n)
    every = [(a, b) for a in range(n) for b in range(a + 1, n + 1)]
    allowed = set(every) if seed % 3 == 0 else {r for r in every if rng.random() < 0.5}
    trees = [(peak_and_cost(chain, tree_operations(n, fam)), fam)
             for fam in laminar_families(sorted(allowed))]
    for budget in range(min(p for (p, _), _ in trees), max(p for (p, _), _ in trees) + 1):
        want = min(c for (p, c), _ in trees if p <= budget)
        got = solve_chain(chain, budget, allowed=lambda a, b: (a, b) in allowed)
        assert got is not None and got.cost == pytest.approx(want), (budget, allowed)
        assert set(got.regions) <= allowed
        if seed % 3 == 0:
            assert got.cost == pytest.approx(every_schedule_optimum(chain, budget))

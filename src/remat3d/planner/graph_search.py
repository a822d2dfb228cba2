"""Choosing what a graph plan recomputes: the least recompute cost whose exact liveness
(``liveness.py``) fits a budget.

NOTE [ Greedy on exact liveness ]
  1. Nothing recomputed is tried first: a budget the ordinary step fits needs no plan.
  2. Otherwise, repeatedly: the storages alive at the peak that the forward saved for the
     backward are the candidates (only they can lower that peak). A candidate is
     recomputed from tensors the forward saves anyway: with the ops between them (else
     its inputs would be saved in its place, and nothing gained). A candidate recomputed
     already is alive at the peak because a reader after it needs it: it is recomputed
     twice instead (``liveness.py`` NOTE rule 4), with the ops between it and the saved
     tensors. Each is ranked by its bytes per unit of the cost it adds; the best few
     (and the largest few) are simulated exactly, and the one that lowers the peak most
     per unit of cost is taken (``_gain``: where forward and backward peak alike,
     lowering either counts). Until the peak
     fits, or no candidate lowers it (then the smallest peak reached is reported).
  3. Then each recomputed storage, costliest first, is kept again if the peak still fits:
     the greedy steps may have taken more than the final peak needs.
  4. The steps of rule 2 do not depend on the budget, only where they stop does: the path
     taken on a graph is kept (for the last few graphs, in this process) and a later
     search on the same graph walks it before stepping further. Planning at the smallest
     peak an infeasible budget named, or again with a tightened target, costs a walk,
     not a second search; the choice is the one a fresh search makes.
  5. Where the greedy fits, seeds (plain lists of node names: torch's min-cut
     partitioner's choices down a ladder of its memory budgets, ``capture/mincut.py``)
     compete with it: each is simulated exactly, each that fits is leaned (rule 3), and
     the cheapest choice is taken (the greedy's on a tie). The cost of a seed does not
     fall with its fraction (the partitioner counts FLOPs; under the ``time`` objective
     memory-bound ops cost their traffic), so every one is asked for. A seed just above
     the budget (within ``_NEAR``) is stepped down by the greedy of rule 2 first: the
     partitioner's choice run by ``default_partition`` can peak a few bytes above its
     own run. Where the greedy does not fit, no seed is asked for (they reach no lower
     on the graphs measured, and each costs a partition).
  The cost of an op is its FLOPs; a memory-bound op (a norm, an activation, a ``cat``:
  no FLOPs counted) costs reading and writing its output at memory bandwidth, in FLOP
  equivalents (:class:`Costs`, shared with ``optimal``), under the ``time`` objective;
  under ``flops`` a millionth of that, which only breaks ties (``Costs.objective``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from remat3d.opgraph import OpGraph
from remat3d.planner.liveness import Liveness, closed_recompute, simulate
from remat3d.planner.optimal import Costs

__all__ = ["GraphChoice", "search_graph"]

# candidates simulated per step, by each ranking (NOTE rule 2): 24 chose the same on the
# zoo's U-Nets at 128³ and twice the time on ResEnc-L (2,442 nodes)
_EVALUATED = 12
_NEAR = 0.05  # a seed this far above the budget is stepped down (NOTE rule 5)


@dataclass
class GraphChoice:
    """What the search chose, and what it costs by the liveness model."""

    recompute: list[str]
    twice: list[str]  # of recompute, those recomputed again for late readers
    liveness: Liveness
    cost: float  # FLOPs and FLOP-equivalents recomputed
    fits: bool


def _cost(graph: OpGraph, liveness: Liveness, costs: Costs) -> float:
    total = 0.0
    for name in liveness.recomputed:
        node = graph[name]
        total += node.flops if node.flops else costs.pointwise_cost(node.bytes)
    return total


def search_graph(graph: OpGraph, budget_bytes: int, costs: Costs | None = None,
                 seeds: Iterable[Iterable[str]] = ()) -> GraphChoice:
    """The recompute set for ``budget_bytes`` (module NOTE), ``seeds`` the candidates of
    NOTE rule 5."""
    costs = costs or Costs()
    choice = _greedy(graph, budget_bytes, costs)
    if not choice.fits or not choice.recompute:
        return choice
    for seed in seeds:
        chosen = closed_recompute(graph, seed)
        live = simulate(graph, chosen)
        twice: frozenset[str] = frozenset()
        if budget_bytes < live.peak_bytes <= budget_bytes * (1 + _NEAR):
            path = _Path(live, [(frozenset(chosen), twice)], [live.peak_bytes])
            stepped, twice, live = _extend(graph, path, budget_bytes, costs)
            chosen = set(stepped)
        if live.peak_bytes <= budget_bytes:
            trial = _lean(graph, set(chosen), set(twice), live, budget_bytes, costs)
            if trial.cost < choice.cost:
                choice = trial
    return choice


def _greedy(graph: OpGraph, budget_bytes: int, costs: Costs) -> GraphChoice:
    """NOTE rules 1-4."""
    path = _path(graph, costs)
    # the greedy's steps made so far (NOTE rule 4): the first that fits, or step further
    fitting = next((i for i, peak in enumerate(path.peaks) if peak <= budget_bytes), None)
    if fitting is None:
        chosen, twice, live = _extend(graph, path, budget_bytes, costs)
    else:
        chosen, twice = path.states[fitting]
        live = simulate(graph, chosen, twice) if chosen else path.start
    if not chosen:
        return GraphChoice([], [], live, 0.0, live.peak_bytes <= budget_bytes)
    if live.peak_bytes > budget_bytes:
        lowest = min(range(len(path.peaks)), key=path.peaks.__getitem__)  # the first
        best_chosen, best_twice = path.states[lowest]
        best = simulate(graph, best_chosen, best_twice)
        return GraphChoice(sorted(best_chosen), _closed(graph, best_twice, best_chosen),
                           best, _cost(graph, best, costs), False)
    return _lean(graph, set(chosen), set(twice), live, budget_bytes, costs)


@dataclass
class _Path:
    """The greedy's steps on one graph (NOTE rule 4): they do not depend on the budget,
    which only decides where to stop."""

    start: Liveness
    states: list[tuple[frozenset[str], frozenset[str]]]  # (chosen, twice), step by step
    peaks: list[int]  # each state's peak
    done: bool = False  # no candidate lowered the peak any more


_PATHS: OrderedDict[tuple[str, str], _Path] = OrderedDict()
_PATHS_KEPT = 4


def _path(graph: OpGraph, costs: Costs) -> _Path:
    key = (graph.digest(), repr(costs))
    if key in _PATHS:
        _PATHS.move_to_end(key)
        return _PATHS[key]
    start = simulate(graph)
    path = _Path(start, [(frozenset(), frozenset())], [start.peak_bytes])
    _PATHS[key] = path
    if len(_PATHS) > _PATHS_KEPT:
        _PATHS.popitem(last=False)
    return path


def _extend(graph: OpGraph, path: _Path, budget_bytes: int, costs: Costs
            ) -> tuple[frozenset[str], frozenset[str], Liveness]:
    """NOTE rule 2 from the path's last state until the peak fits or no candidate lowers
    it; the path records each step."""
    chosen_, twice_ = path.states[-1]
    chosen, twice = set(chosen_), set(twice_)
    live = simulate(graph, chosen, twice) if chosen else path.start
    fixed = {n.name for n in graph.nodes if n.phase != "forward"} | set(graph.outputs)
    while live.peak_bytes > budget_bytes and not path.done:
        current_cost = _cost(graph, live, costs)
        ranked = []
        saved = set(live.saved)
        for storage in live.peak_live:
            if storage in fixed or storage in twice:
                continue
            chain = _from_saved(graph, storage, saved)
            # chosen is closed already, and closing distributes over a union
            extra = chosen | closed_recompute(graph, chain)
            if storage in chosen:  # recomputed already, and alive across the peak
                ranked.append((graph[storage].bytes, storage, extra, twice | chain))
                continue
            if extra == chosen:
                continue  # not recomputable
            added = [graph[n] for n in sorted(extra - chosen)]  # one order of sums
            guess = graph[storage].bytes / (1.0 + sum(
                n.flops or costs.pointwise_cost(n.bytes) for n in added))
            ranked.append((guess, storage, extra, twice))
        by_value = sorted(ranked, key=lambda r: -r[0])[:_EVALUATED]
        by_bytes = sorted(ranked, key=lambda r: -graph[r[1]].bytes)[:_EVALUATED]
        step = None
        for _, storage, extra, again in {r[1]: r for r in by_value + by_bytes}.values():
            trial = simulate(graph, extra, again)
            gain = _gain(live, trial)
            if gain <= 0:
                continue
            score = gain / (1.0 + _cost(graph, trial, costs) - current_cost)
            if step is None or score > step[0]:
                step = (score, extra, again, trial)
        if step is None:
            path.done = True
            break
        _, chosen, twice, live = step
        path.states.append((frozenset(chosen), frozenset(twice)))
        path.peaks.append(live.peak_bytes)
    return frozenset(chosen), frozenset(twice), live


def _gain(before: Liveness, after: Liveness) -> float:
    """How much lower ``after`` peaks: the step's peak, and (at a quarter the weight) the
    other phase's peak: where forward and backward peak alike, each candidate lowers one
    of them at a time, and the step's peak only falls after both (NOTE rule 2)."""
    if after.peak_bytes > before.peak_bytes:
        return 0.0
    both = before.forward_peak_bytes + before.backward_peak_bytes - \
        after.forward_peak_bytes - after.backward_peak_bytes
    return before.peak_bytes - after.peak_bytes + 0.25 * both


def _from_saved(graph: OpGraph, storage: str, saved: set[str]) -> set[str]:
    """``storage`` and the forward ops it is made from, back to tensors the forward saves
    anyway (``saved``: their storages): recomputed from those, it saves nothing new in its
    place."""
    found: set[str] = set()
    stack = [storage]
    while stack:
        name = stack.pop()
        node = graph[name]
        if name in found or node.phase != "forward":
            continue
        if name != storage and graph.storage(name) in saved:
            continue
        found.add(name)
        stack.extend(node.inputs)
    return found


def _lean(graph: OpGraph, chosen: set[str], twice: set[str], live: Liveness,
          budget_bytes: int, costs: Costs) -> GraphChoice:
    """NOTE rule 3: keep again what the fitting peak does not need recomputed."""
    roots = [n for n in chosen if graph[n].base is None and graph[n].op != "getitem"]
    # costliest first; among equal costs by name (a set's order varies between processes)
    roots.sort(key=lambda n: (-(graph[n].flops or costs.pointwise_cost(graph[n].bytes)), n))
    for root in roots:
        if root not in chosen:
            continue
        trial_set = closed_recompute(graph, chosen - {root} - {
            n.name for n in graph.nodes if n.base == root or
            (n.op == "getitem" and n.inputs and n.inputs[0] == root)})
        trial = simulate(graph, trial_set, twice & trial_set)
        if trial.peak_bytes <= budget_bytes:
            chosen, twice, live = trial_set, twice & trial_set, trial
    return GraphChoice(sorted(chosen), _closed(graph, twice, chosen), live,
                       _cost(graph, live, costs), True)


def _closed(graph: OpGraph, twice: set[str], chosen: set[str]) -> list[str]:
    """``twice`` as the step runs it: with the views and picks that go with each node
    (the simulation closes it so; the runtime takes the names as given)."""
    return sorted(closed_recompute(graph, twice) & chosen)

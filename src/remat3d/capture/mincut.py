"""torch's own min-cut partitioner, asked what it would recompute: seeds for the graph
search (``planner/graph_search.py`` NOTE rule 5).

NOTE [ The partitioner's choices as seeds ]
  1. ``torch.compile`` splits a joint graph with ``min_cut_rematerialization_partition``
     under ``activation_memory_budget`` (a fraction of the activations it would save): a
     min cut plus a knapsack over recomputable ops. Its choices are often cheap where the
     greedy on exact liveness is not (a run of pointwise ops recomputed for nothing in
     FLOPs), and its knapsack ignores which tensors are alive together, where the greedy
     does not; each misses what the other finds.
  2. Here it runs on the captured joint graph at a ladder of fractions (``FRACTIONS``:
     six, 0.9 down to 0.0; eleven until 2026-12-02, when each plan asked for all of them
     and partitioning was most of a small plan's time);
     what it recomputes is read from its backward graph (the forward ops found there by
     name), as plain lists of node names. remat3d's own partition (MUST_RECOMPUTE tags and
     ``default_partition``, ``runtime/graph_run.py``) then runs them, and the planner
     simulates each exactly like any other choice: a seed is a candidate, never trusted.
  3. A fraction the partitioner fails on (its solver, an op it does not know) gives no
     seed; the search never depends on one.
  4. Seeds are made one fraction at a time, when the search asks for the next, and kept
     (by the plain graph's content and the fraction): planning one step at several
     budgets asks the partitioner once per fraction.
  5. The partitioner's graph modules are made lazily (``_lazy_code``): it builds several
     per call, and their Python code, never run here, was half of its time.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections import OrderedDict
from collections.abc import Iterator

from remat3d.capture.joint import Captured

__all__ = ["FRACTIONS", "partitioner_choices"]

log = logging.getLogger(__name__)

# from saving most of what it would to recomputing all it can, every other tenth (each
# is a partition, ~0.5-1 s): torch.compile's usual settings are among them
FRACTIONS = (0.9, 0.7, 0.5, 0.3, 0.1, 0.0)
_KEPT: OrderedDict[tuple, list[str] | None] = OrderedDict()  # NOTE rule 4
_KEEP = 64  # (graph, fraction) pairs: a few graphs' ladders


def partitioner_choices(captured: Captured, fractions: tuple[float, ...] = FRACTIONS,
                        ) -> Iterator[list[str]]:
    """For each of ``fractions`` (``activation_memory_budget``), in turn and only when
    asked for, the forward nodes of ``captured``'s joint graph that torch's min-cut
    partitioner recomputes in backward (NOTE rules 2-4); a choice equal to an earlier
    one is not given again."""
    graph_key = captured.graph.digest()
    given: set[tuple[str, ...]] = set()
    for fraction in fractions:
        key = (graph_key, fraction)
        if key in _KEPT:
            _KEPT.move_to_end(key)
        else:
            _KEPT[key] = _ask(captured, fraction)
            if len(_KEPT) > _KEEP:
                _KEPT.popitem(last=False)
        chosen = _KEPT[key]
        if chosen is not None and tuple(chosen) not in given:
            given.add(tuple(chosen))
            yield list(chosen)


def _lazy_code() -> contextlib.AbstractContextManager:
    """GraphModules made without their Python code until it is run (NOTE rule 5): the
    partitioner's graphs are read, never run, and generating their code was half of each
    partition (0.8 s -> 0.35 s on basicunet's joint graph)."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # a torch without it: the code is generated, nothing else changes
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


def _ask(captured: Captured, fraction: float) -> list[str] | None:
    import torch._functorch.config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    with warnings.catch_warnings(), _lazy_code():
        # torch's own pytree deprecation, on copying
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        joint = copy.deepcopy(captured.joint)
    try:
        with functorch_config.patch(activation_memory_budget=fraction), _lazy_code():
            _, backward = min_cut_rematerialization_partition(
                joint, captured.joint_inputs, num_fwd_outputs=captured.num_fwd_outputs,
                compiler="inductor")
    except Exception as exc:  # noqa: BLE001 - NOTE rule 3: no seed, not an error
        log.info("min-cut partitioner at activation_memory_budget=%s: %s: %s",
                 fraction, type(exc).__name__, exc)
        return None
    forward = {n.name for n in captured.graph.forward}
    return sorted(n.name for n in backward.graph.nodes
                  if n.op == "call_function" and n.name in forward)

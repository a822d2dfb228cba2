"""Exact liveness of a graph plan: the peak bytes of a step whose forward saves some
tensors and whose backward recomputes the rest, read from an :class:`OpGraph`.

NOTE [ Simulating the partitioned step ]
  A graph plan names the forward nodes to recompute (``recompute``); every other forward
  tensor the backward reads is saved. The step then runs as torch's partitioner builds it
  (``runtime/graph_run.py`` tags the nodes and calls ``default_partition``), and this
  replays that run on the plain data:
  1. Forward: the forward ops in order. A storage lives from its op to its last use,
     longer if it is saved or a forward output (the caller holds the output through
     backward, ``instrument/step.py``'s NOTE [ What a step holds ]). A view keeps its
     base's storage alive; an op's outputs no node picks live for that op only.
  2. Backward: the backward ops in order, each preceded by the recomputed forward ops it
     needs that have not run yet, in forward order (torch's
     ``reordering_to_mimic_autograd_engine``). A saved tensor lives to its last backward
     use; gradients live to the step's end.
  3. Live bytes are taken after each op, its outputs made and its inputs not yet freed:
     the points at which the tracker samples, so the two agree op for op. A multi-output
     op makes the tensors its ``getitem`` nodes pick; the picks themselves run no op.
  Inputs (parameters, buffers, the model's inputs) live through the step; the tangent
  (the output's gradient) from the backward's start to its last use.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from remat3d.opgraph import OpGraph, OpNode

__all__ = ["Liveness", "closed_recompute", "simulate"]


@dataclass
class Liveness:
    """What one graph plan costs."""

    peak_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    saved_bytes: int  # the forward's tensors alive at its end, outputs excluded
    recompute_flops: int
    recompute_ops: int
    timeline: list[tuple[str, int]]  # (node, live bytes after it), forward then backward
    recomputed: list[str]  # the forward nodes the backward runs again, in its order
    peak_live: list[str]  # the storages alive at the peak (the nodes that made them)
    saved: list[str]  # the storages the forward saves for the backward


def closed_recompute(graph: OpGraph, recompute: Iterable[str]) -> set[str]:
    """``recompute`` with what must go with it: the views of a recomputed storage, and a
    multi-output op with all its outputs (``getitem``) when one of them is recomputed.
    Nodes that cannot be recomputed (random, mutating, reading a buffer the step updates)
    and non-forward nodes are left out."""
    def allowed(name: str) -> bool:
        node = graph[name]
        if node.op == "getitem":  # recomputed with the op it picks from
            return allowed(node.inputs[0])
        return node.phase == "forward" and node.recomputable

    chosen = {n for n in recompute if n in graph and allowed(n)}
    chosen |= {graph[n].inputs[0] for n in chosen if graph[n].op == "getitem"}
    for node in graph.forward:
        if node.base is not None and node.base in chosen:
            chosen.add(node.name)
        if node.op == "getitem" and node.inputs and node.inputs[0] in chosen:
            chosen.add(node.name)
    return chosen


class _Memory:
    def __init__(self) -> None:
        self.live: dict[str, int] = {}  # storage node -> bytes
        self.total = 0
        self.peak = 0
        self.peak_live: list[str] = []
        self.timeline: list[tuple[str, int]] = []

    def make(self, node: OpNode) -> None:
        if node.bytes and node.base is None:
            self.live[node.name] = node.bytes
            self.total += node.bytes

    def free(self, storage: str) -> None:
        self.total -= self.live.pop(storage, 0)

    def sample(self, transient: int = 0) -> None:
        if self.total + transient > self.peak:
            self.peak = self.total + transient
            self.peak_live = list(self.live)


def _uses(order: list[OpNode], graph: OpGraph) -> dict[str, int]:
    """The index in ``order`` of each storage's last use."""
    last: dict[str, int] = {}
    for i, node in enumerate(order):
        last[graph.storage(node.name)] = i
        for name in node.inputs:
            last[graph.storage(name)] = i
    return last


def _run(order: list[OpNode], graph: OpGraph, memory: _Memory, keep: set[str]) -> None:
    last = _uses(order, graph)
    for i, node in enumerate(order):
        if node.op != "getitem":  # a multi-output op makes what its getitems pick
            for made in (node, *graph.picks(node.name)):
                memory.make(made)
            memory.sample(node.transient_bytes)
            memory.timeline.append((node.name, memory.total + node.transient_bytes))
        for storage in {graph.storage(n) for n in node.inputs} | {graph.storage(node.name)}:
            if last.get(storage) == i and storage not in keep:
                memory.free(storage)


def _forward_graph(graph: OpGraph, saved: set[str]) -> list[OpNode]:
    """The forward ops the outputs and the saved tensors need (torch removes the rest)."""
    needed: set[str] = set()
    stack = [*graph.outputs, *saved]
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        stack.extend(graph[name].inputs)
    return [n for n in graph.forward if n.name in needed]


def simulate(graph: OpGraph, recompute: Iterable[str] = ()) -> Liveness:
    """The step's peak with ``recompute`` recomputed in backward (module NOTE)."""
    again = closed_recompute(graph, recompute)
    backward = graph.backward

    # what backward reads from forward: saved tensors, or recomputed from them
    saved: set[str] = set()
    needed = [name for node in backward for name in node.inputs]
    visited: set[str] = set()
    while needed:
        name = needed.pop()
        if name in visited:
            continue
        visited.add(name)
        node = graph[name]
        if node.phase != "forward":
            continue
        if name in again:
            needed.extend(node.inputs)
        else:
            saved.add(name)
    saved_storage = {graph.storage(n) for n in saved}

    memory = _Memory()
    resident = {n.name for n in graph.nodes if n.phase == "input"}
    for node in graph.nodes:
        if node.phase == "input":
            memory.make(node)
    memory.sample()
    outputs = {graph.storage(n) for n in graph.outputs}
    _run(_forward_graph(graph, saved), graph, memory, keep=resident | saved_storage | outputs)
    forward_peak = memory.peak
    saved_bytes = sum(b for s, b in memory.live.items()
                      if s in saved_storage and s not in outputs and s not in resident)

    # backward, the recomputed ops pulled in just before the first op that needs them
    order: list[OpNode] = []
    done = resident | set(memory.live) | saved
    position = {n.name: i for i, n in enumerate(graph.nodes)}

    def pull(name: str) -> list[OpNode]:
        stack, found = [name], []
        while stack:
            current = stack.pop()
            node = graph[current]
            if current in done or node.phase != "forward":
                continue
            done.add(current)
            found.append(node)
            stack.extend(node.inputs)
        return sorted(found, key=lambda n: position[n.name])

    recompute_flops, recomputed = 0, []
    tangents = [n for n in graph.nodes if n.phase == "tangent"]
    for node in tangents:
        memory.make(node)
    for node in backward:
        for name in node.inputs:
            for extra in pull(name):
                order.append(extra)
                recompute_flops += extra.flops
                recomputed.append(extra.name)
        order.append(node)
    forward_live = memory.peak_live
    memory.peak = 0
    memory.sample()
    gradients = {graph.storage(n) for n in graph.gradients}
    _run(order, graph, memory, keep=resident | outputs | gradients)
    return Liveness(
        peak_bytes=max(forward_peak, memory.peak),
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=memory.peak,
        saved_bytes=saved_bytes,
        recompute_flops=recompute_flops,
        recompute_ops=len(recomputed),
        timeline=memory.timeline,
        recomputed=recomputed,
        peak_live=forward_live if forward_peak > memory.peak else memory.peak_live,
        saved=sorted(saved_storage),
    )

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
  4. Recomputed twice (``again``, :func:`late_copies`): a recomputed tensor read early and
     late in backward (a U-Net's skip: by the decoder's first op, by the encoder's last)
     lives in between, over the backward's peak. For a node in ``again`` the backward's
     readers of it are split at the largest gap between consecutive readers: the early
     ones read the first recomputation, the late ones a second one run just before the
     first of them. Nodes are split last to first, so a copy's inputs that are in
     ``again`` are split in turn and the copy reads their late copies: a chain back to
     saved tensors is recomputed twice, and nothing of it lives across the gap. A
     multi-output op and its ``getitem`` picks are split alike (each pick's copy reads the
     op's copy). ``runtime/graph_run.py`` applies the same function to the backward graph
     torch builds, so the step that runs is the one simulated.
  Inputs (parameters, buffers, the model's inputs) live through the step; the tangent
  (the output's gradient) from the backward's start to its last use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from remat3d.graph import CostGraph
from remat3d.opgraph import OpGraph, OpNode, made_by

__all__ = ["AGAIN", "Floor", "Liveness", "closed_recompute", "convolution_floor", "late_copies",
           "recompute_floor",
           "simulate"]

AGAIN = "__again"  # the suffix of a second recomputation's name (NOTE rule 4)


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
    # the forward nodes the backward runs again, in its order (twice if recomputed twice)
    recomputed: list[str]
    peak_live: list[str]  # the storages alive at the peak (the nodes that made them)
    saved: list[str]  # the storages the forward saves for the backward


def closed_recompute(graph: OpGraph, recompute: Iterable[str]) -> set[str]:
    """``recompute`` with what must go with it: the views of a recomputed storage, and a
    multi-output op with all its outputs (``getitem``) when one of them is recomputed.
    Nodes that cannot be recomputed (random, mutating, reading a buffer the step updates)
    and non-forward nodes are left out."""
    chosen = {n for n in recompute if graph.recomputable(n)}
    chosen |= {graph[n].inputs[0] for n in chosen if graph[n].op == "getitem"}
    stack = list(chosen)
    while stack:  # a view's base and a pick's op come first: this is one forward sweep
        for name in graph.companions(stack.pop()):
            if name not in chosen:
                chosen.add(name)
                stack.append(name)
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


def _run(order: list[OpNode], memory: _Memory, keep: set[str],
         storage: Callable[[str], str], picks: Callable[[str], list[OpNode]],
         graph: OpGraph | None = None) -> None:
    """``order`` run on ``memory``. With ``graph`` (``storage`` and ``picks`` are the
    graph's own) a node of the graph's is read from :attr:`OpGraph.runs`: this loop is
    most of a simulation."""
    runs = graph.runs if graph is not None else {}
    steps = []
    for node in order:
        step = runs.get(node.name)
        if step is None or step[0] is not node:  # a copy (NOTE rule 4), or no graph
            step = (node, made_by(node, picks),
                    (storage(node.name), *map(storage, node.inputs)))
        steps.append(step)
    last: dict[str, int] = {}  # where each storage is used last
    for i, (_, _, touched) in enumerate(steps):
        for name in touched:
            last[name] = i
    # _Memory's make / sample / free, inlined
    live, timeline = memory.live, memory.timeline
    total, peak, peak_live = memory.total, memory.peak, memory.peak_live
    for i, (node, made, touched) in enumerate(steps):
        if made is not None:
            for name, nbytes in made:
                live[name] = nbytes
                total += nbytes
            now = total + node.transient_bytes
            if now > peak:
                peak, peak_live = now, list(live)
            timeline.append((node.name, now))
        for used in touched:  # freed once: a second free of a storage is a no-op
            if last[used] == i and used not in keep and used in live:
                total -= live.pop(used)
    memory.total, memory.peak, memory.peak_live = total, peak, peak_live


def late_copies(order: list[tuple[str, list[str]]], again: Iterable[str],
                ) -> list[tuple[str, str, list[str]]]:
    """``order`` (the backward's ops, recomputed ones included, as ``(name, inputs)``)
    with a second recomputation of each node of ``again`` for its late readers (NOTE
    rule 4), as ``(name, original name, inputs)`` in running order. A copy is named
    ``original + AGAIN``. Pure: the planner and the runtime both call it."""
    keys: dict[str, tuple[int, int]] = {}
    inputs: dict[str, list[str]] = {}
    original: dict[str, str] = {}
    readers: dict[str, list[str]] = {}
    for i, (name, names) in enumerate(order):
        keys[name], inputs[name], original[name] = (i, 0), list(names), name
        for used in dict.fromkeys(names):
            readers.setdefault(used, []).append(name)
    made = 0
    for node in sorted((n for n in set(again) if n in keys), key=keys.__getitem__,
                       reverse=True):
        ranked = sorted(readers.get(node, ()), key=keys.__getitem__)
        gap, split = 1, 0  # adjacent readers are never split
        for k in range(len(ranked) - 1):
            if keys[ranked[k + 1]][0] - keys[ranked[k]][0] > gap:
                gap, split = keys[ranked[k + 1]][0] - keys[ranked[k]][0], k + 1
        if not split:
            continue
        made += 1
        copy, late = node + AGAIN, ranked[split:]
        keys[copy] = (keys[late[0]][0], -made)  # just before its first reader
        inputs[copy], original[copy] = list(inputs[node]), node
        for reader in late:
            inputs[reader] = [copy if n == node else n for n in inputs[reader]]
        readers[node], readers[copy] = ranked[:split], late
        for used in dict.fromkeys(inputs[copy]):
            readers.setdefault(used, []).append(copy)
    return [(n, original[n], inputs[n]) for n in sorted(keys, key=keys.__getitem__)]


def _with_copies(graph: OpGraph, order: list[OpNode], again: set[str]
                 ) -> tuple[list[OpNode], Callable[[str], str], Callable[[str], list[OpNode]]]:
    """``order`` with the second recomputations of ``again`` (NOTE rule 4), and the
    storage and picks of its nodes, copies included."""
    if not again:
        return order, graph.storage, graph.picks
    steps = late_copies([(n.name, n.inputs) for n in order], again)
    owner: dict[str, str] = {}
    picks: dict[str, list[OpNode]] = {}
    out = []
    for name, source, names in steps:
        node = graph[source]
        base = node.base
        if base is not None:  # a view: of its input's storage (a copy's, maybe)
            base = owner[names[0]] if names[0] in owner else graph.storage(names[0])
        if name == source and names == node.inputs and base == node.base:
            out.append(node)
            continue
        copied = dataclasses.replace(node, name=name, inputs=names, base=base)
        owner[name] = name if base is None else base
        if node.op == "getitem" and names[0] != node.inputs[0]:
            picks.setdefault(names[0], []).append(copied)
        out.append(copied)
    for name, source, _ in steps:  # what a copied op makes and no copied pick takes
        if name != source and graph.picks(source):
            taken = {p.name[: -len(AGAIN)] for p in picks.get(name, [])}
            unpicked = sum(p.bytes for p in graph.picks(source) if p.name not in taken)
            index = next(i for i, n in enumerate(out) if n.name == name)
            out[index] = dataclasses.replace(
                out[index], transient_bytes=out[index].transient_bytes + unpicked)

    def storage(name: str) -> str:
        return owner[name] if name in owner else graph.storage(name)

    def picked(name: str) -> list[OpNode]:
        return picks[name] if name in picks else graph.picks(name)

    return out, storage, picked


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
    # an op's unneeded picks are made and dropped with it (they are in its order, so that
    # they are freed there, not alive into backward)
    return [n for n in graph.forward if n.name in needed
            or (n.op == "getitem" and n.inputs[0] in needed)]


def simulate(graph: OpGraph, recompute: Iterable[str] = (),
             twice: Iterable[str] = ()) -> Liveness:
    """The step's peak with ``recompute`` recomputed in backward, those of ``twice`` a
    second time for their late readers (module NOTE)."""
    again = closed_recompute(graph, recompute)
    backward = graph.backward

    # what backward reads from forward: saved tensors, or recomputed from them
    saved: set[str] = set()
    needed = list(graph.backward_reads)
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
    resident = {n.name for n in graph.inputs}
    for node in graph.inputs:
        memory.make(node)
    memory.sample()
    outputs = {graph.storage(n) for n in graph.outputs}
    _run(_forward_graph(graph, saved), memory, resident | saved_storage | outputs,
         graph.storage, graph.picks, graph)
    forward_peak = memory.peak
    saved_bytes = sum(b for s, b in memory.live.items()
                      if s in saved_storage and s not in outputs and s not in resident)

    # backward, the recomputed ops pulled in just before the first op that needs them
    order: list[OpNode] = []
    done = resident | set(memory.live) | saved
    position = graph.position

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
            # torch places an op's recomputed picks that backward reads right after it
            stack.extend(p.name for p in graph.picks(current)
                         if p.name in again and p.name in visited)
        return sorted(found, key=lambda n: position(n.name))

    recompute_flops, recomputed = 0, []
    tangents = [n for n in graph.nodes if n.phase == "tangent"]
    for node in tangents:
        memory.make(node)
    for node in backward:
        for name in node.inputs:
            if name not in done and name in again:  # (what pull would find nothing for)
                order.extend(pull(name))
        order.append(node)
    order, storage, picks = _with_copies(graph, order, closed_recompute(graph, twice) & again)
    for node in order:
        if node.phase == "forward":
            recompute_flops += node.flops
            recomputed.append(node.name.removesuffix(AGAIN))
    forward_live = memory.peak_live
    memory.peak = 0
    memory.sample()
    gradients = {graph.storage(n) for n in graph.gradients}
    _run(order, memory, resident | outputs | gradients, storage, picks,
         graph if storage == graph.storage else None)
    return Liveness(
        peak_bytes=max(forward_peak, memory.peak),
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=memory.peak,
        saved_bytes=saved_bytes,
        recompute_flops=recompute_flops,
        recompute_ops=len(recomputed),
        timeline=memory.timeline,
        recomputed=recomputed,
        peak_live=list(dict.fromkeys(  # a second recomputation stands for its original
            n.removesuffix(AGAIN) for n in
            (forward_live if forward_peak > memory.peak else memory.peak_live))),
        saved=sorted(saved_storage),
    )


@dataclass(frozen=True)
class Floor:
    """A lower bound on the peak of every graph plan (:func:`recompute_floor`)."""

    bytes: int
    node: str  # the backward op at which it is reached


def recompute_floor(graph: OpGraph) -> Floor:
    """A lower bound on the peak of the step under *any* recompute set, read without
    simulating one (NOTE [ The recompute floor ]).

    NOTE [ The recompute floor ]
      Recomputation changes which forward tensors live in backward, never the backward's
      own: its ops run in the graph's order, each once. So at each backward op these are
      alive whatever is recomputed (NOTE [ Simulating the partitioned step ] rules 2-3):
      the inputs, the forward's outputs (held by the caller), the backward's tensors made
      so far and read at this op or later (gradients: to the step's end), the tangent
      while it is read, the op's own outputs and transient bytes, and the storages of its
      forward inputs, saved or recomputed: a recomputed one is made again before it. The
      largest such sum over the backward is the floor. It is below or at the simulated
      peak of every recompute set (``tests/planner/test_liveness.py``), so a budget under
      it needs tiling or offload, and the graph search can be skipped."""
    storage = graph.storage
    always = {n.name: n.bytes for n in graph.nodes if n.phase == "input" and n.base is None}
    for name in graph.outputs:
        node = graph[storage(name)]
        always[node.name] = node.bytes
    fixed = sum(always.values())
    backward = [n for n in graph.nodes if n.phase in ("tangent", "backward")]
    index = {n.name: i for i, n in enumerate(backward)}
    # each backward storage's last reader among the backward ops (gradients: the end)
    last: dict[str, int] = {}
    for i, node in enumerate(backward):
        for name in node.inputs:
            root = storage(name)
            if root in index:
                last[root] = max(last.get(root, i), i)
    end = len(backward)
    for name in graph.gradients:
        if storage(name) in index:
            last[storage(name)] = end
    floor, at = fixed, ""
    live: dict[str, int] = {}  # backward storages made and still to be read
    for i, node in enumerate(backward):
        if node.op == "getitem":  # made by the op it picks from (rule 3)
            continue
        for made in (node, *graph.picks(node.name)):
            if made.base is None and made.bytes:
                live[made.name] = made.bytes
        forward = {storage(n) for n in node.inputs} - set(index) - set(always)
        total = (fixed + sum(live.values()) + node.transient_bytes
                 + sum(graph[f].bytes for f in forward))
        if total > floor:
            floor, at = total, node.name
        for name in [n for n in live if last.get(n, index[n]) <= i]:
            del live[name]
    return Floor(floor, at)


_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8,
             "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
_CONVOLUTIONS = {"Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                 "ConvTranspose3d"}


def convolution_floor(graph: CostGraph, amp: str | None, trainable: bool) -> Floor:
    """A lower bound on the peak of every untiled plan, graph or module, from the module
    profile alone: no capture (NOTE [ The recompute floor ], the convolution bound).

    The recompute floor needs the captured graph (seconds at 512³); this bound does not.
    When every parameter is trained (``trainable``), each convolution's backward runs
    once, whole, in every plan that does not tile it, and holds at once: the tensor it
    convolved (the gradient of its weight reads it; saved or recomputed, it exists), the
    gradient of its output, and, when its input came from another module (it needs a
    gradient: every parameter upstream is trained), the gradient of that input, as large
    as the input. Bytes are counted at the convolution's compute precision or less
    (``amp``: its inputs are cast to that first), its input as the single tensor the
    module read from another module (a module that read several is left out), plus the
    parameters. So it is below or at the recompute floor and the verified peak of every
    untiled plan (``tests/planner/test_floor.py``): a budget under it needs tiling, with
    no capture to find that out."""
    if not trainable:
        return Floor(0, "")
    amp_size = {"bf16": 2, "fp16": 2}.get(amp or "", 8)
    reads: dict[int, list] = {}
    for edge in graph.edges:
        reads.setdefault(edge.dst, []).append(edge)
    best, at = 0, ""
    for node in graph.nodes:
        edges = reads.get(node.id, [])
        if node.module_type not in _CONVOLUTIONS or node.children or len(edges) != 1:
            continue
        edge = edges[0]
        size = min(_ITEMSIZE.get(edge.dtype, 1), amp_size)
        held = math.prod(edge.shape) * size * (1 if edge.src == -1 else 2) + node.output_bytes
        if held > best:
            best, at = held, node.name
    return Floor(graph.param_bytes + best, at) if best else Floor(0, "")

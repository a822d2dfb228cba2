"""The planner's view of a step: a sequence of stages with a memory and cost model.

Pure Python over a :class:`~remat3d.graph.CostGraph` (no torch).

A *stage* is a unit the planner makes a decision for: one of the graph's blocks, or a
compute layer outside every block with the largest invocation around it that holds no
other compute layer (a single-conv ``ConvDropoutNormReLU`` unit: conv, norm and
activation, so a region can recompute or tile them all). What runs outside stages (a
container's own ops such as a concatenation) is *glue*: always kept. Stages are in
forward order.

NOTE [ The memory model ]
  For a decision d_s per stage (keep / recompute / offload), with S_s(d) the bytes stage s
  leaves alive for backward (keep: what it saved; recompute: its inputs; offload: nothing
  on the device):
  1. Forward, while stage s runs: ``base + sum_{t<s} S_t + fwd_delta_s``.
  2. Backward of stage s (reverse order):
     ``base + grads_after(s) + pending(s) + sum_{t<s} S_t + X_s(d_s)``, where
     ``pending(s)`` is the gradients of tensors that cross stage s (a skip connection's
     gradient lives from the decoder's backward to the encoder's), ``grads_after(s)`` the
     parameter gradients already made, and ``X_s`` what stage s holds while its backward
     runs: its saved tensors plus its backward transient (recompute: plus its inputs, and at
     least its forward transient while it is recomputed).
  Every term is a sum of stage figures, so the peak is linear in the decisions and the
  optimal plan is a small MILP. The model is conservative where it must guess (a region's
  inputs may already be saved by its producer); the plan is then *verified* by replaying
  it on the meta device under the tracker, and the verified peak is what counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from remat3d.decisions import Decision
from remat3d.graph import CostGraph, Node

__all__ = ["KEEP", "OFFLOAD", "RECOMPUTE", "Stage", "StageModel", "build_stages"]

# the planner's decisions (remat3d.decisions): SELECTIVE recomputes, keeping the outputs
# of compute-heavy ops
KEEP, RECOMPUTE, OFFLOAD = Decision.KEEP, Decision.RECOMPUTE, Decision.OFFLOAD
SELECTIVE = Decision.SELECTIVE


@dataclass
class Stage:
    """One decision unit, with inclusive figures from the graph."""

    index: int
    node: int  # CostGraph node id
    name: str
    call_index: int
    saved_bytes: int
    input_bytes: int
    output_bytes: int
    fwd_flops: int
    fwd_delta: int
    bwd_delta: int
    param_bytes: int
    is_block: bool = False
    heavy_bytes: int = 0  # outputs of compute layers (convs, matmuls) inside the stage
    writes_input: bool = False  # its module writes into an input: not recomputable alone

    def kept(self, decision: str) -> int:
        """S_s(d): bytes the stage leaves on the device for backward."""
        if decision == RECOMPUTE:
            return self.input_bytes
        if decision == SELECTIVE:
            return self.input_bytes + min(self.heavy_bytes, self.saved_bytes)
        if decision == OFFLOAD:
            return 0
        return self.saved_bytes

    def held_in_backward(self, decision: str) -> int:
        """X_s(d): bytes the stage holds while its own backward runs."""
        body = self.saved_bytes + self.bwd_delta
        if decision in (RECOMPUTE, SELECTIVE):
            return self.input_bytes + max(self.fwd_delta, body)
        return body


@dataclass
class StageModel:
    """Stages plus the decision-independent terms of the memory model."""

    stages: list[Stage]
    base: int  # parameters, buffers, inputs
    glue_saved: list[int]  # glue saved bytes kept before stage s (prefix, by position)
    pending: list[int]  # gradients crossing each stage
    grads_after: list[int]  # parameter gradients made after each stage (in forward order)
    unplanned_peak: int = 0
    notes: list[str] = field(default_factory=list)
    # invocations that hold two or more stages: (name, call index, stage indices), outermost
    # first; regions on them nest (the `recursive` strategy)
    containers: list[tuple[str, int, list[int]]] = field(default_factory=list)
    # nn.Sequential invocations outside stages: (name, call index, [(child name, stage
    # indices inside that child)]); a run of children is a segment region
    sequences: list[tuple[str, int, list[tuple[str, list[int]]]]] = field(
        default_factory=list)

    def peak(self, decisions: list[str]) -> int:
        """Predicted peak bytes of the step for one decision per stage."""
        kept = [s.kept(d) for s, d in zip(self.stages, decisions)]
        before = 0
        worst = self.base
        for s, (stage, decision) in enumerate(zip(self.stages, decisions)):
            prefix = self.base + before + self.glue_saved[s]
            worst = max(worst, prefix + stage.fwd_delta)
            worst = max(worst, prefix + self.grads_after[s] + self.pending[s]
                        + stage.held_in_backward(decision))
            before += kept[s]
        return worst

    def recompute_flops(self, decisions: list[str]) -> int:
        """Counted FLOPs recomputed (a selective stage redoes only uncounted ops)."""
        return sum(s.fwd_flops for s, d in zip(self.stages, decisions) if d == RECOMPUTE)


def _subtree(graph: CostGraph, node: Node) -> set[int]:
    out, stack = {node.id}, list(node.children)
    while stack:
        k = stack.pop()
        out.add(k)
        stack.extend(graph.nodes[k].children)
    return out


def build_stages(graph: CostGraph) -> StageModel:
    """Cut the graph into stages (blocks and loose compute leaves) and measure the terms."""
    blocks = graph.blocks()
    inside: dict[int, int] = {}  # node id -> stage node id
    for b in blocks:
        for k in _subtree(graph, b):
            inside[k] = b.id
    heads = [b.id for b in blocks]
    block_ids = set(heads)
    layers = graph.compute_layers()
    for n in graph.nodes:
        if n.is_leaf and n.self_fwd_flops and n.id not in inside:
            # a loose compute layer's stage is the largest invocation around it that holds
            # no other compute layer (a conv-norm-act unit: its norm and activation are
            # the stage's, not glue), the model itself excepted
            top = n
            while top.parent is not None and graph.nodes[top.parent].parent is not None \
                    and layers[top.parent] == 1 and top.parent not in inside:
                top = graph.nodes[top.parent]
            heads.append(top.id)
            for k in _subtree(graph, top):
                inside[k] = top.id
    heads.sort()
    position = {h: i for i, h in enumerate(heads)}

    def stage_of(node_id: int) -> int | None:
        head = inside.get(node_id)
        return None if head is None else position[head]

    # a node that is neither in a stage nor an ancestor of one is glue; so are the own ops
    # of ancestors. Glue saved bytes count from the first stage after them.
    glue_at = [0] * (len(heads) + 1)
    for n in graph.nodes:
        if n.id in inside:
            continue
        later = [position[h] for h in heads if h > n.id]
        glue_at[later[0] if later else len(heads)] += n.self_saved_bytes
    glue_saved = []
    running = 0
    for s in range(len(heads)):
        running += glue_at[s]
        glue_saved.append(running)

    stages = [_stage(graph, i, h, h in block_ids) for i, h in enumerate(heads)]

    pending = [0] * len(stages)
    for e in graph.edges:
        if e.src < 0:
            continue
        first, last = stage_of(e.src), stage_of(e.dst)
        if first is None or last is None or first == last:
            continue
        for s in range(first, min(last, len(stages))):
            pending[s] += e.bytes
    grads_after = [0] * len(stages)
    running = 0
    for s in range(len(stages) - 1, -1, -1):
        grads_after[s] = running
        running += stages[s].param_bytes
    model = StageModel(
        stages=stages,
        base=graph.param_bytes + graph.buffer_bytes + graph.input_bytes,
        glue_saved=glue_saved, pending=pending, grads_after=grads_after,
    )
    model.unplanned_peak = graph.peak_bytes
    _nesting(graph, model, inside, heads)
    return model


def _stage(graph: CostGraph, index: int, head: int, is_block: bool) -> Stage:
    """The stage whose module is node ``head``, with its measured terms."""
    node = graph.nodes[head]
    members = _subtree(graph, node)
    seen: set[tuple[int, tuple[int, ...]]] = set()
    input_bytes = 0
    for e in graph.edges:
        if e.dst in members and e.src not in members:
            key = (e.src, tuple(e.shape))
            if key not in seen:
                seen.add(key)
                input_bytes += e.bytes
    return Stage(
        index=index, node=head, name=node.name, call_index=node.call_index,
        saved_bytes=node.saved_bytes, input_bytes=input_bytes,
        output_bytes=node.output_bytes, fwd_flops=node.fwd_flops,
        fwd_delta=node.fwd_peak_delta_bytes, bwd_delta=node.bwd_peak_delta_bytes,
        param_bytes=sum(graph.nodes[k].param_bytes for k in members),
        is_block=is_block,
        heavy_bytes=sum(graph.nodes[k].output_bytes for k in members
                        if graph.nodes[k].self_fwd_flops and graph.nodes[k].is_leaf),
        writes_input=node.writes_input,
    )


def _nesting(graph: CostGraph, model: StageModel, inside: dict[int, int],
             heads: list[int]) -> None:
    """The regions above stages: containers covering two or more stages, and the runs of
    children of every ``nn.Sequential`` (nested plans are made of them)."""
    position = {h: i for i, h in enumerate(heads)}
    for n in graph.nodes:
        if n.id in inside or n.parent is None:
            continue
        covered = [position[h] for h in heads if h in _subtree(graph, n)]
        if len(covered) >= 2:
            model.containers.append((n.name, n.call_index, covered))
    for n in graph.nodes:
        if n.id in inside or n.module_type != "Sequential" or len(n.children) < 2:
            continue
        children = []
        for c in n.children:
            child = graph.nodes[c]
            members = _subtree(graph, child)
            local = child.name[len(n.name) + 1:] if n.name else child.name
            children.append((local, [position[h] for h in heads if h in members]))
        model.sequences.append((n.name, n.call_index, children))

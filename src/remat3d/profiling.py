"""``remat3d.profile``: one instrumented training step -> :class:`Profile` (with a CostGraph)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat3d.graph import CostGraph, Edge, Node, atomic_write_text
from remat3d.instrument.ledger import unique_storage_bytes
from remat3d.instrument.step import prepare_step, run_step
from remat3d.instrument.tracker import MemoryTracker
from remat3d.units import format_bytes, format_shape, parse_amp

__all__ = ["Profile", "graph_from_tracker", "profile"]

PROFILE_SCHEMA = "remat3d.profile/1"


@dataclass
class Profile:
    """The cost of one training step, measured by the tracker.

    Whole-step figures (also top-level keys of the JSON): ``peak_bytes`` (every live tensor
    on the device from the start of forward to the end of backward: parameters, buffers,
    inputs, activations, gradients), ``saved_bytes`` (activations alive at the end of
    forward: what autograd keeps for backward), ``param_bytes``, ``flops`` (forward +
    backward). ``breakdown`` splits the peak by category; ``timeline`` has one event per op.
    """

    graph: CostGraph
    breakdown: dict[str, int] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    peak_event: int | None = None

    @property
    def peak_bytes(self) -> int:
        return self.graph.peak_bytes

    @property
    def saved_bytes(self) -> int:
        return self.graph.saved_bytes

    @property
    def param_bytes(self) -> int:
        return self.graph.param_bytes

    @property
    def flops(self) -> int:
        return self.graph.flops

    @property
    def peak_phase(self) -> str:
        if self.peak_event is None:
            return "setup"
        return str(self.timeline[self.peak_event]["phase"])

    @property
    def peak_where(self) -> str:
        return f"in {self.peak_phase}, at {self.peak_node}"

    @property
    def peak_node(self) -> str:
        """The module invocation running when the peak was reached."""
        if self.peak_event is None:
            return "(before the step)"
        node = self.timeline[self.peak_event]["node"]
        return "(outside the model)" if node is None else self.graph.nodes[node].label

    def to_dict(self) -> dict[str, Any]:
        data = self.graph.to_dict()
        data["schema"] = PROFILE_SCHEMA
        data["breakdown"] = dict(self.breakdown)
        data["peak_event"] = self.peak_event
        data["timeline"] = list(self.timeline)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        return cls(
            graph=CostGraph.from_dict(data),
            breakdown=dict(data.get("breakdown", {})),
            timeline=list(data.get("timeline", [])),
            peak_event=data.get("peak_event"),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def summary(self) -> str:
        g = self.graph
        shapes = " ".join(format_shape(s) for s in g.input_shapes)
        lines = [
            f"{g.model} {shapes} on {g.device}, amp={g.amp or 'none'}",
            f"  peak        {format_bytes(self.peak_bytes)} ({self.peak_where})",
            f"  saved       {format_bytes(self.saved_bytes)} for backward",
            f"  parameters  {format_bytes(self.param_bytes)}",
            f"  FLOPs       {self.flops / 1e12:.3f} T (forward {g.forward_flops / 1e12:.3f} T)",
        ]
        return "\n".join(lines)


def profile(
    model: nn.Module,
    *inputs: Any,
    device: str | torch.device = "meta",
    amp: str | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    time_ops: bool | None = None,
) -> Profile:
    """Measure one training step of ``model`` on ``inputs``.

    Args:
        model: any ``nn.Module``; it is not modified (see NOTE in ``instrument/step.py``).
        inputs: example inputs (tensors, or shape tuples meaning random fp32 volumes).
        device: ``"meta"`` (default: no memory allocated, any size), ``"cpu"`` or ``"cuda"``.
        amp: ``None``, ``"bf16"`` or ``"fp16"``. On meta, CUDA autocast's rules are applied
            (the profile predicts a GPU); on a real device, that device's autocast runs.
        loss_fn: ``loss_fn(output) -> scalar``; default: mean of the outputs.
        time_ops: record per-node wall time (default: on for real devices).

    >>> import torch, remat3d
    >>> net = torch.nn.Sequential(torch.nn.Conv3d(1, 8, 3, padding=1), torch.nn.ReLU(),
    ...                           torch.nn.Conv3d(8, 1, 1))
    >>> prof = remat3d.profile(net, (1, 1, 32, 32, 32))
    >>> prof.graph.find("1").saved_bytes  # ReLU keeps its output: 8 x 32^3 x 4 bytes
    1048576
    """
    setup = prepare_step(model, inputs, device, amp, loss_fn)
    if time_ops is None:
        time_ops = setup.device != "meta"
    tracker = run_step(setup, time_ops=time_ops)
    try:
        graph = graph_from_tracker(tracker, setup.model, setup.inputs, amp)
        return Profile(
            graph=graph,
            breakdown=tracker.peak_breakdown(),
            timeline=_timeline(tracker, graph),
            peak_event=tracker.peak_event,
        )
    finally:
        tracker.close()


def _timeline(tracker: MemoryTracker, graph: CostGraph) -> list[dict[str, Any]]:
    """Timeline events with graph node ids.

    The tracker numbers every invocation, recomputations included; the graph has the
    forward ones only. A recomputation is attributed to the forward node of the same module
    and call index (the invocation it replays).
    """
    assert tracker.invocations is not None
    by_key = {(n.name, n.call_index): n.id for n in graph.nodes}
    node_of: dict[int, int | None] = dict(_forward_node_ids(tracker))
    for inv in tracker.invocations.invocations:
        if inv.phase != "forward":
            node_of[inv.id] = by_key.get((inv.name, inv.call_index))
    events = []
    for e in tracker.timeline:
        event = asdict(e)
        event["node"] = None if e.node is None else node_of.get(e.node)
        events.append(event)
    return events


def _forward_node_ids(tracker: MemoryTracker) -> dict[int, int]:
    """Tracker invocation id -> CostGraph node id, for forward invocations."""
    assert tracker.invocations is not None
    forward = [i for i in tracker.invocations.invocations if i.phase == "forward"]
    return {inv.id: k for k, inv in enumerate(forward)}


def graph_from_tracker(
    tracker: MemoryTracker, model: nn.Module, inputs: tuple, amp: str | None
) -> CostGraph:
    """Turn what the tracker recorded in forward/backward into a :class:`CostGraph`."""
    assert tracker.invocations is not None
    invocations = [i for i in tracker.invocations.invocations if i.phase == "forward"]
    node_of = _forward_node_ids(tracker)
    nodes = [
        Node(
            id=k,
            name=inv.name,
            module_type=inv.module_type,
            call_index=inv.call_index,
            parent=node_of.get(inv.parent) if inv.parent is not None else None,
            depth=inv.depth,
            children=[node_of[c] for c in inv.children if c in node_of],
            output_shape=inv.output_shape,
            output_dtype=inv.output_dtype,
            output_bytes=inv.output_bytes,
            param_bytes=inv.param_bytes,
            writes_input=inv.writes_input,
            self_fwd_flops=tracker.node_flops.get((inv.id, "forward"), 0),
            self_bwd_flops=tracker.node_flops.get((inv.id, "backward"), 0),
        )
        for k, inv in enumerate(invocations)
    ]
    unattributed = {
        "saved_bytes": 0,
        "fwd_flops": tracker.node_flops.get((None, "forward"), 0),
        "bwd_flops": tracker.node_flops.get((None, "backward"), 0),
    }
    for record in tracker.saved_records or []:
        k = node_of.get(record.producer) if record.producer is not None else None
        if k is None:
            unattributed["saved_bytes"] += record.nbytes
        else:
            nodes[k].self_saved_bytes += record.nbytes

    # Inclusive figures: ids are in pre-order, so children come after their parent.
    for n in nodes:
        n.saved_bytes, n.fwd_flops, n.bwd_flops = (
            n.self_saved_bytes, n.self_fwd_flops, n.self_bwd_flops)
    for n in reversed(nodes):
        if n.parent is not None:
            p = nodes[n.parent]
            p.saved_bytes += n.saved_bytes
            p.fwd_flops += n.fwd_flops
            p.bwd_flops += n.bwd_flops

    _peak_deltas(tracker, invocations, node_of, nodes)
    if tracker.node_seconds:
        _seconds(tracker, node_of, nodes)

    edges = [
        Edge(src=-1 if e.src == -1 else node_of[e.src], dst=node_of[e.dst], bytes=e.bytes,
             dtype=e.dtype, shape=list(e.shape))
        for e in tracker.edges.values()
        if (e.src == -1 or e.src in node_of) and e.dst in node_of
    ]
    return CostGraph(
        nodes=nodes,
        edges=edges,
        model=type(model).__name__,
        input_shapes=[list(x.shape) for x in inputs if isinstance(x, torch.Tensor)],
        amp=parse_amp(amp),
        device=tracker.device,
        peak_bytes=tracker.peak_bytes,
        saved_bytes=tracker.saved_bytes,
        param_bytes=unique_storage_bytes(list(model.parameters())),
        buffer_bytes=unique_storage_bytes(list(model.buffers())),
        input_bytes=unique_storage_bytes([x for x in inputs if isinstance(x, torch.Tensor)]),
        forward_flops=tracker.flops["forward"],
        backward_flops=tracker.flops["backward"] + tracker.flops["recompute"],
        unattributed=unattributed,
    )


def _peak_deltas(tracker: MemoryTracker, invocations: list, node_of: dict[int, int],
                 nodes: list[Node]) -> None:
    timeline = tracker.timeline
    for inv in invocations:
        events = timeline[inv.timeline_start:inv.timeline_end]
        if events:
            top = max(e.live_after for e in events)
            nodes[node_of[inv.id]].fwd_peak_delta_bytes = max(0, top - inv.live_at_entry)
    entry: dict[int, int] = {}
    top_bwd: dict[int, int] = {}
    assert tracker.invocations is not None
    for event in timeline[tracker.forward_end_event:]:
        if event.phase != "backward" or event.node is None:
            continue
        for inv_id in tracker.invocations.ancestors(event.node):
            k = node_of.get(inv_id)
            if k is None:
                continue
            entry.setdefault(k, event.live_before)
            top_bwd[k] = max(top_bwd.get(k, 0), event.live_after)
    for k, top in top_bwd.items():
        nodes[k].bwd_peak_delta_bytes = max(0, top - entry[k])


def _seconds(tracker: MemoryTracker, node_of: dict[int, int], nodes: list[Node]) -> None:
    for n in nodes:
        n.fwd_seconds, n.bwd_seconds = 0.0, 0.0
    for (inv_id, phase), seconds in tracker.node_seconds.items():
        k = node_of.get(inv_id) if inv_id is not None else None
        if k is None:
            continue
        field_name = "fwd_seconds" if phase == "forward" else "bwd_seconds"
        setattr(nodes[k], field_name, getattr(nodes[k], field_name) + seconds)
    for n in reversed(nodes):
        if n.parent is not None:
            p = nodes[n.parent]
            p.fwd_seconds = (p.fwd_seconds or 0.0) + (n.fwd_seconds or 0.0)
            p.bwd_seconds = (p.bwd_seconds or 0.0) + (n.bwd_seconds or 0.0)


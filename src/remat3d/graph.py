"""CostGraph: what one training step of a model costs, as plain data.

The planner reads this and nothing else, so it imports no torch: a CostGraph is a list of
:class:`Node` (module invocations in execution order) and :class:`Edge` (tensors passed
between invocations in forward), plus whole-step figures, and round-trips through JSON.

Conventions
  - Node ids are execution order of the forward; ``parent`` is the enclosing invocation
    (``None`` for the model itself), so a node's ``children`` run inside it.
  - Figures without ``self_`` are *inclusive* (the node and everything inside it: what a
    region around the node covers); ``self_`` figures count only ops run directly in the
    node's own ``forward``, so ``self_`` figures over all nodes sum to the whole step
    (plus :attr:`CostGraph.unattributed`, the loss computed outside the model).
  - ``saved_bytes``: bytes the node's ops produced that are still alive at the end of
    forward, i.e. what the autograd graph keeps for backward (parameters, buffers and
    inputs excluded: they are alive anyway).
  - ``fwd_peak_delta_bytes``: highest live bytes during the node's forward minus live
    bytes at its entry; ``bwd_peak_delta_bytes`` likewise for its backward ops.
  - Edge ``src`` is ``-1`` for the model input. ``span`` = ``dst - src`` in execution order:
    a U-Net's skip connections are the edges with a large span.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from remat3d.errors import GraphError

__all__ = ["GRAPH_SCHEMA", "CostGraph", "Edge", "Node", "atomic_write_text"]

GRAPH_SCHEMA = "remat3d.costgraph/1"


@dataclass
class Node:
    id: int
    name: str  # module qualified name, "" for the model itself
    module_type: str
    call_index: int
    parent: int | None
    depth: int
    children: list[int] = field(default_factory=list)
    output_shape: list[int] | None = None
    output_dtype: str | None = None
    output_bytes: int = 0
    param_bytes: int = 0  # the module's own parameters, not its children's
    saved_bytes: int = 0
    self_saved_bytes: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    self_fwd_flops: int = 0
    self_bwd_flops: int = 0
    fwd_peak_delta_bytes: int = 0
    bwd_peak_delta_bytes: int = 0
    writes_input: bool = False  # wrote in place into an input: never a recompute region alone
    fwd_seconds: float | None = None
    bwd_seconds: float | None = None

    @property
    def label(self) -> str:
        """``name`` with the call index when the module ran more than once: ``enc#1``."""
        base = self.name or "(model)"
        return base if self.call_index == 0 else f"{base}#{self.call_index}"

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass
class Edge:
    src: int  # -1: the model input
    dst: int
    bytes: int
    dtype: str
    shape: list[int]

    @property
    def span(self) -> int:
        return self.dst - self.src


@dataclass
class CostGraph:
    nodes: list[Node]
    edges: list[Edge]
    model: str = ""
    input_shapes: list[list[int]] = field(default_factory=list)
    amp: str | None = None
    device: str = "meta"
    peak_bytes: int = 0
    saved_bytes: int = 0
    param_bytes: int = 0
    buffer_bytes: int = 0
    input_bytes: int = 0
    forward_flops: int = 0
    backward_flops: int = 0
    unattributed: dict[str, int] = field(default_factory=dict)

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if n.is_leaf]

    def compute_layers(self) -> list[int]:
        """Per invocation, how many compute layers (invocations whose own ops have FLOPs)
        it holds, itself included."""
        layers = [0] * len(self.nodes)
        for n in reversed(self.nodes):
            if n.self_fwd_flops:
                layers[n.id] += 1
            if n.parent is not None:
                layers[n.parent] += layers[n.id]
        return layers

    def blocks(self) -> list[Node]:
        """The network's blocks: what "checkpoint every block" means in MONAI/HF/timm.

        A compute layer is an invocation whose own ops have FLOPs (a convolution, a linear
        layer, an attention's matmuls). A *unit* is a smallest invocation holding two or
        more compute layers (a conv-norm-act-conv ``UnetBasicBlock``, a ResNet block, an
        attention or MLP block). A block is the largest invocation that still holds at
        most one unit (a decoder ``UnetUpBlock``: transposed conv + concatenation + unit)
        and two or more compute layers.
        """
        layers = self.compute_layers()
        units = [0] * len(self.nodes)
        for n in reversed(self.nodes):
            if layers[n.id] >= 2 and all(layers[c] < 2 for c in n.children):
                units[n.id] += 1
            if n.parent is not None:
                units[n.parent] += units[n.id]
        candidate = [layers[n.id] >= 2 and units[n.id] <= 1 for n in self.nodes]
        return [n for n in self.nodes
                if candidate[n.id] and (n.parent is None or not candidate[n.parent])]

    def find(self, name: str, call_index: int = 0) -> Node:
        for n in self.nodes:
            if n.name == name and n.call_index == call_index:
                return n
        raise KeyError(f"No invocation {name!r} (call {call_index}) in the graph.")

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("nodes", "edges")}
        data["schema"] = GRAPH_SCHEMA
        data["flops"] = self.flops
        data["nodes"] = [asdict(n) for n in self.nodes]
        data["edges"] = [asdict(e) for e in self.edges]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostGraph:
        schema = data.get("schema", GRAPH_SCHEMA)
        if not str(schema).startswith("remat3d."):
            raise GraphError(f"Not a remat3d cost graph (schema {schema!r}); load a file that "
                             "remat3d profile --json wrote.")
        names = {f.name for f in fields(cls)} - {"nodes", "edges"}
        node_fields = {f.name for f in fields(Node)}
        edge_fields = {f.name for f in fields(Edge)}
        return cls(
            nodes=[Node(**{k: v for k, v in n.items() if k in node_fields})
                   for n in data["nodes"]],
            edges=[Edge(**{k: v for k, v in e.items() if k in edge_fields})
                   for e in data["edges"]],
            **{k: v for k, v in data.items() if k in names},
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostGraph:
        return cls.from_dict(json.loads(Path(path).read_text()))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never half-written)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

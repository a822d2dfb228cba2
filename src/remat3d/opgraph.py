"""OpGraph: one training step's aten ops, forward and backward, as plain data.

The CostGraph (``graph.py``) sees module invocations; this sees every op of the step as
AOTAutograd traces it (``capture/joint.py``): the convolutions inside modules and the
``cat``, ``add`` and ``interpolate`` a parent's ``forward`` runs itself alike. The graph
planner (``planner/liveness.py``) reads this and nothing else, so it imports no torch.

Conventions
  - ``nodes`` are in the joint graph's order: inputs (parameters, buffers, the model's
    inputs), forward ops, the tangent (the output's gradient), backward ops.
  - ``bytes`` is the storage a node makes. A view (``view``, ``slice``, ``detach``...) makes
    none: ``base`` names the node whose storage it shares (followed to the root). An op
    with several outputs makes none itself; the ``getitem`` nodes that pick them each make
    theirs, and outputs no node picks are ``transient_bytes`` of the op, freed at once.
  - ``phase``: ``"input"`` (alive through the step), ``"forward"``, ``"tangent"`` or
    ``"backward"``. ``outputs`` are the forward's outputs (held by the caller) and
    ``gradients`` the backward's results (alive to the step's end, then ``.grad``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from remat3d.errors import GraphError

__all__ = ["OPGRAPH_SCHEMA", "OpGraph", "OpNode", "made_by"]

OPGRAPH_SCHEMA = "remat3d.opgraph/1"


@dataclass
class OpNode:
    name: str  # the FX node's name: stable for one model, input shape and precision
    op: str  # the aten op ("convolution", "cat"), or "input" / "tangent"
    phase: str  # "input", "forward", "tangent" or "backward"
    inputs: list[str] = field(default_factory=list)  # tensor arguments, by node name
    bytes: int = 0
    base: str | None = None  # a view: the node whose storage it shares
    transient_bytes: int = 0  # outputs of a multi-output op that no node picks
    flops: int = 0
    recomputable: bool = True  # False: random or side-effecting ops (run exactly once)
    # the module whose forward ran it ("" the model's own forward; None: not known), for
    # reports (capture/joint.py NOTE rule 10)
    module: str | None = None


def made_by(node: OpNode, picks: Callable[[str], list[OpNode]]
            ) -> tuple[tuple[str, int], ...] | None:
    """The storages running ``node`` makes, with their bytes: its own, and those of the
    ``getitem`` nodes ``picks(node.name)`` returns (picking its outputs); None for a
    ``getitem`` (its op makes what it picks)."""
    if node.op == "getitem":
        return None
    return tuple((m.name, m.bytes) for m in (node, *picks(node.name))
                 if m.bytes and m.base is None)


@dataclass
class OpGraph:
    model: str
    input_shapes: list[list[int]]
    nodes: list[OpNode]
    outputs: list[str] = field(default_factory=list)
    gradients: list[str] = field(default_factory=list)
    schema: str = OPGRAPH_SCHEMA

    def __post_init__(self) -> None:
        # indexes for the planner's inner loops (a graph is not changed once made)
        self._by_name = {n.name: n for n in self.nodes}
        self._storage = {n.name: n.base if n.base is not None else n.name for n in self.nodes}
        self._position = {n.name: i for i, n in enumerate(self.nodes)}
        self._forward = [n for n in self.nodes if n.phase == "forward"]
        self._backward = [n for n in self.nodes if n.phase == "backward"]
        self._digest: str | None = None
        self._picks: dict[str, list[OpNode]] = {}
        for n in self.nodes:
            if n.op == "getitem" and n.inputs:
                self._picks.setdefault(n.inputs[0], []).append(n)
        # what goes with a recomputed forward node: its views, and its picks when it is a
        # multi-output op (``planner.liveness.closed_recompute``)
        self._companions: dict[str, list[str]] = {}
        for n in self._forward:
            if n.base is not None:
                self._companions.setdefault(n.base, []).append(n.name)
            if n.op == "getitem" and n.inputs:
                self._companions.setdefault(n.inputs[0], []).append(n.name)
        self._recomputable = {n.name for n in self.nodes if self._may_recompute(n)}
        self._backward_reads = list(dict.fromkeys(
            name for n in self._backward for name in n.inputs
            if name in self._by_name and self._by_name[name].phase == "forward"))
        self._inputs = [n for n in self.nodes if n.phase == "input"]
        self._runs = {n.name: (n, made_by(n, self.picks), (self._storage[n.name],
                                                  *[self._storage[i] for i in n.inputs]))
                      for n in self.nodes}

    def _may_recompute(self, node: OpNode) -> bool:
        if node.op == "getitem":  # recomputed with the op it picks from
            op = self._by_name.get(node.inputs[0]) if node.inputs else None
            return op is not None and self._may_recompute(op)
        return node.phase == "forward" and node.recomputable

    def picks(self, name: str) -> list[OpNode]:
        """The ``getitem`` nodes taking outputs of the multi-output op ``name``."""
        return self._picks.get(name, [])

    def __getitem__(self, name: str) -> OpNode:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def recomputable(self, name: str) -> bool:
        """Whether ``name`` may be recomputed in backward: a forward node that is neither
        random nor side-effecting (a ``getitem`` as the op it picks from)."""
        return name in self._recomputable

    def companions(self, name: str) -> list[str]:
        """The forward nodes recomputed with ``name``: the views of its storage, and the
        ``getitem`` nodes picking its outputs."""
        return self._companions.get(name, [])

    @property
    def backward_reads(self) -> list[str]:
        """The forward nodes backward ops read, each once (the graph's own list: do not
        change it)."""
        return self._backward_reads

    @property
    def inputs(self) -> list[OpNode]:
        """The input nodes (parameters, buffers, the model's inputs)."""
        return self._inputs

    @property
    def runs(self) -> dict[str, tuple[OpNode, tuple[tuple[str, int], ...] | None,
                                      tuple[str, ...]]]:
        """Per node name: the node, the storages running it makes (with their bytes; None
        for a ``getitem``) and the storages it makes or reads, its own first (the
        liveness simulation's inner loop; the graph's own dict: do not change it)."""
        return self._runs

    def storage(self, name: str) -> str:
        """The node whose storage ``name`` uses (itself unless it is a view)."""
        return self._storage[name]

    def position(self, name: str) -> int:
        """``name``'s index in ``nodes``."""
        return self._position[name]

    @property
    def forward(self) -> list[OpNode]:
        """The forward ops, in order (the graph's own list: do not change it)."""
        return self._forward

    @property
    def backward(self) -> list[OpNode]:
        """The backward ops, in order (the graph's own list: do not change it)."""
        return self._backward

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for index in ("_by_name", "_storage", "_position", "_forward", "_backward", "_picks",
                      "_digest", "_companions", "_recomputable", "_backward_reads", "_inputs",
                      "_runs"):
            data.pop(index, None)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def digest(self) -> str:
        """A hash of the graph's content, made once (what the planner keeps per graph is
        keyed by it)."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.to_json().encode()).hexdigest()
        return self._digest

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OpGraph:
        if data.get("schema") != OPGRAPH_SCHEMA:
            raise GraphError(
                f"Not a remat3d op graph (schema {data.get('schema')!r}, expected "
                f"{OPGRAPH_SCHEMA!r}); capture it again with remat3d.capture."
            )
        nodes = [OpNode(**n) for n in data["nodes"]]
        return cls(**{**data, "nodes": nodes})

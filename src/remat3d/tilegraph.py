"""TileGraph: a forward pass's aten ops as plain data, with what tiling needs of each.

``capture/forward.py`` reads the model's inference forward (one functional aten graph) into
this; ``planner/forward_tiles.py`` plans it and imports no torch.

Conventions
  - ``nodes`` are in the graph's order. A *spatial* tensor is 5-D ``(N, C, D, H, W)``;
    ``size`` is its ``(D, H, W)``, ``None`` for any other value.
  - ``kind`` says how a node's output relates to its spatial inputs:
    ``"input"`` the volume; ``"const"`` reads no spatial tensor (parameters, buffers and
    what is computed from them alone: computed once, before any tile); ``"local"`` each
    output voxel reads a window of its inputs (``relation`` says which: a convolution,
    its transpose, an integer-scale interpolation, or pointwise); ``"stats"`` a
    normalisation with statistics of its whole input (instance, group, or batch norm in
    training), pointwise once those are known; ``"whole"`` anything else touching a
    spatial tensor (attention over tokens, a global pooling): run on whole tensors.
  - ``inputs`` are the spatial inputs only, in argument order; ``reads`` every node the
    op reads (constants included).
  - ``bytes`` is what the output holds (``numel * itemsize``, a tuple op's outputs
    together); ``view`` marks an output sharing its input's storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from remat3d.halo import SpatialOp

__all__ = ["KINDS", "TileGraph", "TileNode"]

KINDS = ("input", "const", "local", "stats", "whole")


@dataclass
class TileNode:
    name: str
    op: str  # the aten op ("convolution"), or "input" / "const" for placeholders
    kind: str
    inputs: list[str] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)
    size: tuple[int, ...] | None = None
    bytes: int = 0
    itemsize: int = 0  # of the (first) output's elements
    view: bool = False
    flops: int = 0
    # the window relation to each spatial input (``halo.SpatialOp`` fields; inputs and
    # output filled in by the planner, which numbers nodes)
    relation: str = "pointwise"
    kernel: tuple[int, ...] = (1, 1, 1)
    stride: tuple[int, ...] = (1, 1, 1)
    padding: tuple[int, ...] = (0, 0, 0)
    dilation: tuple[int, ...] = (1, 1, 1)
    scale: tuple[int, ...] = (1, 1, 1)
    mode: str = "nearest"

    def spatial_op(self, number: dict[str, int]) -> SpatialOp:
        """This node's window relation as halo arithmetic over node numbers."""
        return SpatialOp(self.relation, tuple(number[i] for i in self.inputs),
                         number[self.name], self.kernel, self.stride, self.padding,
                         self.dilation, self.scale, self.mode)


@dataclass
class TileGraph:
    model: str
    input_shape: tuple[int, ...]
    nodes: list[TileNode]
    output: str

    def __post_init__(self) -> None:
        self._by_name = {n.name: n for n in self.nodes}
        self._readers: dict[str, list[str]] = {}
        for n in self.nodes:
            for r in dict.fromkeys(n.reads):
                self._readers.setdefault(r, []).append(n.name)

    def __getitem__(self, name: str) -> TileNode:
        return self._by_name[name]

    def readers(self, name: str) -> list[str]:
        """The nodes reading ``name``, in graph order (the output's caller not counted)."""
        return self._readers.get(name, [])

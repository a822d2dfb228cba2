"""Tables of where a step's memory goes, computed from a CostGraph (plain data, no torch)."""

from __future__ import annotations

from typing import Any

from remat3d.graph import CostGraph
from remat3d.units import format_shape

__all__ = ["level_table", "module_table"]


_SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def module_table(graph: CostGraph, top: int = 12) -> list[dict[str, Any]]:
    """Invocations by the bytes their own ops keep for backward, largest first.

    Leaves are listed as themselves; a container whose own ``forward`` keeps tensors (a
    U-Net decoder block's concatenation with the skip connection) is listed as
    ``name (own ops)``. The rows of all invocations sum to the step's ``saved_bytes``.
    """
    rows: list[dict[str, Any]] = [
        {
            "label": n.label if n.is_leaf else f"{n.label} (own ops)",
            "type": n.module_type,
            "output": format_shape(n.output_shape or [])
            + f" {_SHORT_DTYPE.get(n.output_dtype or '', n.output_dtype or '')}",
            "saved_bytes": n.self_saved_bytes,
            "fwd_flops": n.self_fwd_flops,
        }
        for n in graph.nodes
        if n.is_leaf or n.self_saved_bytes
    ]
    rows.sort(key=lambda r: (-r["saved_bytes"], r["label"]))
    return rows[:top]


def level_table(graph: CostGraph) -> list[dict[str, Any]]:
    """Saved bytes grouped by the spatial size of each invocation's output, largest first.

    Each invocation's own saved bytes are counted at the level of its output, so the rows
    sum to the step's saved bytes (less what the loss keeps). In a U-Net each spatial size
    is one resolution level; the full-resolution level usually dominates, which is why
    checkpointing every block helps so little there.
    """
    levels: dict[tuple[int, ...], dict[str, Any]] = {}
    for n in graph.nodes:
        if not (n.is_leaf or n.self_saved_bytes):
            continue
        shape = tuple(n.output_shape or ())
        spatial = shape[2:] if len(shape) >= 3 else shape
        row = levels.setdefault(spatial, {"modules": 0, "saved_bytes": 0})
        row["modules"] += 1
        row["saved_bytes"] += n.self_saved_bytes
    ordered = sorted(levels.items(), key=lambda kv: -_volume(kv[0]))
    return [
        {"level": format_shape(spatial) or "(scalar)", **row}
        for spatial, row in ordered
        if row["saved_bytes"] or row["modules"]
    ]


def _volume(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out

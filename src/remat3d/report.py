"""Tables of where a step's memory goes, computed from a CostGraph (plain data, no torch)."""

from __future__ import annotations

from typing import Any

from remat3d.graph import CostGraph

__all__ = ["module_table", "level_table"]


def module_table(graph: CostGraph, top: int = 12) -> list[dict[str, Any]]:
    """Leaf module invocations with the most bytes saved for backward, largest first."""
    rows = [
        {
            "label": n.label,
            "type": n.module_type,
            "output": "x".join(map(str, n.output_shape or [])) + f" {n.output_dtype or ''}",
            "saved_bytes": n.saved_bytes,
            "fwd_flops": n.fwd_flops,
        }
        for n in graph.leaves()
    ]
    rows.sort(key=lambda r: (-r["saved_bytes"], r["label"]))
    return rows[:top]


def level_table(graph: CostGraph) -> list[dict[str, Any]]:
    """Saved bytes grouped by the spatial size of each leaf's output (largest level first).

    In a U-Net each spatial size is one resolution level; the full-resolution level
    usually dominates, which is why checkpointing every block helps so little there.
    """
    levels: dict[tuple[int, ...], dict[str, Any]] = {}
    for n in graph.leaves():
        shape = tuple(n.output_shape or ())
        spatial = shape[2:] if len(shape) >= 3 else shape
        row = levels.setdefault(spatial, {"modules": 0, "saved_bytes": 0})
        row["modules"] += 1
        row["saved_bytes"] += n.saved_bytes
    ordered = sorted(levels.items(), key=lambda kv: -_volume(kv[0]))
    return [
        {"level": "x".join(map(str, spatial)) or "(scalar)", **row}
        for spatial, row in ordered
        if row["saved_bytes"] or row["modules"]
    ]


def _volume(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out

"""The markdown report of ``remat3d bench gpu`` (``cuda_check.py``): one table per kind of
case, a failed case named in place of its numbers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from remat3d.units import format_shape

__all__ = ["markdown"]

GiB = 2**30


def _gib(v: Any) -> str:
    return "—" if v is None else f"{v / GiB:.2f}"


# per kind of row: (the kinds, header cells with their alignment, how many leading cells
# name the case, the cells of a measured row)
def _step_cells(r: dict[str, Any]) -> list[str]:
    ratio = (r["allocator_peak"] / r["verified_peak"]
             if r.get("allocator_peak") and r.get("verified_peak") else None)
    return [r["preset"], _shape(r), str(r["amp"]), r["plan"], str(len(r["tiled"])),
            _offload_cell(r), _gib(r["verified_peak"]), _gib(r["tracker_peak"]),
            _gib(r["allocator_peak"]), "—" if ratio is None else f"{ratio:.3f}",
            "—" if r["flops_ratio"] is None else f"{r['flops_ratio']:.2f}",
            f"{r['seconds']:.2f}"]


def _offload_cell(r: dict[str, Any]) -> str:
    if r.get("host"):  # tiled outputs in host memory: how much the GPU step's tracker saw
        return f"tiled outputs, {_gib(r.get('tracker_host_peak'))} GiB on host"
    return "yes" if r["offload"] else "no"


def _exact_cells(r: dict[str, Any]) -> list[str]:
    return [r["preset"], _shape(r), str(r["amp"]), r["plan"], str(r["regions"]),
            "yes" if r["bitwise_equal"] else "NO", f"{r['max_rel_grad_diff']:.1e}"]


def _tiled_cells(r: dict[str, Any]) -> list[str]:
    e, f = r["errors"], r["noise_floor"]
    return [r["preset"], str(r["size"]), str(r["tile"]), r["dtype"], f"{e['output']:.1e}",
            f"{e['grads']:.1e}", "—" if math.isnan(e["buffers"]) else f"{e['buffers']:.1e}",
            "—" if f is None else f"{f['grads']:.1e}"]


_TABLES: list[tuple[tuple[str, ...], list[tuple[str, str]], list[str],
                    Callable[[dict[str, Any]], list[str]]]] = [
    (("unplanned", "planned"),
     [("preset", "---"), ("input", "---"), ("amp", "---"), ("plan", "---"),
      ("tiled stages", "---:"), ("offload", "---"), ("verified peak (meta) GiB", "---:"),
      ("tracker peak (GPU) GiB", "---:"), ("allocator peak GiB", "---:"),
      ("allocator / verified", "---:"), ("FLOPs × unplanned", "---:"),
      ("step s (median)", "---:")],
     ["preset", "shape", "amp", "plan"], _step_cells),
    (("exactness",),
     [("preset", "---"), ("input", "---"), ("amp", "---"), ("plan", "---"),
      ("regions", "---:"), ("gradients and buffers bitwise equal", "---"),
      ("largest relative gradient difference", "---:")],
     ["preset", "shape", "amp", "plan"], _exact_cells),
    (("tiled",),
     [("preset", "---"), ("size", "---:"), ("tile", "---:"), ("dtype", "---"),
      ("output", "---:"), ("worst gradient", "---:"), ("worst buffer", "---:"),
      ("fp32 noise floor (gradients, untiled vs fp64)", "---:")],
     ["preset", "size", "tile", "dtype"], _tiled_cells),
]


def _shape(r: dict[str, Any]) -> str:
    return format_shape(r.get("shape") or [])


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    """The report: one table per kind of case; a failed case names its error in place of
    its measurements."""
    out = [header, ""]
    for kinds, columns, names, cells in _TABLES:
        chosen = [r for r in rows if r["kind"] in kinds]
        if not chosen:
            continue
        out.append("| " + " | ".join(name for name, _ in columns) + " |")
        out.append("|" + "|".join(align for _, align in columns) + "|")
        for r in chosen:
            if "error" in r:
                named = [_shape(r) if key == "shape" else str(r.get(key, "")) for key in names]
                line = [*named, f"failed: {r['error']}"]
                line += [""] * (len(columns) - len(line))
            else:
                line = cells(r)
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    return "\n".join(out)

"""Plots of a plan: the budget -> recompute-overhead curve and the memory timelines."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_plan", "save_figure"]


def plot_plan(
    path: str | os.PathLike[str],
    *,
    title: str,
    curve: Sequence[tuple[int, float]],
    chosen: tuple[int, float],
    budget: int,
    unplanned: Sequence[int],
    planned: Sequence[int],
) -> None:
    """Write a two-panel PNG: (budget -> overhead, with the chosen point) and (live bytes
    through the step, unplanned vs planned). Written to a temp file, then renamed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 2**30
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    if curve:
        xs, ys = zip(*sorted(curve))
        left.plot([x / gib for x in xs], [100 * y for y in ys], "o-", label="optimal")
    left.plot([chosen[0] / gib], [100 * chosen[1]], "r*", markersize=14, label="this plan")
    left.axvline(budget / gib, color="grey", linestyle="--", label="budget")
    left.set_xlabel("verified peak (GiB)")
    left.set_ylabel("recomputed FLOPs (% of the step)")
    left.set_title("memory budget -> recompute overhead")
    left.legend()
    for series, label in ((unplanned, "no checkpointing"), (planned, "this plan")):
        if series:
            n = len(series)
            right.plot([i / max(1, n - 1) for i in range(n)], [v / gib for v in series],
                       label=label)
    right.axhline(budget / gib, color="grey", linestyle="--", label="budget")
    right.set_xlabel("progress through the training step (forward, then backward)")
    right.set_ylabel("live memory (GiB)")
    right.set_title("memory timeline")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, Path(path), dpi=110)


def save_figure(fig: Any, path: Path, dpi: int = 100) -> Path:
    """Write ``fig`` as a PNG through a temporary file and a rename (nothing half-written),
    and close it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path

"""The library's exceptions.

Every error a user can cause is a :class:`Remat3dError` (or a subclass) whose message says
what was wrong, what we got, and how to fix it. The CLI prints the message without a
traceback; library callers can catch the one base class.
"""

from __future__ import annotations

import re

__all__ = [
    "BudgetError",
    "CaptureError",
    "DataError",
    "GraphError",
    "InPlaceInputError",
    "InfeasibleBudgetError",
    "InputShapeError",
    "ModelForwardError",
    "ModelSpecError",
    "PlanError",
    "RecomputeDivergedError",
    "Remat3dError",
    "ReversibleError",
    "SettingsError",
    "StaleRebuildError",
    "TilingError",
    "WeightsError",
    "quoted",
]


class Remat3dError(Exception):
    """Base class of every error remat3d raises on purpose."""


class ModelSpecError(Remat3dError, ValueError):
    """A model preset, ``package.module:Class`` spec, model file or its kwargs is unusable."""


class InputShapeError(Remat3dError, ValueError):
    """An input shape is malformed or not legal for the model (size, divisibility)."""


class BudgetError(Remat3dError, ValueError):
    """A memory budget or byte size could not be parsed, or is infeasible."""


class InfeasibleBudgetError(BudgetError):
    """No plan fits the budget. The numbers a caller needs are attributes, not only text."""

    def __init__(self, message: str, *, smallest_feasible_bytes: int,
                 unplanned_peak_bytes: int) -> None:
        super().__init__(message)
        self.smallest_feasible_bytes = smallest_feasible_bytes
        self.unplanned_peak_bytes = unplanned_peak_bytes


class DataError(Remat3dError, ValueError):
    """A dataset, datalist or volume is unusable (missing, unreadable, mismatched, NaN/Inf)."""


class SettingsError(Remat3dError, ValueError):
    """A training settings file or ``--key=value`` override is unknown or invalid."""


class WeightsError(Remat3dError, ValueError):
    """A pretrained weights file cannot be read or does not fit the model."""


class PlanError(Remat3dError, ValueError):
    """A plan is malformed, from an unknown schema, or does not fit the model."""


class GraphError(Remat3dError, ValueError):
    """A cost graph file is not one remat3d wrote (another schema)."""


class CaptureError(Remat3dError, RuntimeError):
    """A model's step could not be captured as one graph (a graph break, an op AOTAutograd
    cannot trace); module plans still work."""


class TilingError(Remat3dError, ValueError):
    """A run cannot be executed in tiles exactly (an op is not local, dropout, ...)."""


class ReversibleError(Remat3dError, ValueError):
    """A reversible block cannot be inverted as built or called (shapes, channels, in-place)."""


class InPlaceInputError(Remat3dError, RuntimeError):
    """A recompute region wrote in place into one of its own inputs."""


class RecomputeDivergedError(Remat3dError, RuntimeError):
    """A region's recomputation did not run the same ops as its forward."""


class StaleRebuildError(Remat3dError, RuntimeError):
    """A tensor a saved recipe rebuilds from was modified in place before backward."""


class ModelForwardError(Remat3dError, RuntimeError):
    """The model's own forward failed on the step's input (e.g. kwargs that build a network
    whose layers do not fit together, or an input it cannot take)."""


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def quoted(error: BaseException | str, limit: int = 300) -> str:
    """Another library's message, to quote inside ours: whole sentences only, as many as
    fit in ``limit`` characters (at least the first, if it fits in twice that), on one line.
    Never a message cut mid-word or mid-address.

    >>> quoted("First part. Second part is longer than the limit allows here.", limit=20)
    'First part.'
    """
    text = " ".join(str(error).split())
    kept = ""
    for sentence in _SENTENCE_END.split(text):
        candidate = f"{kept} {sentence}".strip()
        if len(candidate) > limit and kept:
            break
        if len(candidate) > 2 * limit:
            break
        kept = candidate
    if kept and kept[-1] not in ".!?":
        kept += "."
    return kept


"""The tensors in an op's arguments or results, found fast.

The tracker and the tiling mode look at every op's arguments; ``torch.utils._pytree``'s
general flattening (namedtuple checks, registered node types) was a fifth of a verified
512³ step's wall time. Op arguments are tensors, numbers and lists, tuples or dicts of
them, so this walk is enough: it finds every tensor ``tree_leaves`` would (it descends
into every list, tuple, and dict value; anything else is a leaf).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["map_leaves", "tensors_in"]


def tensors_in(value: Any, found: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every tensor in ``value`` (nested lists, tuples and dict values), in order."""
    if found is None:
        found = []
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        _walk(value, found)
    elif isinstance(value, dict):
        _walk(value.values(), found)
    return found


def _walk(values: Any, found: list[torch.Tensor]) -> None:
    # the elements are looked at here, not in a call each: most are the ints of shapes
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            _walk(v, found)
        elif isinstance(v, dict):
            _walk(v.values(), found)


def map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    """``tree_map(fn, value)`` for op arguments: ``fn`` on every leaf of nested lists,
    tuples and dicts, rebuilt alike. Any other container (a named tuple, a structseq)
    takes ``tree_map`` itself, which descends into them too."""
    try:
        return _map(fn, value)
    except _Unusual:
        return tree_map(fn, value)


class _Unusual(Exception):
    pass


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    kind = type(value)
    if kind is list or kind is tuple:
        return kind([_map(fn, v) for v in value])
    if kind is dict:
        return {k: _map(fn, v) for k, v in value.items()}
    if isinstance(value, (tuple, list, dict)) and kind is not torch.Size:
        raise _Unusual
    return fn(value)

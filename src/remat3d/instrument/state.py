"""Thread-local runtime state: are we recomputing, where do new tensors live (host
memory on meta), and what is each module called."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from torch import nn

__all__ = [
    "is_recomputing",
    "module_name",
    "placement",
    "recompute_depth",
    "recomputing",
    "register_module_names",
]

_local = threading.local()
_NAMES: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def is_recomputing() -> bool:
    """True while remat3d is re-running a region's forward to rebuild what backward needs.

    Use it to skip side effects that must happen once per step (logging, counters, caches):

    >>> import remat3d
    >>> remat3d.is_recomputing()
    False
    """
    return getattr(_local, "depth", 0) > 0


def recompute_depth() -> int:
    """How many recomputations are running, one inside the other, in this thread."""
    return getattr(_local, "depth", 0)


def enter_recompute() -> None:
    _local.depth = getattr(_local, "depth", 0) + 1


def exit_recompute() -> None:
    _local.depth -= 1


@contextmanager
def recomputing() -> Iterator[None]:
    enter_recompute()
    try:
        yield
    finally:
        exit_recompute()


@contextmanager
def placement(where: str | None) -> Iterator[None]:
    """Say where tensors made inside this block live, for the tracker on meta.

    On the meta device host memory and device memory are both ``meta``; code that stands
    for a host buffer (``runtime/tiling/host.py``) allocates it under ``placement("host")``,
    and copies a host tensor to the device under ``placement("device")``. ``None``: the
    tracker decides (an op that reads only host tensors runs on the host).
    """
    previous = getattr(_local, "placement", None)
    _local.placement = where
    try:
        yield
    finally:
        _local.placement = previous


def current_placement() -> str | None:
    """The innermost :func:`placement` (``None`` outside any)."""
    where: str | None = getattr(_local, "placement", None)
    return where


def register_module_names(model: nn.Module,
                          extra: Mapping[str, nn.Module] | None = None) -> None:
    """Remember qualified names, so diagnostics can say ``encoder.2.conv`` not ``Conv3d``;
    ``extra``: modules outside the tree by name (a plan's spans, runtime/spans.py)."""
    for name, module in model.named_modules():
        _NAMES.setdefault(module, name or type(model).__name__)
    for name, module in (extra or {}).items():
        _NAMES.setdefault(module, name)


def module_name(module: nn.Module) -> str:
    return _NAMES.get(module) or type(module).__name__

"""Thread-local runtime state: are we recomputing, and what is each module called."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

__all__ = ["is_recomputing", "module_name", "recomputing", "register_module_names"]

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


def register_module_names(model: nn.Module) -> None:
    """Remember qualified names, so diagnostics can say ``encoder.2.conv`` not ``Conv3d``."""
    for name, module in model.named_modules():
        _NAMES.setdefault(module, name or type(model).__name__)


def module_name(module: nn.Module) -> str:
    return _NAMES.get(module) or type(module).__name__

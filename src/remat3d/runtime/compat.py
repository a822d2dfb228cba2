"""The PyTorch internals remat3d relies on, in one place.

Every use of a private name of ``torch.utils.checkpoint`` goes through here, each with what
happens when a torch version does not have it. ``pyproject.toml`` requires the oldest
release CI tests (``TESTED_TORCH``); ``tests/runtime/test_compat.py`` checks each gate
against the installed torch, so a release that drops one fails there, not silently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils import checkpoint as _ckpt

TESTED_TORCH = (2, 13)  # pyproject.toml's floor: the release CI runs

__all__ = [
    "TESTED_TORCH",
    "checkpoint_debug_enabled",
    "checkpoint_early_stop",
    "register_determinism_check",
    "selective_cache_entries",
    "selective_cache_internals",
]


def register_determinism_check(name: str, metadata_fn: Callable[[Any], Any]) -> bool:
    """Add ``name`` to the ``determinism_check`` values ``torch.utils.checkpoint`` accepts,
    with ``metadata_fn`` taking each saved tensor's metadata (torch compares what the
    forward and the recomputation give with ``!=``). False where torch keeps no such table:
    callers then pass ``"default"``, torch's own check."""
    table = getattr(_ckpt, "_allowed_determinism_checks_to_fns", None)
    if not isinstance(table, dict):
        return False
    table.setdefault(name, metadata_fn)
    return table[name] is metadata_fn


def checkpoint_debug_enabled() -> bool | None:
    """What ``torch.utils.checkpoint.set_checkpoint_debug_enabled`` set (None: not set)."""
    return getattr(_ckpt, "_checkpoint_debug_enabled", None)


def checkpoint_early_stop(requested: bool) -> bool:
    """Whether a non-reentrant checkpoint made now stops its recomputation early
    (``set_checkpoint_early_stop`` overrides the argument)."""
    forced = getattr(_ckpt, "_enable_checkpoint_early_stop", None)
    return requested if forced is None else bool(forced)


def selective_cache_internals() -> tuple[type, Any] | None:
    """Selective checkpointing's cache entry wrapper class and its "recompute" marker, or
    None where this torch version has neither (PyTorch's own check then names a kept
    tensor that was overwritten)."""
    wrapper_cls = getattr(_ckpt, "_VersionWrapper", None)
    recompute = getattr(_ckpt, "_RECOMPUTE", None)
    if wrapper_cls is None or recompute is None:
        return None
    return wrapper_cls, recompute


def selective_cache_entries(caching_mode: Any) -> Iterator[tuple[Any, Any, Any]] | None:
    """Each entry a selective checkpoint's caching mode keeps, as (its per-op container,
    its key there, the entry), so the caller may replace it; None where this torch keeps
    no such storage. PyTorch 2.13 keeps a dict per op (call index -> entry); 2.11 kept a
    list."""
    storage = getattr(caching_mode, "storage", None)
    if not isinstance(storage, dict):
        return None

    def entries() -> Iterator[tuple[Any, Any, Any]]:
        for per_op in storage.values():
            items = per_op.items() if isinstance(per_op, dict) else enumerate(per_op)
            for key, entry in list(items):
                yield per_op, key, entry

    return entries()

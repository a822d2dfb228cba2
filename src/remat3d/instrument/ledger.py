"""Live-storage accounting: which tensor storages exist, how many bytes each holds.

This is the arithmetic core of the tracker, free of dispatch machinery so it can be read
and tested on its own.

NOTE [ Counting storages, not tensors ]
  1. Memory belongs to storages. Views, in-place results and ``detach()`` share a storage,
     so each storage is counted once, the first time any tensor on it is seen.
  2. A storage is released when its Python object is collected. PyTorch preserves one
     Python object per live storage (``t.untyped_storage() is t.untyped_storage()``), so a
     ``weakref.finalize`` on it fires exactly when the last tensor using it dies.
  3. A storage can grow after creation (``resize_``, ``out=`` ops); ``refresh`` re-reads its
     size after every op that touched it.
  4. CUDA's caching allocator hands out blocks in multiples of 512 bytes, and
     ``torch.cuda.memory_allocated`` counts the rounded size; CUDA storages are therefore
     counted rounded up, so our numbers compare with the allocator's own.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["StorageLedger", "StorageRecord", "allocation_bytes", "unique_storage_bytes"]

_CUDA_BLOCK = 512


def allocation_bytes(nbytes: int, device_type: str) -> int:
    """Bytes an allocation of ``nbytes`` occupies on ``device_type`` (see NOTE rule 4)."""
    if device_type == "cuda" and nbytes > 0:
        return -(-nbytes // _CUDA_BLOCK) * _CUDA_BLOCK
    return nbytes


def unique_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (views and aliases count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


@dataclass
class StorageRecord:
    """One live storage. ``uid`` is unique for the life of the ledger (ids get reused)."""

    uid: int
    nbytes: int
    device: str
    category: str  # "param", "buffer", "input", "activation" (re-labelled later)
    producer: int | None  # node id that created it (None: outside any module)
    phase: str  # phase in which it was created


class StorageLedger:
    """Live bytes per device, maintained as storages appear and die."""

    def __init__(self, on_release: Callable[[StorageRecord], None] | None = None) -> None:
        self.records: dict[int, StorageRecord] = {}  # id(storage) -> record
        self.live_bytes: dict[str, int] = {}
        self._next_uid = 0
        self._on_release = on_release
        # id(storage) -> a weak reference whose callback releases it (a weakref.finalize
        # would cost several times more per storage: it registers process-wide)
        self._refs: dict[int, weakref.ref] = {}

    @staticmethod
    def key(t: torch.Tensor) -> int:
        return id(t.untyped_storage())

    def lookup(self, t: torch.Tensor) -> StorageRecord | None:
        return self.records.get(self.key(t))

    def add(
        self, t: torch.Tensor, category: str, producer: int | None, phase: str,
        device: str | None = None,
    ) -> StorageRecord | None:
        """Count ``t``'s storage if it is new; return the record if it was added.
        ``device`` books it elsewhere than ``t.device`` (host memory on meta)."""
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.records:
            return None
        device = device or str(t.device)
        record = StorageRecord(
            uid=self._next_uid,
            nbytes=allocation_bytes(storage.nbytes(), t.device.type),
            device=device,
            category=category,
            producer=producer,
            phase=phase,
        )
        self._next_uid += 1
        self.records[key] = record
        self.live_bytes[device] = self.live_bytes.get(device, 0) + record.nbytes
        self._refs[key] = weakref.ref(storage, functools.partial(self._died, key))
        return record

    def refresh(self, t: torch.Tensor) -> None:
        """Re-read the size of ``t``'s storage (it may have been resized in place)."""
        record = self.records.get(self.key(t))
        if record is None:
            return
        nbytes = allocation_bytes(t.untyped_storage().nbytes(), t.device.type)
        if nbytes != record.nbytes:
            self.live_bytes[record.device] += nbytes - record.nbytes
            record.nbytes = nbytes

    def _died(self, key: int, _ref: weakref.ref) -> None:
        self._refs.pop(key, None)
        self._release(key)

    def _release(self, key: int) -> None:
        record = self.records.pop(key, None)
        if record is None:
            return
        self.live_bytes[record.device] -= record.nbytes
        if self._on_release is not None:
            self._on_release(record)

    def close(self) -> None:
        """Stop reacting to releases."""
        self._on_release = None
        self.records = {}
        self._refs = {}

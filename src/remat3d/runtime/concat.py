"""Concatenations saved for backward as references to their parts.

NOTE [ Shared concatenations ]
  A U-Net decoder stage concatenates its upsampled input with the skip connection, and the
  convolution that reads the concatenation saves it for backward: a full-resolution tensor
  whose second half is a copy of the skip, which stays alive anyway until the encoder's
  backward. Outside recompute regions, while a planned model runs forward:
  1. :class:`ConcatRecorder` (a ``TorchFunctionMode``) notes every ``torch.cat`` whose
     parts have the result's dtype and device and are whole tensors (not views into a
     larger storage), holding the parts only while the result is alive.
  2. When autograd saves such a result, the saved-tensor hook keeps the parts (detached)
     and their version counters instead; unpacking concatenates them again — a copy, so
     bitwise what was saved. The result itself is then freed as soon as its last user
     is done. Cost: a part that nothing else kept (the upsampled half) stays alive in its
     place, so the saving is the bytes of the parts that were alive anyway.
  3. A part modified in place after the concatenation would give a different tensor: its
     version counter is checked when unpacking and the step fails with an error naming
     the concatenation instead of computing a wrong gradient. (The plan's verification
     on the meta device runs the same code, so such a model fails when it is planned.)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["ConcatRecorder", "SharedConcat", "StaleConcatError"]

_CATS = (torch.cat, torch.concat, torch.concatenate)


class StaleConcatError(RuntimeError):
    """A part of a concatenation saved for backward was modified in place."""


class SharedConcat:
    """What is saved instead of a concatenation: its parts and their versions."""

    __slots__ = ("dim", "parts", "versions")

    def __init__(self, parts: tuple[torch.Tensor, ...], dim: int) -> None:
        self.parts = tuple(p.detach() for p in parts)
        self.versions = tuple(p._version for p in parts)
        self.dim = dim

    def unpack(self) -> torch.Tensor:
        for p, v in zip(self.parts, self.versions):
            if p._version != v:
                raise StaleConcatError(
                    "A tensor concatenated in forward was modified in place before the "
                    f"backward used the concatenation (shape {tuple(p.shape)}); remat3d "
                    "saved the parts instead of the concatenation. Remove the in-place "
                    "op, or apply the plan with Plan(share_concat=False).")
        return torch.cat(self.parts, self.dim)


def _whole(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


class ConcatRecorder(TorchFunctionMode):
    """NOTE rule 1: ``torch.cat`` results and their parts, while the result lives."""

    def __init__(self) -> None:
        super().__init__()
        self._cats: dict[int, tuple[Any, tuple[torch.Tensor, ...], int, torch.Size]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CATS and isinstance(out, torch.Tensor) and torch.is_grad_enabled():
            parts = args[0] if args else kwargs.get("tensors", ())
            dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
            parts = tuple(parts)
            if len(parts) >= 2 and isinstance(dim, int) and all(
                    isinstance(p, torch.Tensor) and p.dtype == out.dtype
                    and p.device == out.device and _whole(p) for p in parts):
                storage = out.untyped_storage()
                key = id(storage)
                self._cats[key] = (weakref.ref(storage), parts, dim, out.shape)
                weakref.finalize(storage, self._cats.pop, key, None)
        return out

    def shared(self, t: torch.Tensor) -> SharedConcat | None:
        """The parts to save instead of ``t``, if ``t`` is a recorded concatenation."""
        storage = t.untyped_storage()
        entry = self._cats.get(id(storage))
        if entry is None or entry[0]() is not storage or not _whole(t):
            return None
        _, parts, dim, shape = entry
        if t.shape != shape or t.storage_offset() != 0 or not t.is_contiguous():
            return None
        return SharedConcat(parts, dim)

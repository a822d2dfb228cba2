"""Offload saved tensors to host memory (and/or store them in a lower precision).

:class:`OffloadHooks` is a ``saved_tensors_hooks`` pair: tensors autograd saves while it is
active are packed (copied to host, or cast) and unpacked in backward.

NOTE [ Offload paths ]
  1. CUDA: the copy to pinned host memory runs on a side stream after the compute stream
     reaches the tensor (``wait_stream``); ``record_stream`` keeps the allocator from
     reusing the device memory before the copy ends. In backward, the first unpack of a
     region's tensors starts copying the previous region's tensors back on the side stream
     (prefetch), so the copy overlaps the current region's backward.
  2. CPU: there is no separate host memory, but the same path runs (a copy to a separate
     buffer and back), so it is tested everywhere and exact bit for bit.
  3. Meta: nothing can be copied; the pack keeps only shape, stride and dtype, so a meta
     step shows the device memory the offload frees. The prefetch of path 1 is mirrored:
     the first unpack of a region's tensors makes the previous region's device copies,
     so the meta step also shows the memory the prefetch holds early (a 256³ bf16
     nnU-Net plan, run on an H200, held 1.08 GiB more than its meta step before this;
     docs/gpu.md). A plan with ``prefetch=False`` copies each tensor back only when
     backward needs it: less memory, the copy no longer hidden behind compute; the
     planner chooses that only when the plan does not fit with the prefetch. Unpacked
     tensors carry no values (meta tensors never do).
  Tensors smaller than ``min_bytes``, parameters, and tensors past the host budget stay on
  the device. ``storage_dtype`` (e.g. bf16) rounds floating-point tensors: the one lossy
  choice, made only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["HostUsage", "OffloadHooks"]


@dataclass
class HostUsage:
    """Host bytes held by offloaded tensors, shared by every region of one applied plan."""

    bytes: int = 0
    peak_bytes: int = 0
    budget_bytes: int | None = None

    def fits(self, nbytes: int) -> bool:
        return self.budget_bytes is None or self.bytes + nbytes <= self.budget_bytes

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)


class _Packed:
    """A saved tensor that lives elsewhere."""

    __slots__ = (
        "__weakref__",
        "data",
        "device",
        "dtype",
        "event",
        "group",
        "nbytes",
        "prefetched",
        "shape",
        "stride",
        "usage",
    )

    def __init__(self, data: torch.Tensor | None, source: torch.Tensor, group: int,
                 usage: HostUsage, nbytes: int) -> None:
        self.data = data
        self.device = source.device
        self.dtype = source.dtype
        self.shape = tuple(source.shape)
        self.stride = tuple(source.stride())
        self.event: Any = None
        self.nbytes = nbytes
        self.group = group
        self.prefetched: torch.Tensor | None = None
        self.usage = usage

    def __del__(self) -> None:
        self.usage.bytes -= self.nbytes

    def on_meta(self) -> torch.Tensor:
        """A device copy on meta: the memory it would take, no values."""
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")


class OffloadHooks(saved_tensors_hooks):
    """Pack saved tensors to host memory / a storage dtype (see NOTE [ Offload paths ])."""

    def __init__(
        self,
        *,
        offload: bool = True,
        storage_dtype: torch.dtype | None = None,
        min_bytes: int = 1 << 20,
        usage: HostUsage | None = None,
        stats: Any = None,
        group: int = 0,
        prefetch: dict[int, list[Any]] | None = None,
        early: bool = True,
    ) -> None:
        self.offload = offload
        self.storage_dtype = storage_dtype
        self.min_bytes = min_bytes
        self.usage = usage or HostUsage()
        self.stats = stats
        self.group = group
        self.prefetch = prefetch if prefetch is not None else {}
        self.early = early  # prefetch the previous region's tensors (CUDA, mirrored on meta)
        super().__init__(self._pack, self._unpack)

    # -- pack ---------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        nbytes = t.untyped_storage().nbytes()
        if (isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad)
                or nbytes < self.min_bytes):
            self._count(kept=nbytes)
            return t
        if self.storage_dtype is not None and t.is_floating_point() \
                and t.dtype != self.storage_dtype:
            return _Cast(self._pack_moved(t.to(self.storage_dtype)) if self.offload
                         else t.to(self.storage_dtype), t.dtype)
        if not self.offload:
            self._count(kept=nbytes)
            return t
        return self._pack_moved(t)

    def _pack_moved(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if not self.usage.fits(nbytes):
            self._count(kept=nbytes)
            return t
        if t.device.type == "meta":
            packed = _Packed(None, t, self.group, self.usage, nbytes)
        elif t.device.type == "cuda":
            packed = self._to_host_async(t, nbytes)
        else:
            packed = _Packed(t.clone(memory_format=torch.preserve_format), t, self.group,
                             self.usage, nbytes)
        self.usage.add(nbytes)
        self._count(offloaded=nbytes)
        self.prefetch.setdefault(self.group, []).append(packed)
        return packed

    def _to_host_async(self, t: torch.Tensor, nbytes: int) -> _Packed:
        stream = _side_stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        t.record_stream(stream)
        packed = _Packed(host, t, self.group, self.usage, nbytes)
        packed.event = event
        return packed

    def _count(self, *, kept: int = 0, offloaded: int = 0) -> None:
        if self.stats is not None:
            self.stats.kept_bytes += kept
            self.stats.offloaded_bytes += offloaded

    # -- unpack -------------------------------------------------------------------------
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Cast):
            inner = packed.inner if isinstance(packed.inner, torch.Tensor) \
                else self._unpack(packed.inner)
            return inner.to(packed.dtype)
        return self._bring_back(packed)

    def _bring_back(self, packed: _Packed) -> torch.Tensor:
        if packed.device.type in ("meta", "cuda"):
            if self.early:
                self._prefetch(packed.group - 1)
            if packed.prefetched is not None:
                # handed over: from here autograd alone decides how long it lives
                device_copy, packed.prefetched = packed.prefetched, None
                if packed.event is not None:
                    torch.cuda.current_stream(packed.device).wait_event(packed.event)
                return device_copy
        if packed.device.type == "meta":
            return packed.on_meta()
        if packed.device.type == "cuda":
            torch.cuda.current_stream(packed.device).wait_event(packed.event)
            return packed.data.to(packed.device, non_blocking=True)  # type: ignore[union-attr]
        assert packed.data is not None
        return packed.data

    def _prefetch(self, group: int) -> None:
        """Start copying ``group``'s tensors back on the side stream (CUDA). On meta, make
        their device copies at the same moment, so a meta step's peak holds what the CUDA
        step's prefetch holds (NOTE [ Offload paths ])."""
        for packed in self.prefetch.pop(group, []):
            if packed.prefetched is not None:
                continue
            if packed.device.type == "meta":
                packed.prefetched = packed.on_meta()
                continue
            if packed.data is None:
                continue
            stream = _side_stream(packed.device)
            stream.wait_event(packed.event)
            with torch.cuda.stream(stream):
                device_copy = packed.data.to(packed.device, non_blocking=True)
                packed.event = torch.cuda.Event()
                packed.event.record(stream)
            device_copy.record_stream(torch.cuda.current_stream(packed.device))
            packed.prefetched = device_copy


class _Cast:
    __slots__ = ("dtype", "inner")

    def __init__(self, inner: Any, dtype: torch.dtype) -> None:
        self.inner = inner
        self.dtype = dtype


_STREAMS: dict[Any, Any] = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]

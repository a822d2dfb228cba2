"""Host-resident tensors of tiled runs: a tiled output kept in host memory, read by tiles.

NOTE [ Host-resident tiled outputs ]
  A tiled run's output that only other tiled runs read (a U-Net's full-resolution skip
  connection, read by the first downsampling and by the top decoder stage) need not be
  on the device at all: each tile of a reader copies the slice it needs (with its halo)
  to the device, and each tile of the reader's backward adds its input gradient back into
  a host tensor. The device then never holds the skip nor its gradient, which at 512³ in
  bf16 are 8 GiB each. Unlike fusion (``fused.py``) nothing is recomputed: the price is
  the copies (the run's output once to the host; each pass of each reader reads its
  slices back; gradients go to the host once per reader).
  1. Such a tensor is marked (:func:`mark_host`); ``remat3d.tile`` reads marked inputs
     slice by slice and writes gradients for them into host tensors. Autograd sums the
     gradients of several readers on the host (their device is the host's).
  2. CUDA: the host tensors are pinned CPU tensors; copies are synchronous (correct first:
     the readers' compute waits for its slice anyway).
  3. CPU: host and device are the same memory, but the same path runs (a separate buffer,
     slices copied in and out), so it is tested everywhere and exact bit for bit.
  4. Meta: host tensors are meta tensors made under ``placement("host")``, so the tracker
     books them as host memory, not device memory (``instrument/tracker.py``); copies to
     the device are made under ``placement("device")``. A meta step therefore shows the
     device memory a CUDA step holds, and the tracker's ``host_peak_bytes`` the host's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from remat3d.instrument.state import placement
from remat3d.instrument.step import model_device

__all__ = ["add_into_host", "compute_device", "host_empty", "host_zeros_like", "is_host",
           "mark_host", "to_device"]

_MARK = "_remat3d_host"


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a host-resident tensor of a tiled run (NOTE rule 1); returns ``t``."""
    setattr(t, _MARK, True)
    return t


def is_host(t: torch.Tensor, device: torch.device | None = None) -> bool:
    """Whether ``t`` is host-resident: marked, or on the CPU while ``device`` is not."""
    if getattr(t, _MARK, False):
        return True
    return device is not None and device.type != "cpu" and t.device.type == "cpu"


def compute_device(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> torch.device:
    """Where a tiled run computes: its first device-resident input's device, else its
    first parameter's (a run that reads only host-resident inputs), else its first
    input's."""
    for x in inputs:
        if not is_host(x):
            return x.device
    if isinstance(fn, torch.nn.Module) and (device := model_device(fn)) is not None:
        return device
    return inputs[0].device


def host_empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device
               ) -> torch.Tensor:
    """An uninitialised host tensor for a run computing on ``device`` (NOTE rules 2-4)."""
    if device.type == "meta":
        with placement("host"):
            return mark_host(torch.empty(tuple(shape), dtype=dtype, device="meta"))
    pin = device.type == "cuda"
    return mark_host(torch.empty(tuple(shape), dtype=dtype, pin_memory=pin))


def host_zeros_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host_empty(t.shape, t.dtype, device).zero_()  # in place: still host memory


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of (a slice of) a host tensor (NOTE rules 2-4); differentiable."""
    if device.type == "meta":
        with placement("device"):
            return t.clone()
    if device.type == "cpu":
        return t.clone()
    return t.to(device)


def add_into_host(target: torch.Tensor, g: torch.Tensor) -> None:
    """``target += g``: a device tile's gradient into (a view of) a host tensor."""
    if target.device != g.device:
        g = g.to(target.device)
    target.add_(g)

"""An independent measure of a CPU training step's memory, to validate the tracker.

The tracker follows tensor storages from Python. This module instead reads PyTorch's CPU
allocator itself, through ``torch.profiler`` (``profile_memory=True`` records every
allocation and free the c10 allocator makes, with its size and time).

NOTE [ Comparing at operator boundaries ]
  The allocator also sees scratch buffers a kernel allocates and frees inside one op (for
  a 3D convolution's backward on CPU, oneDNN's copies of its input and output gradient
  in a blocked layout). Those belong to the kernel library, not to the model's step, and
  differ between CPU and GPU kernels. So the comparable figure is the allocator's live
  bytes sampled at the end of every top-level aten op (scratch already freed, outputs
  allocated, inputs not yet released) — exactly the points at which the tracker samples —
  and after every allocation made outside any aten op. An eager step makes none there;
  a step compiled by inductor makes its buffers there (its generated kernels are not
  aten ops; the ops it calls, a convolution, are), so the same figure is the compiled
  step's peak without the scratch of the aten kernels it calls (ops of other namespaces,
  ``mkldnn::``, custom ops, are not ops here: what they allocate counts). The raw
  allocator peak,
  scratch included, is reported beside it as ``allocator_peak_bytes``.
  Tensors that exist before the step (weights, buffers, inputs) allocate nothing during it;
  their bytes are added from the tensors themselves, deduplicated by data pointer.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from remat3d.errors import Remat3dError
from remat3d.instrument.step import StepSetup, forward_backward, preserved_state

__all__ = ["AllocatorMeasure", "allocator_measure", "trace_peaks"]


@dataclass
class AllocatorMeasure:
    """Peak bytes of one CPU step as the allocator saw them."""

    # resident before the step + allocator peak at op boundaries (and at allocations
    # outside every aten op: a compiled step's own buffers; NOTE)
    peak_bytes: int
    allocator_peak_bytes: int  # resident + allocator peak including in-kernel scratch
    resident_bytes: int  # weights, buffers, inputs (alive before the step)
    end_bytes: int  # resident + what the step left allocated (gradients)


def _resident_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def trace_peaks(allocations: list[tuple[int, int]], ops: list[tuple[int, int]]
                ) -> tuple[int, int, int]:
    """An allocator trace's live bytes (from zero): the peak without in-kernel scratch
    (NOTE), the raw peak, and what is live at the end. ``allocations`` are (time, bytes:
    negative for a free), ``ops`` the (start, end) of aten ops, both in any order."""
    allocations = sorted(allocations)
    times = [t for t, _ in allocations]
    live = list(itertools.accumulate(b for _, b in allocations))
    top: list[tuple[int, int]] = []  # top-level ops, in time order
    # an op inside another may start at the same instant: the outer (longer) one first
    for start, end in sorted(ops, key=lambda op: (op[0], -op[1])):
        if not top or start >= top[-1][1]:  # else nested inside the previous one
            top.append((start, end))
    peak = 0
    for _, end in top:  # at the end of each top-level op: scratch freed, outputs made
        k = bisect.bisect_right(times, end)
        if k:
            peak = max(peak, live[k - 1])
    starts = [start for start, _ in top]
    for (t, nbytes), now in zip(allocations, live):  # allocations outside every op
        i = bisect.bisect_right(starts, t) - 1
        if nbytes > 0 and (i < 0 or t > top[i][1]):
            peak = max(peak, now)
    return peak, max([0, *live]), live[-1] if live else 0


def allocator_measure(setup: StepSetup) -> AllocatorMeasure:
    """Run one step of ``setup`` on CPU under the profiler's allocator trace."""
    if setup.device != "cpu":
        raise Remat3dError(
            f"The allocator reference runs on CPU only; this step is on {setup.device}."
        )
    with preserved_state(setup):
        for p in setup.model.parameters():
            p.grad = None
        tensors: list[Any] = [*setup.model.parameters(), *setup.model.buffers()]
        tensors += [x for x in setup.inputs if isinstance(x, torch.Tensor)]
        resident = _resident_bytes(tensors)
        with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            forward_backward(setup)
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    boundary_peak, raw_peak, end = trace_peaks(
        [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"],
        [(e.start_ns(), e.end_ns()) for e in events if e.name().startswith("aten::")])
    return AllocatorMeasure(
        peak_bytes=resident + boundary_peak,
        allocator_peak_bytes=resident + raw_peak,
        resident_bytes=resident,
        end_bytes=resident + end,
    )

"""``remat3d.measure``: what one training step really costs, recomputation included."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat3d.instrument.step import (
    StepSetup,
    prepare_step,
    rare_full_collections,
    run_step,
    time_step,
)
from remat3d.instrument.tracker import PeakTensor
from remat3d.runtime.graph_run import graph_plan_of, measure_applied_graph_plan

__all__ = ["Measurement", "measure"]

# repeated tiles on meta booked, not run (NOTE [ Repeats on meta ]); tests compare with it off
_REPLAYS = True


@dataclass
class Measurement:
    """One training step, measured.

    ``peak_bytes`` is the tracker's peak of live tensor bytes on ``device``; ``flops``
    counts everything executed (forward, backward and any recomputation);
    ``seconds`` is the median wall time of uninstrumented steps (``None`` on meta).
    ``peak_modules`` names where the peak was reached (innermost module first), and
    ``peak_tensors`` what was live there: the largest storages, each with the module that
    made it (what to plan differently when a budget is missed).
    ``host_bytes`` is the most host memory that host-resident tiled outputs held (NOTE
    [ Host-resident tiled outputs ]; 0 on the CPU, where host and device are one).
    """

    device: str
    amp: str | None
    peak_bytes: int
    saved_bytes: int
    flops: int
    forward_flops: int
    backward_flops: int
    recompute_flops: int
    seconds: float | None
    breakdown: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    # the module invocations running when the peak was reached, innermost first (empty:
    # outside every module, or a graph plan's step)
    peak_modules: tuple[str, ...] = ()
    # when the peak was reached: "forward" or "backward" (None: before the step's first op)
    peak_phase: str | None = None
    # per tiled run (by its plan region's label, decoder.@4#0, else its module's name),
    # the most bytes live on the device while its passes ran: "forward", and in backward
    # the normalisations' "sums" passes and the "final" pass
    tiled_peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    # the largest storages live at the peak, largest first (empty for a graph plan's step)
    peak_tensors: tuple[PeakTensor, ...] = ()


def measure(
    model: nn.Module,
    *inputs: Any,
    device: str | torch.device | None = None,
    amp: str | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    repeats: int = 1,
) -> Measurement:
    """Run one training step (forward, loss, backward) and measure it.

    ``device`` defaults to the model's own device. The model's buffers, gradients and RNG
    state are restored afterwards. With ``repeats > 1`` the time is the median of that many
    steps (the first one included: call once more to exclude warm-up).

    >>> import torch, remat3d
    >>> net = torch.nn.Conv3d(1, 4, 3)
    >>> m = remat3d.measure(net, torch.randn(1, 1, 8, 8, 8))
    >>> m.backward_flops == m.forward_flops   # the input needs no grad: weight grad only
    True
    """
    if device is None:
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else "cpu"
    if str(device) == "meta" and graph_plan_of(model) is not None:
        return _graph_step(model, inputs, amp, loss_fn)
    setup = prepare_step(model, inputs, device, amp, loss_fn)
    seconds = time_step(setup, repeats) if setup.device != "meta" else None
    on_meta = setup.device == "meta"
    with rare_full_collections() if on_meta else contextlib.nullcontext():
        return _measured(setup, seconds)


def _measured(setup: StepSetup, seconds: float | None) -> Measurement:
    tracker = run_step(setup, replays=_REPLAYS)  # NOTE [ Repeats on meta ]
    try:
        return Measurement(
            device=setup.device,
            amp=_amp_text(setup.amp),
            peak_bytes=tracker.peak_bytes,
            saved_bytes=tracker.saved_bytes,
            flops=sum(tracker.flops.values()),
            forward_flops=tracker.flops["forward"],
            backward_flops=tracker.flops["backward"],
            recompute_flops=tracker.flops["recompute"],
            seconds=seconds,
            breakdown=tracker.peak_breakdown(),
            host_bytes=tracker.host_peak_bytes,
            peak_modules=tracker.peak_modules(),
            peak_phase=tracker.peak_phase(),
            tiled_peaks=tracker.window_peaks(),
            peak_tensors=tracker.peak_tensors(),
        )
    finally:
        tracker.close()


def _graph_step(model: nn.Module, inputs: Any, amp: str | None,
                loss_fn: Callable[[Any], torch.Tensor] | None) -> Measurement:
    """A model running a graph plan, measured "on meta": on fake tensors (the graphs do not
    run on meta; ``runtime/graph_run.py`` NOTE rule 6), the numbers ``remat3d.plan``
    verified."""
    step = measure_applied_graph_plan(model, tuple(inputs), amp=amp, loss_fn=loss_fn)
    return Measurement(
        device="meta", amp=_amp_text(step.amp),
        peak_bytes=step.peak_bytes, saved_bytes=step.saved_bytes,
        flops=sum(step.flops.values()), forward_flops=step.flops["forward"],
        backward_flops=step.flops["backward"], recompute_flops=step.flops["recompute"],
        seconds=None, breakdown=step.breakdown)


def _amp_text(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")

"""``remat3d bench predict``: whole-volume prediction plans at full size (meta), and the
CPU time of a tiled prediction against the untiled forward.

Run::

    remat3d bench predict [--cpu-time]

Each meta case traces the forward on fake tensors, plans it for a device with host
memory beside it (``remat3d.plan_prediction(..., device="meta")``) and verifies it under
the tracker; the table gives the verified device peak, the host memory the plan uses, the
untiled forward's bound, the FLOPs of the tiled plan (every tile run on meta, halo
recomputation included) against the untiled forward's, and the planning time.

Beside each case, MONAI's ``sliding_window_inference`` on the same volume (roi 96³ and
128³, overlap 0.25 and 0.5, ``mode="gaussian"``, ``sw_batch_size=1``), measured the same
way: run on meta under remat3d's tracker, amp under ``MetaAutocast``, the model's weights
and the input counted as for ours (NOTE [ Sliding windows on meta ]). Two placements: the
MONAI default (input, windows and stitched output all on the device) and the stitched
output, its count map and the input in host memory (``device="cpu"``; each window copied
to the device). FLOPs count convolutions and matmuls (``torch.utils.flop_counter``'s
rules), so blending costs none.

``--cpu-time`` runs zoo ``nnunetv2`` at 128³ fp32 on this CPU: the untiled forward, then
``predict`` at ``0.8x``, ``0.7x`` and ``0.6x`` (all tiled), the median of three each,
their largest difference and how many voxels' labels differ (and how many of those are
near-ties: top-2 logits within that difference); then ``sliding_window_inference`` (roi
96³ and 64³, once each) against the whole-volume forward: its time, largest logit
difference and the fraction of voxels whose label differs: how far sliding windows are
from the whole-volume function.

NOTE [ Sliding windows on meta ]
  1. MONAI's gaussian importance map takes ``.item()`` of its values, which meta tensors
     cannot give: it is computed on the CPU (``compute_importance_map``, as MONAI would)
     and passed as ``roi_weight_map``, moved to meta. Every window then has the roi's
     shapes (the volume is at least the roi on every axis).
  2. So every window runs the same ops on tensors of the same shapes, around the same
     live buffers (the input, importance map, stitched output and count map; the output
     and count map exist from the first window's result on). The network runs on the
     first two windows only; later ones return an empty tensor of the network's output
     shape and dtype: the peak is the one running all of them gives, and FLOPs are the
     windows times one window's. ``tests/bench`` checks both against running every window.
  3. Host placement on meta (``instrument/state.py``'s ``placement``): the input and what
     MONAI allocates are made under ``placement("host")``, each window's copy to the
     device and the network's tensors under ``placement("device")``. The device-to-host
     copy of each window's output is not counted (a transient host buffer).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from remat3d.instrument.amp import MetaAutocast, amp_dtype
from remat3d.instrument.state import placement
from remat3d.instrument.step import meta_copy
from remat3d.instrument.tracker import HOST, MemoryTracker
from remat3d.predicting import PredictionPlan, measure_plan, plan_prediction, predict
from remat3d.units import format_bytes, format_shape

__all__ = ["WINDOWS", "SlidingWindowRun", "main", "plan_flops", "sliding_window_run"]

# MONAI sliding_window_inference settings compared: (roi, overlap)
WINDOWS = [(96, 0.25), (96, 0.5), (128, 0.25), (128, 0.5)]


def _nnunetv2(classes: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from remat3d.zoo.meta import build_on_meta
        from remat3d.zoo.presets import get_preset

        return build_on_meta(get_preset("nnunetv2").factory, {"out_channels": classes})

    return build


def _segresnet(classes: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from monai.networks.nets import SegResNet

        from remat3d.zoo.meta import build_on_meta

        return build_on_meta(SegResNet, {"spatial_dims": 3, "init_filters": 32,
                                         "blocks_down": (1, 2, 2, 4), "blocks_up": (1, 1, 1),
                                         "in_channels": 1, "out_channels": classes})

    return build


# (name, model, volume shape, budget, amp, output)
CASES = [
    ("zoo nnunetv2, 14 classes", _nnunetv2(14), (1, 1, 512, 512, 512), "4GiB", "bf16",
     "labels"),
    ("SegResNet(32), 105 classes", _segresnet(105), (1, 1, 512, 512, 400), "8GiB", "bf16",
     "labels"),
]


@dataclass
class SlidingWindowRun:
    """MONAI ``sliding_window_inference`` measured on meta (NOTE above)."""

    windows: int
    peak_bytes: int
    host_peak_bytes: int
    flops: int


def sliding_window_run(model: nn.Module, shape: tuple[int, ...], roi: int, overlap: float,
                       *, amp: str | None = None, output_on_host: bool = False,
                       every_window: bool = False) -> SlidingWindowRun:
    """Run ``sliding_window_inference`` (gaussian, ``sw_batch_size=1``) of ``model`` on a
    meta volume of ``shape`` under the tracker; ``every_window``: run the network on every
    window, not only the first two (NOTE rule 2)."""
    from monai.inferers import sliding_window_inference
    from monai.inferers.utils import compute_importance_map

    meta_model = meta_copy(model).eval()
    dtype = amp_dtype(amp)
    weight_map = compute_importance_map((roi,) * 3, mode="gaussian", sigma_scale=0.125,
                                        device="cpu")[None, None]  # NOTE rule 1
    calls = 0
    ran = 0
    result: tuple[torch.Size, torch.dtype] | None = None

    def network(window: torch.Tensor) -> torch.Tensor:
        nonlocal calls, ran, result
        calls += 1
        with placement("device"):
            if output_on_host:
                window = window.clone()  # MONAI's window.to(sw_device)
            if every_window or result is None or calls <= 2:
                ran += 1
                out = meta_model(window)
                result = (out.shape, out.dtype)
                return out
            return torch.empty(result[0], dtype=result[1], device="meta")

    tracker = MemoryTracker("meta")
    tracker.register(list(meta_model.parameters()) + list(meta_model.buffers()), "param")
    where = "host" if output_on_host else "device"
    with placement(where):
        volume = torch.empty(shape, device="meta")
    if not output_on_host:
        tracker.register([volume], "input")
    autocast = MetaAutocast(dtype) if dtype is not None else contextlib.nullcontext()
    with tracker, torch.no_grad(), autocast:
        if output_on_host:
            tracker.ledger.add(volume, "input", None, "setup", device=HOST)
        with placement("device"):
            weights = weight_map.to("meta")
        with placement(where):
            out = sliding_window_inference(volume, roi, 1, network, overlap=overlap,
                                           mode="gaussian", roi_weight_map=weights)
        del out
    flops = tracker.flops["forward"] // max(ran, 1) * calls
    return SlidingWindowRun(calls, tracker.peak_bytes, tracker.host_peak_bytes, flops)


def plan_flops(prediction: PredictionPlan, model: nn.Module) -> int:
    """FLOPs of the whole plan, every tile run on meta (halo recomputation included)."""
    return measure_plan(prediction, model, every_tile=True).flops["forward"]


def _untiled_flops(model: nn.Module, shape: tuple[int, ...], amp: str | None) -> int:
    meta_model = meta_copy(model).eval()
    dtype = amp_dtype(amp)
    tracker = MemoryTracker("meta")
    autocast = MetaAutocast(dtype) if dtype is not None else contextlib.nullcontext()
    with tracker, torch.no_grad(), autocast:
        out = meta_model(torch.empty(shape, device="meta"))
        del out
    return tracker.flops["forward"]


def _tflops(flops: int) -> str:
    return f"{flops / 1e12:.1f} TFLOP"


def _median(fn: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _label_changes(logits: torch.Tensor, reference: torch.Tensor) -> tuple[int, int, float]:
    """Voxels whose argmax differs from ``reference``'s, how many of those are near-ties
    (``reference``'s two top logits within the largest difference), the largest
    difference."""
    tolerance = (logits - reference).abs().max().item()
    changed = logits.argmax(1) != reference.argmax(1)
    top2 = reference.topk(2, dim=1).values
    ties = changed & ((top2[:, 0] - top2[:, 1]) <= tolerance)
    return int(changed.sum()), int(ties.sum()), tolerance


# budgets of the --cpu-time predictions (of the untiled forward's measured peak): each
# forces tiling at 128³; 0.6x is about the smallest feasible
_CPU_BUDGETS = ("0.8x", "0.7x", "0.6x")


def _cpu_time() -> None:
    from monai.inferers import sliding_window_inference

    from remat3d.zoo.presets import get_preset

    torch.manual_seed(0)
    model = get_preset("nnunetv2").factory(out_channels=2).eval()
    x = torch.randn(1, 1, 128, 128, 128)
    with torch.no_grad():
        reference = model(x)
        forward = _median(lambda: model(x))
    print(f"\nuntiled forward {forward:.2f} s (median of three)")
    for budget in _CPU_BUDGETS:
        plan = plan_prediction(model, x.shape, budget=budget)
        out = predict(model, x, plan=plan)
        tiled = _median(lambda plan=plan: predict(model, x, plan=plan))
        changed, ties, largest = _label_changes(out, reference)
        print(f"{budget}: {plan.summary()}")
        print(f"  tiled predict {tiled:.2f} s ({tiled / forward:.2f}x the untiled forward), "
              f"largest difference {largest:.2e}; labels differ at {changed} of "
              f"{reference[:, 0].numel()} voxels, {ties} of them near-ties (top-2 logits "
              f"within {largest:.2e})")
    print("\nMONAI sliding_window_inference (gaussian, sw_batch_size 1) against the "
          "whole-volume forward, nnunetv2 1x1x128x128x128 fp32, random weights and input, "
          "one run each:\n")
    print("| roi | overlap | CPU time | vs whole forward | largest logit difference "
          "| voxels whose label differs |")
    print("|---|---|---:|---:|---:|---:|")
    for roi, overlap in [(96, 0.25), (96, 0.5), (64, 0.25), (64, 0.5)]:
        def windows(roi: int = roi, overlap: float = overlap) -> torch.Tensor:
            with torch.no_grad():
                return sliding_window_inference(x, roi, 1, model, overlap=overlap,
                                                mode="gaussian")
        start = time.perf_counter()
        result = windows()
        seconds = time.perf_counter() - start
        changed, _, largest = _label_changes(result, reference)
        print(f"| {roi}³ | {overlap} | {seconds:.2f} s | {seconds / forward:.2f}x | "
              f"{largest:.2e} | {100 * changed / reference[:, 0].numel():.2f}% |")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="remat3d bench predict", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-time", action="store_true",
                        help="also time nnunetv2 128³ fp32 on this CPU (predict and "
                        "MONAI's sliding windows)")
    args = parser.parse_args(argv)
    print(f"remat3d bench predict, {datetime.date.today()}, {platform.machine()} "
          f"{platform.processor() or ''}, torch {torch.__version__}\n")
    print("| case | volume | amp | output | budget | verified device peak | host memory "
          "| untiled peak | FLOPs (tiled plan) | FLOPs (untiled) | planning |")
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    windowed = []
    for name, build, shape, budget, amp, output in CASES:
        model = build()
        start = time.perf_counter()
        plan = plan_prediction(model, shape, budget=budget, amp=amp, output=output,
                               device="meta")
        seconds = time.perf_counter() - start
        untiled = _untiled_flops(model, shape, amp)
        print(f"| {name} | {format_shape(shape)} | {amp} | {output} | {budget} | "
              f"{format_bytes(plan.verified_peak_bytes)} | "
              f"{format_bytes(plan.verified_host_peak_bytes)} | "
              f"{format_bytes(plan.untiled_peak_bytes)} | "
              f"{_tflops(plan_flops(plan, model))} | {_tflops(untiled)} | {seconds:.1f} s |")
        for roi, overlap in WINDOWS:
            on_device = sliding_window_run(model, shape, roi, overlap, amp=amp)
            on_host = sliding_window_run(model, shape, roi, overlap, amp=amp,
                                         output_on_host=True)
            windowed.append((name, roi, overlap, on_device, on_host, untiled))
    print("\nMONAI sliding_window_inference on the same volumes and amp (gaussian, "
          "sw_batch_size 1; logits stitched in fp32, before any argmax), measured on meta "
          "under the same tracker:\n")
    print("| case | roi | overlap | windows | device peak (output on device) | device peak "
          "(output on host) | host memory (output on host) | FLOPs | vs untiled |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name, roi, overlap, on_device, on_host, untiled in windowed:
        print(f"| {name} | {roi}³ | {overlap} | {on_device.windows} | "
              f"{format_bytes(on_device.peak_bytes)} | {format_bytes(on_host.peak_bytes)} | "
              f"{format_bytes(on_host.host_peak_bytes)} | {_tflops(on_device.flops)} | "
              f"{on_device.flops / untiled:.2f}x |")
    if args.cpu_time:
        _cpu_time()


if __name__ == "__main__":
    main()

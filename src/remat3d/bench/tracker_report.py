"""Validate the tracker against the CPU allocator for every zoo preset.

Run ``remat3d bench tracker [--size 32] [--out FILE.md]`` to regenerate the
table in ``docs/tracker.md``. Each row runs one real CPU training step twice: once under the
tracker, once under the allocator trace (``reference.py``), and also counts FLOPs with
``torch.utils.flop_counter.FlopCounterMode`` for the same step.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from remat3d import zoo
from remat3d.graph import atomic_write_text
from remat3d.instrument.reference import allocator_measure
from remat3d.instrument.step import forward_backward, prepare_step, preserved_state, run_step
from remat3d.units import format_shape

__all__ = ["ValidationRow", "main", "validate_preset"]


@dataclass
class ValidationRow:
    preset: str
    shape: tuple[int, ...]
    tracker_peak: int
    allocator_peak: int  # at op boundaries (comparable)
    allocator_peak_with_scratch: int
    tracker_flops: int
    flop_counter_flops: int

    @property
    def peak_error(self) -> float:
        return abs(self.tracker_peak - self.allocator_peak) / self.allocator_peak


def validate_preset(name: str, size: int = 32) -> ValidationRow:
    """Compare tracker and allocator peaks (and FLOPs) for one preset on CPU.

    ``size`` is rounded up to the preset's divisibility rule and minimum size.
    """
    preset = zoo.get_preset(name)
    smallest = zoo.smallest_input_shape(preset)
    shape = zoo.legal_shape(preset, (*smallest[:2], size, size, size))
    torch.manual_seed(0)
    model = zoo.build_model(preset.name, spatial_size=tuple(shape[2:]))
    x = torch.randn(shape)
    setup = prepare_step(model, (x,), "cpu", None, None)
    tracker = run_step(setup)
    tracker.close()
    reference = allocator_measure(setup)
    counter = FlopCounterMode(display=False)
    with preserved_state(setup):
        for p in model.parameters():
            p.grad = None
        with counter:
            forward_backward(setup)
    return ValidationRow(
        preset=preset.name,
        shape=tuple(shape),
        tracker_peak=tracker.peak_bytes,
        allocator_peak=reference.peak_bytes,
        allocator_peak_with_scratch=reference.allocator_peak_bytes,
        tracker_flops=sum(tracker.flops.values()),
        flop_counter_flops=counter.get_total_flops(),
    )


def markdown(rows: list[ValidationRow]) -> str:
    head = (
        "| preset | input | tracker peak | allocator peak (op boundaries) | error | "
        "allocator peak incl. kernel scratch | tracker FLOPs | FlopCounterMode FLOPs |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|\n"
    )
    body = "".join(
        f"| {r.preset} | {format_shape(r.shape)} | {r.tracker_peak:,} | "
        f"{r.allocator_peak:,} | {100 * r.peak_error:.3f}% | "
        f"{r.allocator_peak_with_scratch:,} | {r.tracker_flops:,} | {r.flop_counter_flops:,} |\n"
        for r in rows
    )
    stamp = (
        f"\nGenerated {datetime.date.today().isoformat()} on {platform.machine()} "
        f"({os.cpu_count()} cores), torch {torch.__version__}, "
        "by `remat3d bench tracker`.\n"
    )
    return head + body + stamp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="remat3d bench tracker",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=32,
                        help="spatial edge, rounded up to each preset's rule (default 32)")
    parser.add_argument("--presets", nargs="*", default=zoo.preset_names())
    parser.add_argument("--out", default=None, help="write the markdown table here")
    args = parser.parse_args(argv)
    rows = []
    for name in args.presets:
        row = validate_preset(name, args.size)
        print(f"{name:10s} tracker {row.tracker_peak:>14,}  allocator {row.allocator_peak:>14,}"
              f"  error {100 * row.peak_error:.3f}%  flops {row.tracker_flops:,} vs "
              f"{row.flop_counter_flops:,}", flush=True)
        rows.append(row)
    table = markdown(rows)
    if args.out:
        atomic_write_text(args.out, table)
    else:
        print(table)


if __name__ == "__main__":
    main()

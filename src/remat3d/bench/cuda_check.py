"""Check remat3d's predictions on a real CUDA GPU: peaks, offload, step times, exactness.

Run on a machine with a GPU::

    python -m remat3d.bench.cuda_check --plan nnunet:plan.json [--plan ...] \\
        [--unplanned nnunet:1x1x256x256x256:bf16] --out DIR

Plans are made (and verified on meta) beforehand with ``remat3d plan … -o plan.json``: the
check measures what they promise. For each plan it builds the preset at the plan's input
shape on the GPU, applies the plan and runs training steps (loss = mean of the output):

- **allocator peak**: ``torch.cuda.max_memory_allocated()`` over uninstrumented steps
  after a warm-up step, against the plan's verified (meta) peak and the tracker's peak of
  the same step on the GPU. The allocator also holds kernel workspaces (cuDNN, cuBLAS)
  that no tracker sees, so it may sit a little above;
- **step time**: median wall time of the timed steps (``torch.cuda.synchronize`` around
  each), and the plan's FLOPs over the unplanned step's.

``--exactness`` adds planned-against-unplanned steps at 64³ on the GPU with
deterministic algorithms (gradients and buffers compared with ``torch.equal``; the plans
are listed in ``EXACTNESS``), and tiled against untiled stages in fp32 and fp64. Each
result is appended to ``DIR/results.jsonl`` as soon as it is measured (so a run cut short
keeps what it did) and ``DIR/report.md`` is rewritten after each. ``--deadline`` bounds
the whole run and ``--case-timeout`` one case: a case past either is stopped and reported
as such. ``--device cpu`` runs the same code on CPU (the tests do, at 16³).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import json
import math
import os
import platform
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from remat3d.bench.cuda_report import markdown
from remat3d.graph import atomic_write_text

__all__ = ["exactness_row", "main", "planned_row", "tiled_row", "unplanned_row"]

GiB = float(1 << 30)

# planned against unplanned, bitwise: (preset, plan, amp). "optimal:B" is remat3d.plan at
# budget B (below the smallest feasible budget: at the smallest, the most recomputation);
# "blocks:D" is decision D (recompute, offload, or a selective policy) on every block,
# without planning (seconds instead of a minute per case on the meta device)
EXACTNESS = [("nnunet", "optimal:0.5x", None), ("nnunet", "blocks:offload", None),
             ("nnunet", "blocks:recompute", "bf16"), ("nnunet", "blocks:offload", "bf16"),
             ("nnunet", "blocks:save-compute-heavy", "bf16"),
             ("segresnet", "blocks:recompute", None)]
# tiled against untiled full-resolution stages: (preset, tile, dtype); 24 does not divide 64
TILED = [("nnunet", 24, torch.float32), ("nnunet", 24, torch.float64),
         ("segresnet", 40, torch.float32)]


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _allocator_peak(device: str) -> int | None:
    return int(torch.cuda.max_memory_allocated()) if device.startswith("cuda") else None


def _measure_steps(model: torch.nn.Module, shape: list[int], amp: str | None, device: str,
                   repeats: int, track: bool = True) -> dict[str, Any]:
    """Warm-up step, ``repeats`` timed steps (allocator peak over them), one tracked step.

    ``repeats=0`` times the warm-up step alone and takes its allocator peak (on a GPU lent
    for minutes, one 512³ step is what a case can afford); ``track=False`` leaves out the
    tracked step (its peak is then None)."""
    from remat3d.instrument.step import prepare_step, run_step, time_step

    torch.manual_seed(0)
    x = torch.randn(shape, device=device)
    setup = prepare_step(model, (x,), device, amp, None)
    _reset_peak(device)
    warm = time_step(setup, 1)
    warm_peak = _allocator_peak(device)
    times, peak = [warm], warm_peak
    if repeats > 0:
        _reset_peak(device)
        times = [time_step(setup, 1) for _ in range(repeats)]
        peak = _allocator_peak(device)
    row: dict[str, Any] = {
        "warmup_s": warm,
        "seconds": statistics.median(times),
        "seconds_all": times,
        "timed_steps": repeats,
        "allocator_peak": peak,
        "allocator_peak_warmup": warm_peak,
        "tracker_peak": None, "tracker_flops": None, "tracker_host_peak": None,
    }
    if track:
        tracker = run_step(setup)
        try:
            row.update(tracker_peak=tracker.peak_bytes, tracker_host_peak=tracker.host_peak_bytes,
                       tracker_flops=sum(tracker.flops.values()))
        finally:
            tracker.close()
    return row


def planned_row(preset: str, plan_path: str, device: str, repeats: int,
                track: bool = True) -> dict[str, Any]:
    """One plan, applied to the preset at the plan's input shape, run on ``device``."""
    import remat3d
    from remat3d import zoo

    plan = remat3d.Plan.load(plan_path)
    shape = list(plan.input_shapes[0])
    model = zoo.build_model(preset, spatial_size=tuple(shape[2:])).to(device)
    remat3d.apply(model, plan)
    tiled = sorted({r.module for r in plan.regions if r.decision == "tile"})
    row: dict[str, Any] = {
        "kind": "planned", "preset": preset, "plan": Path(plan_path).name,
        "shape": shape, "amp": plan.amp, "strategy": plan.strategy,
        "budget": plan.budget_bytes, "verified_peak": plan.verified_peak_bytes,
        "predicted_peak": plan.predicted_peak_bytes,
        "flops_ratio": (1 + plan.extra_flops / plan.step_flops)
        if plan.extra_flops is not None and plan.step_flops else None,
        "offload": plan.offloads,
        "prefetch": plan.prefetch, "tiled": tiled,
        "host": [r.module for r in plan.regions if r.host],
        "verified_host": plan.verified_host_bytes,
    }
    try:
        row.update(_measure_steps(model, shape, plan.amp, device, repeats, track))
    finally:
        remat3d.remove(model)
        del model
    return row


def unplanned_row(preset: str, shape: list[int], amp: str | None, device: str,
                  repeats: int, track: bool = True) -> dict[str, Any]:
    """The plain step, for the planned rows' time and peak to be read against."""
    import remat3d
    from remat3d import zoo

    model = zoo.build_model(preset, spatial_size=tuple(shape[2:])).to(device)
    meta = remat3d.measure(model, torch.Size(shape), device="meta", amp=amp)
    row: dict[str, Any] = {
        "kind": "unplanned", "preset": preset, "plan": "none", "shape": shape, "amp": amp,
        "strategy": "none", "verified_peak": meta.peak_bytes, "flops_ratio": 1.0,
        "offload": False, "tiled": [],
    }
    row.update(_measure_steps(model, shape, amp, device, repeats, track))
    return row


def _step_state(model: torch.nn.Module, x: torch.Tensor,
                amp: str | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from remat3d.instrument.amp import amp_dtype

    dtype = amp_dtype(amp)
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        loss = model(x).float().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return grads, [b.clone() for b in model.buffers()]


def exactness_row(preset: str, size: int, how: str, amp: str | None,
                  device: str) -> dict[str, Any]:
    """A planned step against the unplanned one on ``device``, deterministic algorithms on:
    every parameter gradient and buffer compared bitwise. ``how`` is "optimal:BUDGET" or
    "blocks:DECISION" (module ``EXACTNESS``)."""
    import remat3d
    from remat3d import zoo

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(0)
        shape = list(zoo.legal_shape(preset, (1, zoo.get_preset(preset).in_channels,
                                              size, size, size)))
        model = zoo.build_model(preset, spatial_size=tuple(shape[2:])).to(device)
        planned = copy.deepcopy(model)
        x = torch.randn(shape, device=device)
        strategy, _, setting = how.partition(":")
        if strategy == "optimal":
            plan = _plan_at_most(model, shape, setting, amp)
        else:
            blocks = dict.fromkeys(b.name for b in
                                   remat3d.profile(model, torch.Size(shape), amp=amp)
                                   .graph.blocks())
            decision = setting if setting in ("recompute", "offload") else "recompute"
            policy = None if setting in ("recompute", "offload") else setting
            plan = remat3d.Plan(regions=[remat3d.Region(module=b, decision=decision,
                                                        policy=policy) for b in blocks],
                                offload_min_bytes=0)
        remat3d.apply(planned, plan)
        ref_g, ref_b = _step_state(model, x, amp)
        got_g, got_b = _step_state(planned, x, amp)
        equal = len(ref_g) == len(got_g) and all(
            torch.equal(a, b) for a, b in zip(ref_g + ref_b, got_g + got_b))
        worst = max((((a.double() - b.double()).abs().max()
                      / b.double().abs().max().clamp_min(1e-30)).item()
                     for a, b in zip(got_g, ref_g)), default=0.0)
        return {"kind": "exactness", "preset": preset, "shape": shape, "amp": amp,
                "plan": how, "budget_bytes": plan.budget_bytes,
                "regions": len(plan.regions),
                "decisions": sorted({r.decision for r in plan.regions}),
                "bitwise_equal": equal, "max_rel_grad_diff": worst}
    finally:
        torch.use_deterministic_algorithms(previous)


def _plan_at_most(model: torch.nn.Module, shape: list[int], budget: str,
                  amp: str | None) -> Any:
    import remat3d
    from remat3d.errors import InfeasibleBudgetError

    try:
        return remat3d.plan(model, torch.Size(shape), budget=budget, amp=amp, tile=False)
    except InfeasibleBudgetError as exc:  # the heaviest plan: the harder test
        return remat3d.plan(model, torch.Size(shape), budget=exc.smallest_feasible_bytes,
                            amp=amp, tile=False)


def tiled_row(preset: str, size: int, tile: int, dtype: torch.dtype,
              device: str) -> dict[str, Any]:
    """Tiled full-resolution stages against the untiled step (``report_tiling``)."""
    from remat3d.bench.tiling_report import split_errors, step_errors

    errors = split_errors(step_errors(preset, size, tile, dtype, device=device))
    floor = split_errors(step_errors(preset, size, tile, dtype, reference="float64",
                                     device=device)) if dtype != torch.float64 else None
    return {"kind": "tiled", "preset": preset, "size": size, "tile": tile,
            "dtype": str(dtype).replace("torch.", ""), "errors": errors, "noise_floor": floor}


def _parse_shape(text: str) -> list[int]:
    return [int(v) for v in text.lower().split("x")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="remat3d bench gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="append", default=[],
                        help="PRESET:PLAN.json (repeatable), run in the order given")
    parser.add_argument("--unplanned", action="append", default=[],
                        help="PRESET:BxCxDxHxW:AMP (AMP none, bf16 or fp16)")
    parser.add_argument("--exactness", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed steps after the warm-up; 0 times the warm-up step alone")
    parser.add_argument("--no-tracker", action="store_true",
                        help="leave out the step under the tracker (its peak column is then —)")
    parser.add_argument("--exact-size", type=int, default=64)
    parser.add_argument("--deadline", type=float, default=math.inf,
                        help="seconds for the whole run: no case starts after it, and a "
                             "running case is stopped at it")
    parser.add_argument("--case-timeout", type=float, default=math.inf,
                        help="seconds one case may run before it is stopped (reported)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if args.device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        total = torch.cuda.get_device_properties(0).total_memory
        machine = f"{name} ({total / GiB:.1f} GiB)"
    else:
        machine = f"{platform.machine()} CPU ({os.cpu_count()} cores)"
    header = (f"Generated {datetime.date.today()} on {machine}, torch {torch.__version__}, "
              "by `python -m remat3d.bench.cuda_check` (docs/gpu.md gives the command).")
    print(header, flush=True)

    dev, reps, track = args.device, args.repeats, not args.no_tracker
    if reps < 0:
        parser.error(f"--repeats {reps}: give 0 or more timed steps")
    # (kind, what it runs, the fields a failed case still reports)
    cases: list[tuple[str, Callable[[], dict[str, Any]], dict[str, Any]]] = []
    for spec in args.unplanned:
        preset, text, amp_text = spec.split(":")
        shape, amp = _parse_shape(text), None if amp_text == "none" else amp_text
        cases.append(("unplanned", functools.partial(unplanned_row, preset, shape, amp, dev, reps,
                                                         track),
                      {"preset": preset, "plan": "none", "shape": shape, "amp": amp}))
    for spec in args.plan:
        preset, path = spec.split(":", 1)
        cases.append(("planned", functools.partial(planned_row, preset, path, dev, reps, track),
                      {"preset": preset, "plan": Path(path).name, "shape": [], "amp": None}))
    if args.exactness:
        n = args.exact_size
        for preset, how, amp in EXACTNESS:
            cases.append(("exactness", functools.partial(exactness_row, preset, n, how, amp, dev),
                          {"preset": preset, "amp": amp, "plan": how}))
        for preset, tile, dtype in TILED:
            cases.append(("tiled", functools.partial(tiled_row, preset, n, tile, dtype, dev),
                          {"preset": preset, "size": n, "tile": tile, "dtype": str(dtype)}))

    rows: list[dict[str, Any]] = []
    for kind, run, fields in cases:
        left = args.deadline - (time.monotonic() - start)
        if left <= 0:
            print(f"deadline reached: {kind} {fields} not run", flush=True)
            continue
        t0 = time.monotonic()
        try:
            with _time_limit(min(left, args.case_timeout)):
                row = run()
        except Exception as exc:  # noqa: BLE001 - a failed case is a result to report
            row = {"kind": kind, "error": f"{type(exc).__name__}: {str(exc)[:300]}", **fields}
        row["wall_s"] = time.monotonic() - t0
        rows.append(row)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(json.dumps(row, default=str), flush=True)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        atomic_write_text(out / "report.md", markdown(rows, header) + "\n")


class CaseTimeout(Exception):
    """A case ran past its time (``--case-timeout`` or the ``--deadline``)."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the case after ``seconds`` (SIGALRM: Unix, main thread; elsewhere none).

    A GPU step returns to Python between kernels, and a tiled one between tiles, so the
    case stops within about one kernel; its tensors are freed with its frames."""
    if not math.isfinite(seconds) or not hasattr(signal, "SIGALRM") \
            or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"stopped after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


if __name__ == "__main__":
    main()

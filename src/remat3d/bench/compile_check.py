"""A planned model under ``torch.compile`` on CPU: gradients and the allocator's peak.

Run::

    python -m remat3d.bench.compile_check --preset nnunet --size 64 --budget 0.75x \\
        [--backend inductor] [--tile] [--eager-plan] [--graph]

It plans the preset for compilation (``remat3d.plan(..., compiled=True, graph=False)``:
module plans verified without rebuilt saved tensors, as a compiled step runs them;
``--graph``: a graph plan, whose graphs remat3d compiles with inductor itself,
``runtime/inductor.py``, its "eager, planned" step running them op by op; ``--eager-plan``:
planned for eager steps instead; ``--tile`` allows tiling), then
runs one training step (loss = mean of the squared output, fp32) four ways: eager and
compiled, unplanned and planned; each compiled step after one warm-up step that compiles
it. It prints each step's time (the median of three) and CPU allocator peak
(``instrument/reference.py``: raw, in-kernel buffers included, and without the scratch
the aten kernels allocate and free inside one call, the figure the tracker's verified
peak is: for a compiled step its own buffers, made between aten calls, are sampled as
they are made; NOTE [ Comparing at operator boundaries ]), the plan's verified peak,
and the largest norm-wise relative gradient difference of the compiled planned step
against the compiled unplanned one and against the eager planned one (NOTE [ Plans under
torch.compile ] in ``runtime/compiled.py``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import platform
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

import remat3d
from remat3d import zoo
from remat3d.errors import Remat3dError
from remat3d.instrument.reference import AllocatorMeasure, allocator_measure
from remat3d.instrument.step import prepare_step
from remat3d.units import format_bytes

__all__ = ["main"]


def _step(model: nn.Module, x: torch.Tensor, compiled: bool, backend: str
          ) -> tuple[dict[str, torch.Tensor], AllocatorMeasure, float]:
    """Gradients of one step, its allocator peaks and the median of three steps' seconds
    (compiled: after a warm-up step that compiles it)."""
    torch._dynamo.reset()
    run = torch.compile(model, backend=backend) if compiled else model

    def step() -> float:
        for p in model.parameters():
            p.grad = None
        start = time.perf_counter()
        run(x).float().square().mean().backward()
        return time.perf_counter() - start

    if compiled:
        step()
    for p in model.parameters():
        p.grad = None
    peak = allocator_measure(prepare_step(run, [x], "cpu", None, None))
    seconds = statistics.median(step() for _ in range(3))
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}, peak, seconds


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)).item() for n in b)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m remat3d.bench.compile_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="nnunet")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--budget", default="0.75x")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--tile", action="store_true", help="allow tiled regions in the plan")
    ap.add_argument("--eager-plan", action="store_true",
                    help="plan for eager steps (rebuilt saved tensors counted), not compiled")
    ap.add_argument("--graph", action="store_true",
                    help="a graph plan (compiled by inductor when planned for compilation)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = zoo.build_model(args.preset)
    x = torch.randn(1, 1, args.size, args.size, args.size)
    try:
        plan = remat3d.plan(model, tuple(x.shape), budget=args.budget, graph=args.graph,
                            tile=args.tile, compiled=not args.eager_plan)
    except Remat3dError as exc:  # a budget no plan reaches: one line, no traceback
        raise SystemExit(f"error: {exc}") from None
    print(f"# compile_check {datetime.date.today()} {platform.machine()} "
          f"torch {torch.__version__}, {args.preset} {args.size}^3 fp32, budget "
          f"{args.budget}, backend {args.backend}, planned for "
          f"{'eager steps' if args.eager_plan else 'compilation'}")
    print(plan.summary())
    planned = remat3d.apply(copy.deepcopy(model), plan)
    # a graph plan compiled by inductor, run eagerly: its graphs op by op
    eager_plan = dataclasses.replace(plan, graph_backend="eager")
    eager_plain, peak_eager_plain, s_eager_plain = _step(copy.deepcopy(model), x, False,
                                                         args.backend)
    eager_planned, peak_eager_planned, s_eager_planned = _step(
        remat3d.apply(copy.deepcopy(model), eager_plan), x, False, args.backend)
    compiled_plain, peak_compiled_plain, s_compiled_plain = _step(copy.deepcopy(model), x,
                                                                  True, args.backend)
    compiled_planned, peak_compiled_planned, s_compiled_planned = _step(planned, x, True,
                                                                        args.backend)
    verified = plan.verified_peak_bytes or 0
    for label, peak, seconds in (
            ("eager, unplanned", peak_eager_plain, s_eager_plain),
            ("eager, planned", peak_eager_planned, s_eager_planned),
            ("compiled, unplanned", peak_compiled_plain, s_compiled_plain),
            ("compiled, planned", peak_compiled_planned, s_compiled_planned)):
        print(f"{label:22s} step {seconds:6.2f} s, allocator peak "
              f"{format_bytes(peak.allocator_peak_bytes):>11s}, without in-kernel scratch "
              f"{format_bytes(peak.peak_bytes):>11s}")
    compiled = peak_compiled_planned
    print(f"verified (meta) peak of the plan {format_bytes(verified)}; compiled planned "
          f"without in-kernel scratch / verified = "
          f"{compiled.peak_bytes / max(verified, 1):.3f}; with it / verified = "
          f"{compiled.allocator_peak_bytes / max(verified, 1):.3f}; compiled planned / eager "
          f"planned (both with in-kernel scratch) = "
          f"{compiled.allocator_peak_bytes / max(peak_eager_planned.allocator_peak_bytes, 1):.3f}")
    print(f"gradients, compiled planned vs compiled unplanned: "
          f"{_worst(compiled_planned, compiled_plain):.3g}; vs eager planned: "
          f"{_worst(compiled_planned, eager_planned):.3g}; compiled unplanned vs eager "
          f"unplanned: {_worst(compiled_plain, eager_plain):.3g}")


if __name__ == "__main__":
    main()

"""A planned model under ``torch.compile`` on CPU: gradients and the allocator's peak.

Run::

    python -m remat3d.bench.compile_check --preset nnunet --size 64 --budget 0.75x \\
        [--backend inductor] [--tile] [--eager-plan]

It plans the preset for compilation (``remat3d.plan(..., compiled=True)``: module plans
verified without rebuilt saved tensors, as a compiled step runs them; ``--eager-plan``:
planned for eager steps instead, ``graph=False``; ``--tile`` allows tiling), then runs one
training step (loss = mean of the squared output, fp32) four ways: eager and compiled,
unplanned and planned; each compiled step after one warm-up step that compiles it. It
prints the CPU allocator's peak of each step (``instrument/reference.py``: at op
boundaries, and raw, in-kernel buffers included: compiled kernels are not aten ops, so for
compiled steps the raw peak is the figure), the plan's verified peak, and the largest
norm-wise relative gradient difference of the compiled planned step against the compiled
unplanned one and against the eager planned one (NOTE [ Plans under torch.compile ] in
``runtime/compiled.py``).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform
from collections.abc import Sequence

import torch
from torch import nn

import remat3d
from remat3d import zoo
from remat3d.errors import Remat3dError
from remat3d.instrument.reference import allocator_measure
from remat3d.instrument.step import prepare_step
from remat3d.units import format_bytes

__all__ = ["main"]


def _step(model: nn.Module, x: torch.Tensor, compiled: bool, backend: str
          ) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of one step and its raw allocator peak (compiled: after a warm-up)."""
    torch._dynamo.reset()
    run = torch.compile(model, backend=backend) if compiled else model
    if compiled:
        for p in model.parameters():
            p.grad = None
        run(x).float().square().mean().backward()
    for p in model.parameters():
        p.grad = None
    peak = allocator_measure(prepare_step(run, [x], "cpu", None, None)).allocator_peak_bytes
    for p in model.parameters():
        p.grad = None
    run(x).float().square().mean().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}, peak


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
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = zoo.build_model(args.preset)
    x = torch.randn(1, 1, args.size, args.size, args.size)
    try:
        plan = remat3d.plan(model, tuple(x.shape), budget=args.budget, graph=False,
                            tile=args.tile, compiled=not args.eager_plan)
    except Remat3dError as exc:  # a budget no plan reaches: one line, no traceback
        raise SystemExit(f"error: {exc}") from None
    print(f"# compile_check {datetime.date.today()} {platform.machine()} "
          f"torch {torch.__version__}, {args.preset} {args.size}^3 fp32, budget "
          f"{args.budget}, backend {args.backend}, planned for "
          f"{'eager steps' if args.eager_plan else 'compilation'}")
    print(plan.summary())
    planned = remat3d.apply(copy.deepcopy(model), plan)
    eager_plain, peak_eager_plain = _step(copy.deepcopy(model), x, False, args.backend)
    eager_planned, peak_eager_planned = _step(planned, x, False, args.backend)
    compiled_plain, peak_compiled_plain = _step(copy.deepcopy(model), x, True, args.backend)
    compiled_planned, peak_compiled_planned = _step(planned, x, True, args.backend)
    verified = plan.verified_peak_bytes or 0
    for label, peak in (("eager, unplanned", peak_eager_plain),
                        ("eager, planned", peak_eager_planned),
                        ("compiled, unplanned", peak_compiled_plain),
                        ("compiled, planned", peak_compiled_planned)):
        print(f"{label:22s} allocator peak {format_bytes(peak):>11s}")
    print(f"verified (meta) peak of the plan {format_bytes(verified)}; compiled planned "
          f"/ verified = {peak_compiled_planned / max(verified, 1):.3f}")
    print(f"gradients, compiled planned vs compiled unplanned: "
          f"{_worst(compiled_planned, compiled_plain):.3g}; vs eager planned: "
          f"{_worst(compiled_planned, eager_planned):.3g}; compiled unplanned vs eager "
          f"unplanned: {_worst(compiled_plain, eager_plain):.3g}")


if __name__ == "__main__":
    main()

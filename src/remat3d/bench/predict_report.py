"""``remat3d bench predict``: whole-volume prediction plans at full size (meta), and the
CPU time of a tiled prediction against the untiled forward.

Run::

    remat3d bench predict [--cpu-time]

Each meta case traces the forward on fake tensors, plans it for a device with host
memory beside it (``remat3d.plan_prediction(..., device="meta")``) and verifies it under
the tracker; the table gives the verified device peak, the host memory the plan uses, the
untiled forward's bound and the planning time. ``--cpu-time`` runs zoo ``nnunetv2`` at
128³ fp32 on this CPU: the untiled forward, then ``predict`` at ``0.3x`` (tiled), the
median of three each, and their largest difference.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from remat3d.predicting import plan_prediction, predict
from remat3d.units import format_bytes, format_shape

__all__ = ["main"]


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


def _median(fn: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cpu_time() -> None:
    from remat3d.zoo.presets import get_preset

    torch.manual_seed(0)
    model = get_preset("nnunetv2").factory(out_channels=2).eval()
    x = torch.randn(1, 1, 128, 128, 128)
    plan = plan_prediction(model, x.shape, budget="0.3x")
    with torch.no_grad():
        reference = model(x)
        forward = _median(lambda: model(x))
    out = predict(model, x, plan=plan)
    tiled = _median(lambda: predict(model, x, plan=plan))
    print(f"\n{plan.summary()}")
    print(f"untiled forward {forward:.2f} s, tiled predict {tiled:.2f} s "
          f"({tiled / forward:.2f}x), largest difference "
          f"{(out - reference).abs().max().item():.2e}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="remat3d bench predict", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-time", action="store_true",
                        help="also time nnunetv2 128³ fp32 on this CPU")
    args = parser.parse_args(argv)
    print(f"remat3d bench predict, {datetime.date.today()}, {platform.machine()} "
          f"{platform.processor() or ''}, torch {torch.__version__}\n")
    print("| case | volume | amp | output | budget | verified device peak | host memory "
          "| untiled bound | planning |")
    print("|---|---|---|---|---|---:|---:|---:|---:|")
    for name, build, shape, budget, amp, output in CASES:
        model = build()
        start = time.perf_counter()
        plan = plan_prediction(model, shape, budget=budget, amp=amp, output=output,
                               device="meta")
        seconds = time.perf_counter() - start
        print(f"| {name} | {format_shape(shape)} | {amp} | {output} | {budget} | "
              f"{format_bytes(plan.verified_peak_bytes)} | "
              f"{format_bytes(plan.verified_host_peak_bytes)} | "
              f"{format_bytes(plan.plan.unplanned_bytes)} | {seconds:.1f} s |")
    if args.cpu_time:
        _cpu_time()


if __name__ == "__main__":
    main()

"""``remat3d bench graph-tiles``: tiled graph plans at full size (meta), and each tiling
mode's peak and FLOPs, for ``docs/graph-tiles.md``.

Run::

    remat3d bench graph-tiles [--cases nnunetv2:512:bf16:24GiB ...] [--modes] [--cpu-time]

Each case plans zoo ``MODEL`` at ``SIZE``³ under ``AMP`` with ``remat3d.plan(...,
graph=True)`` at ``BUDGET`` on meta, the way ``remat3d plan --graph`` does: where no
recompute set fits, a tiled graph plan (``planning.py`` NOTE [ Tiled graph plans ]). The
table gives the unplanned step's peak, the plan's verified peak, its FLOPs against the
unplanned step's, how it tiles, and the planning time; an infeasible budget gives the
smallest peak reached.

``--modes`` measures every tiling mode of the search at a quarter and an eighth of the
grid for each case (peak and FLOPs): the trade the search chooses from.

``--cpu-time`` runs one real training step of zoo ``nnunetv2`` at 64³ fp32 on this CPU,
unplanned and with the tiled plan of a budget below every recompute set's peak (medians
of three): its time against the unplanned step's, beside its FLOPs ratio.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import platform
import statistics
import time
from dataclasses import dataclass

import torch

__all__ = ["main"]

_CASES = ("nnunetv2:512:bf16:24GiB", "resenc-l:512:bf16:24GiB", "nnunet:512:bf16:24GiB")


@dataclass
class _Case:
    model: str
    size: int
    amp: str | None
    budget: str

    @classmethod
    def parse(cls, text: str) -> _Case:
        model, size, amp, budget = text.split(":")
        return cls(model, int(size), None if amp == "none" else amp, budget)

    @property
    def shape(self) -> tuple[int, ...]:
        return (1, 1, self.size, self.size, self.size)

    def build(self) -> torch.nn.Module:
        from remat3d.zoo.presets import get_preset

        with torch.device("meta"):
            return get_preset(self.model).factory((self.size,) * 3)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _plan_row(case: _Case) -> str:
    import remat3d
    from remat3d.errors import InfeasibleBudgetError

    model = case.build()
    start = time.perf_counter()
    try:
        plan = remat3d.plan(model, case.shape, budget=case.budget, graph=True, amp=case.amp)
    except InfeasibleBudgetError as exc:
        seconds = time.perf_counter() - start
        return (f"| {case.model} {case.size}³ {case.amp or 'fp32'} | {case.budget} | "
                f"{_gib(exc.unplanned_peak_bytes)} | infeasible: smallest "
                f"{_gib(exc.smallest_feasible_bytes)} | - | - | {seconds:.0f} s |")
    seconds = time.perf_counter() - start
    ratio = 1 + (plan.extra_flops or 0) / plan.step_flops if plan.step_flops else 0.0
    tiling = plan.graph_tiling
    how = "untiled" if tiling is None else (
        f"{tiling.levels} grid(s), tile {'x'.join(map(str, tiling.tile))}"
        f"{', copies' if tiling.copy else ''}, stashes in {len(tiling.stashes)} regions")
    unplanned = remat3d.profile(model, case.shape, amp=case.amp).peak_bytes
    return (f"| {case.model} {case.size}³ {case.amp or 'fp32'} | {case.budget} | "
            f"{_gib(unplanned)} | {_gib(plan.verified_peak_bytes)} | {ratio:.2f}x | {how} | "
            f"{seconds:.0f} s |")


def _mode_rows(case: _Case) -> list[str]:
    from remat3d.capture.joint import capture
    from remat3d.instrument.amp import amp_dtype
    from remat3d.planner.liveness import closed_recompute
    from remat3d.planning import _LAYOUTS, _POLICIES, _tiles
    from remat3d.planspec import GraphTiling
    from remat3d.runtime.graph_run import measure_graph_plan

    model = case.build()
    graph = capture(model, case.shape, amp=amp_dtype(case.amp)).graph
    recompute = sorted(closed_recompute(graph, [n.name for n in graph.forward]))
    base = measure_graph_plan(model, (case.shape,), [], amp=case.amp)
    step = base.flops["forward"] + base.flops["backward"]
    rows = []
    for levels, copy in _LAYOUTS:
        for stash, parts in itertools.product(("none", *_POLICIES), (4, 8)):
            tiling = GraphTiling(_tiles((case.size,) * 3, levels, parts), levels, stash, copy)
            measured = measure_graph_plan(model, (case.shape,), recompute, amp=case.amp,
                                          tiling=tiling)
            rows.append(f"| {case.model} {case.size}³ | {levels} | {stash} | "
                        f"{'yes' if copy else 'no'} | {tiling.tile[0]} | "
                        f"{_gib(measured.peak_bytes)} | "
                        f"{sum(measured.flops.values()) / step:.2f}x |")
    return rows


def _cpu_rows() -> list[str]:
    import copy as copying

    import remat3d
    from remat3d.errors import InfeasibleBudgetError
    from remat3d.zoo.presets import get_preset

    torch.manual_seed(0)
    model = get_preset("nnunetv2").factory((64, 64, 64))
    x = torch.randn(1, 1, 64, 64, 64)
    try:  # below every recompute set's peak: the search tiles
        remat3d.plan(model, x, budget=1, graph=True, tile=False)
    except InfeasibleBudgetError as exc:
        budget = int(exc.smallest_feasible_bytes * 0.9)
    plan = remat3d.plan(model, x, budget=budget, graph=True)

    def seconds(m: torch.nn.Module) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            m(x).float().square().mean().backward()
            times.append(time.perf_counter() - start)
            m.zero_grad(set_to_none=True)
        return statistics.median(times)

    plain = seconds(copying.deepcopy(model))
    planned_model = remat3d.apply(copying.deepcopy(model), plan)
    planned_model(x).float().square().mean().backward()  # traced on the first call
    planned_model.zero_grad(set_to_none=True)
    tiled = seconds(planned_model)
    ratio = 1 + (plan.extra_flops or 0) / plan.step_flops
    return [(f"| nnunetv2 64³ fp32 | {_gib(budget)} | {_gib(plan.verified_peak_bytes)} | "
            f"{ratio:.2f}x | {plain:.2f} s | {tiled:.2f} s ({tiled / plain:.2f}x) |")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="remat3d bench graph-tiles",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=list(_CASES),
                        help="MODEL:SIZE:AMP:BUDGET (amp none for fp32)")
    parser.add_argument("--modes", action="store_true",
                        help="every tiling mode's peak and FLOPs for each case")
    parser.add_argument("--cpu-time", action="store_true",
                        help="a tiled plan's real step time on this CPU")
    args = parser.parse_args(argv)
    cases = [_Case.parse(c) for c in args.cases]
    print(f"remat3d bench graph-tiles, {datetime.date.today()}, {platform.machine()} "
          f"{platform.processor() or ''} torch {torch.__version__}\n")
    print("| case | budget | unplanned | verified peak | FLOPs | tiling | planning |")
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        print(_plan_row(case), flush=True)
    if args.modes:
        print("\n| case | grids | stash | copies | tile | peak | FLOPs |")
        print("|---|---|---|---|---|---|---|")
        for case in cases:
            for row in _mode_rows(case):
                print(row, flush=True)
    if args.cpu_time:
        print("\n| case | budget | verified peak | FLOPs | unplanned step | tiled step |")
        print("|---|---|---|---|---|---|")
        for row in _cpu_rows():
            print(row, flush=True)

"""Sweep and point cases: every method's step measured by the tracker on the meta device.

remat3d's plans are verified by ``remat3d.plan`` itself; the bench measures each applied
plan once more, the same way as the baselines (``remat3d.measure`` on a fresh meta model),
so every number in a record comes from one measurement path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from remat3d.bench.baselines import install_block_checkpoints, install_checkpoint_sequential
from remat3d.bench.compiled import compiled_step, measure_cast_step
from remat3d.bench.methods import build, plan_method, smallest_feasible
from remat3d.bench.records import Record
from remat3d.bench.suites import Case, Suite, budget_bytes
from remat3d.errors import BudgetError, InfeasibleBudgetError, Remat3dError
from remat3d.measurement import measure
from remat3d.planning import plan
from remat3d.planspec import Plan
from remat3d.profiling import profile
from remat3d.runtime.apply import apply
from remat3d.units import format_bytes

__all__ = ["CaseRun", "run_meta_case"]

log = logging.getLogger(__name__)


@dataclass
class CaseRun:
    """One case's records, built with the case's fields filled in."""

    case: Case
    shape: tuple[int, ...]
    stamp: Callable[[Record], Record]  # adds machine, date, versions
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    base_flops: int = 0
    records: list[Record] = field(default_factory=list)

    def build(self, device: str) -> nn.Module:
        return build(self.case.model, self.shape, device, self.model_kwargs)

    @property
    def amp(self) -> str | None:
        return None if self.case.amp == "none" else self.case.amp

    def add(self, method: str, setting: str = "", **values: object) -> Record:
        record = Record(model=self.case.model, input_shape=list(self.shape),
                        amp=self.case.amp, method=method, setting=setting,
                        tier="cpu" if self.case.kind == "cpu" else "meta",
                        **values)  # type: ignore[arg-type]
        if record.flops is not None and record.recompute_flops is None:
            record.recompute_flops = record.flops - self.base_flops
        if record.recompute_flops is not None and self.base_flops:
            record.recompute_ratio = record.recompute_flops / self.base_flops
        self.records.append(self.stamp(record))
        log.info("%s %s %s %s: %s peak %s", self.case.model, self.case.size, method, setting,
                 record.status, format_bytes(record.peak_bytes or 0))
        return record


def _measured(run: CaseRun, method: str, setting: str, net: object, **values: object) -> Record:
    m = measure(net, run.shape, device="meta", amp=run.amp)  # type: ignore[arg-type]
    return run.add(method, setting, peak_bytes=m.peak_bytes, saved_bytes=m.saved_bytes,
                   flops=m.flops, **values)


def _remat3d(run: CaseRun, strategy: str, setting: str, budget: int, *,
             offload: bool = False, extra_seconds: float = 0.0,
             budget_recorded: bool = True, graph: bool | None = None) -> Record:
    """remat3d's ``strategy`` at ``budget``; ``graph=False``: module plans only (the
    method is then ``remat3d:modules``)."""
    method = ("remat3d:modules" if graph is False else f"remat3d:{strategy}") \
        + ("+offload" if offload else "")
    net = run.build("meta")
    try:
        planned = plan_method(net, run.shape, run.amp, strategy, budget, offload, graph)
    except BudgetError as exc:
        return run.add(method, setting, status="infeasible", budget_bytes=budget,
                       note=str(exc))
    result: Plan = planned.plan
    what = (f"graph plan: {len(result.graph_recompute)} graph nodes recomputed"
            if result.graph_recompute is not None else f"{len(result.regions)} regions")
    record = _measured(run, method, setting, apply(run.build("meta"),
                                                     result),
                       budget_bytes=budget if budget_recorded else None,
                       plan_seconds=planned.seconds + extra_seconds,
                       note=what)
    if result.verified_peak_bytes is not None and record.peak_bytes != result.verified_peak_bytes:
        record.note += (f"; plan() verified {result.verified_peak_bytes} bytes, "
                        f"measured again {record.peak_bytes}")
    return record


def run_meta_case(run: CaseRun, suite: Suite) -> None:
    case = run.case
    net = run.build("meta")
    base = profile(net, run.shape, device="meta", amp=run.amp)
    run.base_flops = base.flops
    run.add("none", peak_bytes=base.peak_bytes, saved_bytes=base.saved_bytes,
            flops=base.flops)
    blocks = [n.name for n in base.graph.blocks()]
    baselines: list[Record] = []
    wrapped = run.build("meta")
    install_block_checkpoints(wrapped, blocks)
    baselines.append(_measured(run, "torch-blocks", f"{len(blocks)} blocks", wrapped))
    if case.kind == "blocks":  # optimal at per-block checkpointing's peak, and modules only
        per_block = baselines[0]
        if per_block.status == "ok" and per_block.peak_bytes is not None:
            setting = f"peak of {per_block.method} {per_block.setting}"
            _remat3d(run, "optimal", setting, per_block.peak_bytes)
            _remat3d(run, "optimal", setting, per_block.peak_bytes, graph=False)
        return

    if case.kind == "sweep":
        for k in suite.segments:
            seq = run.build("meta")
            if install_checkpoint_sequential(seq, k) == 0:
                run.add("checkpoint-sequential", f"segments={k}", status="not-applicable",
                        note="the model has no nn.Sequential of two or more children "
                             "(a U-Net's skip connections are not a chain)")
                continue
            baselines.append(_measured(run, "checkpoint-sequential", f"segments={k}", seq))

    baselines += _compile_records(run, suite.compile_budgets)

    strategies = suite.strategies if case.kind == "sweep" else ("blocks",)
    for strategy in strategies:
        baselines.append(_remat3d(run, strategy, "", base.peak_bytes, budget_recorded=False))

    for offload in suite.offload:
        try:
            smallest, seconds = smallest_feasible(net, run.shape, run.amp, offload)
        except Remat3dError as exc:
            run.add("remat3d:optimal" + ("+offload" if offload else ""), "smallest feasible",
                    status="error", note=str(exc))
            continue
        _remat3d(run, "optimal", "smallest feasible", smallest, offload=offload,
                 extra_seconds=seconds)

    _graph(run, "smallest feasible")

    if case.kind != "sweep":
        return
    for budget in suite.budgets:
        _remat3d(run, "optimal", f"budget={budget}", budget_bytes(budget, base.peak_bytes))
    for other in baselines:  # equal peak: remat3d at the peak each baseline reaches
        if other.status != "ok" or other.peak_bytes is None:
            continue
        setting = f"peak of {other.method} {other.setting}".strip()
        _remat3d(run, "optimal", setting, other.peak_bytes)
        if other.method == "compile":  # the op-level planner against the op-level one,
            _graph(run, setting, other.peak_bytes)
            # and on the objective that one minimises: FLOPs, as it counts them
            _graph(run, setting, other.peak_bytes, objective="flops")


def _graph(run: CaseRun, setting: str, budget: int | None = None,
           objective: str = "time") -> None:
    """A graph plan (``remat3d.plan(..., graph=True)``) at ``budget`` (None: the smallest
    peak its search reaches), measured once more like every other method; ``objective``
    the plan's (``"flops"``: method ``remat3d:graph:flops``)."""
    method = "remat3d:graph" + ("" if objective == "time" else f":{objective}")
    start = time.perf_counter()
    try:
        if budget is None:
            try:
                plan(run.build("meta"), run.shape, budget=1, graph=True, amp=run.amp,
                     objective=objective)
                raise Remat3dError("a graph plan fitted in 1 byte")
            except InfeasibleBudgetError as exc:
                budget = exc.smallest_feasible_bytes
        result = plan(run.build("meta"), run.shape, budget=budget, graph=True, amp=run.amp,
                      objective=objective)
    except InfeasibleBudgetError as exc:
        run.add(method, setting, status="infeasible", budget_bytes=budget, note=str(exc))
        return
    except Remat3dError as exc:
        run.add(method, setting, status="error", note=str(exc)[:300])
        return
    # measured as every method is (remat3d.measure on meta: on fake tensors for a graph plan)
    _measured(run, method, setting, apply(run.build("meta"), result), budget_bytes=budget,
              plan_seconds=time.perf_counter() - start,
              note=f"{len(result.graph_recompute or [])} graph nodes recomputed; peak "
                   "measured by the tracker on fake tensors")


_CPU_FALLBACK_BYTES = 2 << 30  # a compiled step this small may run for real on the CPU


def _fits_cpu(run: CaseRun) -> bool:
    """fp32 and a small unplanned peak: the step can be measured on the CPU instead (the
    tracker's CPU peak is the meta peak of the same step; docs/tracker.md)."""
    base = run.records[0].peak_bytes or 0
    return run.amp is None and 0 < base <= _CPU_FALLBACK_BYTES


def _compile_records(run: CaseRun, budgets: tuple[float, ...]) -> list[Record]:
    if not budgets:
        return []
    note = ""
    if run.amp is not None:  # explicit casts stand in for autocast (compiled.py NOTE 4)
        try:
            eager = measure_cast_step(run.build("meta"), run.shape, "meta", run.amp)
        except Exception as exc:  # noqa: BLE001 - a failed baseline is a bench result
            for b in budgets:
                run.add("compile", f"memory_budget={b}", status="error",
                        note=f"the eager step with explicit casts failed: "
                             f"{type(exc).__name__}: {str(exc)[:300]}")
            return []
        ref = run.records[0]
        diff = abs(eager.peak_bytes - (ref.peak_bytes or 0)) / max(1, ref.peak_bytes or 1)
        note = (f"autocast as explicit casts; eager with those casts peaks "
                f"{100 * diff:.2f}% from MetaAutocast's")
    out = []
    device = "meta"
    for b in budgets:
        start = time.perf_counter()
        try:
            try:
                step = compiled_step(run.build(device), run.shape, device, run.amp, b)[1]
            except Remat3dError as exc:
                if device != "meta" or not _fits_cpu(run):
                    raise
                device = "cpu"  # compiled.py NOTE rule 5; the rest of the budgets too
                note = (note + "; " if note else "") + f"measured on a real CPU step ({exc})"
                step = compiled_step(run.build(device), run.shape, device, run.amp, b)[1]
        except Exception as exc:  # noqa: BLE001 - any compile failure is a bench result
            run.add("compile", f"memory_budget={b}", status="error",
                    note=f"{type(exc).__name__}: {str(exc)[:300]}")
            continue
        parts = ["aot_eager", note, f"{step.graphs} graphs" if step.graphs != 1 else ""]
        out.append(run.add("compile", f"memory_budget={b}", peak_bytes=step.peak_bytes,
                           saved_bytes=step.saved_bytes, flops=step.flops,
                           plan_seconds=time.perf_counter() - start,
                           note="; ".join(p for p in parts if p)))
    return out

"""Run a suite and write its outputs: ``results.json``, ``report.md`` and PNG plots."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from remat3d.bench.cpu_cases import run_cpu_case
from remat3d.bench.meta_cases import CaseRun, run_meta_case
from remat3d.bench.methods import case_shape
from remat3d.bench.records import Record, machine_info, now, versions_info, write_results
from remat3d.bench.suites import Case, Suite

__all__ = ["BenchResult", "run_suite"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BenchResult:
    records: list[Record]
    files: list[Path]
    seconds: float


def _stamp() -> Callable[[Record], Record]:
    machine, versions, date = machine_info(), versions_info(), now()

    def stamp(record: Record) -> Record:
        record.machine, record.versions, record.date = dict(machine), dict(versions), date
        return record

    return stamp


def run_suite(suite: Suite, out: str | os.PathLike[str], *, command: str = "",
              on_case: Callable[[int, int, Case], None] | None = None) -> BenchResult:
    """Run every case of ``suite``; write ``results.json``, ``report.md`` and plots to
    ``out``. ``on_case(i, n, case)`` is called before each case (for progress bars)."""
    from remat3d.bench.methods import check_model
    from remat3d.bench.plots import write_plots
    from remat3d.bench.report import write_report

    for name in {c.model for c in suite.cases()}:
        check_model(name, suite.model_kwargs.get(name))  # unknown names fail before work
    start = time.perf_counter()
    out_dir = Path(out)
    stamp = _stamp()
    records: list[Record] = []
    cases = suite.cases()
    for i, case in enumerate(cases):
        if on_case is not None:
            on_case(i, len(cases), case)
        kwargs = suite.model_kwargs.get(case.model, {})
        run = CaseRun(case, case_shape(case.model, case.size, kwargs), stamp, kwargs)
        try:
            if case.kind == "cpu":
                run_cpu_case(run, suite)
            else:
                run_meta_case(run, suite)
        except Exception as exc:  # one case failing is a result, not the end of the run
            log.warning("%s %s %s failed", case.model, case.size, case.kind, exc_info=True)
            run.add("none", status="error", note=f"case failed: {type(exc).__name__}: {exc}")
        records += run.records
        # after every case, so a long run can be followed and a crash loses one case
        write_results(out_dir / "results.json", records, suite=suite.name, command=command)
    seconds = time.perf_counter() - start
    write_results(out_dir / "results.json", records, suite=suite.name, command=command)
    files = [out_dir / "results.json"]
    files += write_plots(records, out_dir)
    files.append(write_report(records, out_dir, suite=suite.name, command=command,
                              seconds=seconds, plots=files[1:]))
    return BenchResult(records, files, seconds)

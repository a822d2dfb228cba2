"""CPU cases: real training steps at small sizes, fp32.

For each method a copy of one CPU model (same weights) gets the method installed; then

- *gradients*: one step from the same state and RNG, every parameter gradient and every
  buffer compared with the unplanned step's, bitwise (``torch.equal``);
- *memory*: the tracker's peak of that step on CPU (what the allocator sees at op
  boundaries: ``docs/tracker.md``);
- *time*: ``repeats`` rounds (more for short steps: at least ``suite.min_seconds`` of
  unplanned steps, at most ``suite.max_rounds``) after one warm-up round; each round runs
  every method once, in turn (interleaved, so a slow spell of a shared machine hits every
  method alike);
  ``step_time_ratio`` is the median over rounds of (method seconds / unplanned seconds).
  Each round starts one method later than the one before (allocator and cache state
  favour whichever runs after a given method, not a fixed one).

remat3d's ``optimal`` runs here without offload: on a CPU-only step "host memory" is the
same memory, so an offload plan has nothing to save or time.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat3d.bench.baselines import install_block_checkpoints, install_checkpoint_sequential
from remat3d.bench.compiled import budget_context, compiled_step
from remat3d.bench.meta_cases import CaseRun
from remat3d.bench.methods import plan_method, smallest_feasible
from remat3d.bench.suites import Suite
from remat3d.errors import BudgetError, Remat3dError
from remat3d.instrument.step import default_loss
from remat3d.measurement import measure
from remat3d.profiling import profile
from remat3d.runtime.apply import apply

__all__ = ["run_cpu_case"]

log = logging.getLogger(__name__)


@dataclass
class _Contender:
    method: str
    setting: str
    model: nn.Module
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    values: dict[str, Any] = field(default_factory=dict)
    seconds: list[float] = field(default_factory=list)


def _step(c: _Contender, x: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    for p in c.model.parameters():
        p.grad = None
    torch.manual_seed(1)
    with c.context():
        start = time.perf_counter()
        default_loss(c.model(x)).backward()
        seconds = time.perf_counter() - start
    grads = {n.replace("_orig_mod.", ""): p.grad for n, p in c.model.named_parameters()
             if p.grad is not None}
    return seconds, grads


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    # names without parametrization/compile prefixes, so wrapped copies compare
    return {n.replace("_orig_mod.", ""): b.detach().clone() for n, b in model.named_buffers()}


def _contenders(run: CaseRun, suite: Suite, reference: nn.Module) -> list[_Contender]:
    case, shape = run.case, run.shape
    out = [_Contender("none", "", copy.deepcopy(reference))]
    blocks = [n.name for n in profile(reference, shape, device="meta").graph.blocks()]
    torch_blocks = copy.deepcopy(reference)
    install_block_checkpoints(torch_blocks, blocks)
    out.append(_Contender("torch-blocks", f"{len(blocks)} blocks", torch_blocks))
    for k in suite.segments:
        seq = copy.deepcopy(reference)
        if install_checkpoint_sequential(seq, k):
            out.append(_Contender("checkpoint-sequential", f"segments={k}", seq))
    for b in suite.cpu_compile_budgets:
        start = time.perf_counter()
        try:
            compiled, step = compiled_step(copy.deepcopy(reference), shape, "cpu", None, b)
        except Exception as exc:  # noqa: BLE001 - a compile failure is a bench result
            run.add("compile", f"memory_budget={b}", status="error",
                    note=f"{type(exc).__name__}: {str(exc)[:300]}")
            continue
        out.append(_Contender("compile", f"memory_budget={b}", compiled,
                              functools.partial(budget_context, b),
                              {"plan_seconds": time.perf_counter() - start,
                               "note": "aot_eager", "peak_bytes": step.peak_bytes,
                               "saved_bytes": step.saved_bytes, "flops": step.flops}))
    plans: list[tuple[str, str, int, bool, float]] = [
        (s, "", 1 << 62, False, 0.0) for s in suite.strategies]
    for offload in (False,):  # offloading a CPU step copies host to host: nothing to time
        try:
            smallest, seconds = smallest_feasible(reference, shape, None, offload)
        except Remat3dError as exc:
            log.warning("%s: no smallest feasible budget: %s", case.model, exc)
            continue
        plans.append(("optimal", "smallest feasible", smallest, offload, seconds))
    for strategy, setting, budget, offload, extra in plans:
        try:
            planned = plan_method(reference, shape, None, strategy, budget, offload)
        except BudgetError as exc:
            run.add(f"remat3d:{strategy}", setting, status="infeasible", note=str(exc))
            continue
        net = apply(copy.deepcopy(reference), planned.plan)
        out.append(_Contender(
            f"remat3d:{strategy}" + ("+offload" if offload else ""), setting, net,
            values={"plan_seconds": planned.seconds + extra,
                    "budget_bytes": budget if strategy == "optimal" else None,
                    "note": f"{len(planned.plan.regions)} regions"}))
    return out


def _compare(run: CaseRun, contenders: list[_Contender], x: torch.Tensor) -> None:
    """Gradients and buffers of one step of each method against the unplanned one.

    A method whose step fails is recorded as an error (its message is the finding, e.g.
    an in-place op that breaks torch's checkpoint) and removed from the contenders.
    """
    _, base_grads = _step(contenders[0], x)
    base_buffers = _buffers(contenders[0].model)
    for c in list(contenders):
        start_buffers = _buffers(c.model)
        if c is not contenders[0]:
            try:
                _, grads = _step(c, x)
            except RuntimeError as exc:
                contenders.remove(c)
                run.add(c.method, c.setting, status="error",
                        note=f"the training step failed: {str(exc)[:300]}")
                continue
            c.values["grads_equal"] = _equal(grads, base_grads)
            c.values["buffers_equal"] = _equal(_buffers(c.model), base_buffers)
        else:
            c.values["grads_equal"] = c.values["buffers_equal"] = True
        with torch.no_grad():  # back to the common starting state
            for name, b in c.model.named_buffers():
                b.copy_(start_buffers[name.replace("_orig_mod.", "")])


def run_cpu_case(run: CaseRun, suite: Suite) -> None:
    shape = run.shape
    reference = run.build("cpu")
    torch.manual_seed(0)
    x = torch.randn(shape)
    contenders = _contenders(run, suite, reference)

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # bitwise comparison needs repeatable kernels
    try:
        _compare(run, contenders, x)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    for c in contenders:  # the tracker's peak of a real CPU step (compile: measured above)
        if c.method != "compile":
            m = measure(c.model, x, device="cpu")
            c.values.update(peak_bytes=m.peak_bytes, saved_bytes=m.saved_bytes, flops=m.flops)
    run.base_flops = contenders[0].values["flops"]

    n = len(contenders)
    rounds, r = suite.repeats, 0
    while r <= rounds:  # round 0 warms up
        for i in range(n):  # each round starts one method later: no method is always first
            c = contenders[(r + i) % n]
            seconds, _ = _step(c, x)
            if r:
                c.seconds.append(seconds)
            elif c is contenders[0]:  # short steps get more rounds (suite.min_seconds)
                wanted = math.ceil(suite.min_seconds / max(seconds, 1e-3))
                rounds = max(rounds, min(suite.max_rounds, wanted))
        r += 1
    for c in contenders:
        ratios = [s / b for s, b in zip(c.seconds, contenders[0].seconds)]
        run.add(c.method, c.setting, step_seconds=statistics.median(c.seconds),
                step_time_ratio=statistics.median(ratios), **c.values)

"""``remat3d.plan``: profile the step, search a plan, verify it on meta, cache it.

The search itself is pure (``planner/searching.py``, NOTE [ The budget is a promise ]): this
module profiles the step, builds the stage model, resolves the budget, and hands the
search a verifier that replays each candidate on a meta copy of the model under the
tracker, and the list of stages that can run tiled (``runtime/tiling/probe.py``).

NOTE [ Which plan optimal chooses ]
  1. ``optimal`` and ``auto`` plan the step's graph first (``graph=None``, the default)
     when the unplanned step does not fit (with the call's ``loss_fn``, if any: its step
     is measured, its targets counted): it decides per op, a parent's own ``cat``
     included, so where both reach a budget it recomputes a fraction of what a module
     plan does (``remat3d bench --suite blocks``: at per-block checkpointing's peak).
     ``offload`` allows host memory; it does not ask for it, so a graph plan that fits
     without it is taken.
  2. No graph plan fits (the greedy's smallest peak is above the budget): the module search
     runs with all it has (offload, rebuild, tiling), and the plan's notes say how low the
     graph went. Neither fits: the error names the lower of the two smallest peaks. A
     budget below the graph's recompute floor (``planner/liveness.py``, NOTE [ The
     recompute floor ], less ``_FLOOR_SLACK``) skips the graph search: the notes give the
     floor, and the search runs only for the error's smallest peak, if the modules fail.
     Below that floor no untiled module plan fits either (offload moves saved tensors,
     not what a backward op reads nor the gradients the floor counts; measured on the
     zoo, the smallest untiled plan with offload lies 6-89 % above it): their search is
     skipped too, and tiling tried at once. Only when tiling fails too are the untiled
     searches run, for the error's smallest peak, and only where the smallest tiling
     reached lies above the floor (below it they cannot lower it; nor, then, is the
     graph searched for the message). A later tiled search (the modules' after the
     spans') measures its layouts for the error only until they pass the smallest peak
     an earlier one verified (resenc-l 512³ bf16 at 1 GiB: 204 s -> 131 s).
     Before capturing, a weaker floor from the module profile alone (one convolution's
     backward: its input and its output's and input's gradients, NOTE [ The recompute
     floor ]) decides the same where it is over the budget, and the capture (seconds at
     512³) is made only if the error's message needs the graph's smallest peak.
  3. A step that cannot be traced as one graph (``CaptureError``) is planned by its modules;
     the reason is logged and in the plan's notes (``graph=True`` warns with it).
  4. ``graph=False`` is module plans only (what a hand-written plan, the trainer under
     FSDP2 and ``--plot`` need); ``graph=True`` is a graph plan or an error.
  5. ``compiled=True`` chooses the same way: a graph plan, searched and verified as for
     eager steps, whose graphs inductor compiles when it is applied (``Plan.graph_backend``,
     ``runtime/inductor.py``); below it module plans of recompute regions only (tiling and
     offload would break the compiled graph), so where neither fits the error names the
     lower smallest peak of the two.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat3d.capture.joint import Captured, capture
from remat3d.capture.mincut import partitioner_choices
from remat3d.decisions import Decision
from remat3d.errors import (
    BudgetError,
    CaptureError,
    InfeasibleBudgetError,
    PlanError,
    Remat3dError,
)
from remat3d.instrument.amp import amp_dtype
from remat3d.instrument.step import (
    example_input,
    input_dtype,
    meta_copy,
    rare_full_collections,
)
from remat3d.instrument.tracker import LimitExceeded, shared_repeats, stop_above
from remat3d.measurement import measure
from remat3d.opgraph import OpGraph
from remat3d.planner.graph_search import search_graph
from remat3d.planner.liveness import closed_recompute, convolution_floor, recompute_floor
from remat3d.planner.measured import Limits, Measured
from remat3d.planner.optimal import Costs
from remat3d.planner.registry import STRATEGIES, PlannerOptions
from remat3d.planner.searching import Problem, search, smallest_feasible_phrase
from remat3d.planner.stages import StageModel, build_stages
from remat3d.planspec import OBJECTIVES, GraphTiling, Plan
from remat3d.profiling import Profile, profile
from remat3d.runtime.apply import apply
from remat3d.runtime.fingerprint import model_fingerprint, model_signature
from remat3d.runtime.graph_run import GraphStep, measure_graph_plan
from remat3d.runtime.region import InPlaceInputError, op_by_op_checks
from remat3d.runtime.spans import spanned_copy, spans_for
from remat3d.units import format_bytes, format_shape, parse_bytes

__all__ = ["clear_plan_cache", "plan", "resolve_budget"]

_CACHE: OrderedDict[tuple, Plan] = OrderedDict()
_PROFILES: OrderedDict[tuple, Profile] = OrderedDict()  # the unplanned steps' (_profiled)
_CACHE_SIZE = 64
_PROFILES_SIZE = 8  # a profile holds its step's timeline (one event per op): fewer of them
_ROUNDS = 8
# a graph plan's measured peak is its simulated one within 3 % (NOTE [ Simulating the
# partitioned step ]); the recompute floor bounds the simulated one
_FLOOR_SLACK = 0.03
_UNCAPTURED: Any = object()  # below the convolution floor: the graph is captured if needed
logger = logging.getLogger(__name__)


def clear_plan_cache() -> None:
    _CACHE.clear()
    _PROFILES.clear()


def _profiled(model: nn.Module, examples: list[torch.Tensor], amp: str | None,
              loss_fn: Callable[[Any], torch.Tensor] | None) -> Profile:
    """The unplanned step's profile on meta, kept per model signature, inputs, amp and
    loss function like plans are (one model planned under several strategies or budgets
    is measured once); the caller gets its own copy."""
    key = _cache_key(model, examples, amp, _FunctionKey(loss_fn))
    if key not in _PROFILES:
        _PROFILES[key] = profile(model, *examples, device="meta", amp=amp, loss_fn=loss_fn)
        if len(_PROFILES) > _PROFILES_SIZE:
            _PROFILES.popitem(last=False)
    _PROFILES.move_to_end(key)
    return copy.deepcopy(_PROFILES[key])


def resolve_budget(budget: str | float, unplanned_peak: int,
                   device: str = "meta") -> int:
    """Bytes for ``"12GiB"``, ``"500MB"``, ``"0.25x"`` (of the unplanned peak), an int, or
    ``"auto"`` (free memory of the current CUDA device less 5 %)."""
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        if not torch.cuda.is_available():
            raise BudgetError(
                "Budget 'auto' means the free memory of the CUDA device, and there is no "
                "CUDA device here. Give a size ('12GiB') or a fraction ('0.25x')."
            )
        free, _total = torch.cuda.mem_get_info()
        return int(free * 0.95)
    if isinstance(budget, str) and budget.strip().lower().endswith("x"):
        try:
            fraction = float(budget.strip()[:-1])
        except ValueError:
            raise BudgetError(
                f"Cannot read budget {budget!r}: a fraction is written like '0.25x'."
            ) from None
        if not 0 < fraction < 1e6:  # (also: not nan, not inf)
            raise BudgetError(f"Budget fraction must be a positive number like '0.25x', "
                              f"got {budget!r}.")
        return int(unplanned_peak * fraction)
    if isinstance(budget, float):
        raise BudgetError(
            f"Budget {budget!r} is ambiguous: give bytes as an int, a size like '12GiB', or "
            "a fraction of the unplanned peak like '0.25x'."
        )
    return parse_bytes(budget)


def _verify(model: nn.Module, examples: list[torch.Tensor], plan_: Plan, amp: str | None,
            loss_fn: Callable[[Any], torch.Tensor] | None,
            within: Limits | None = None) -> Measured:
    """Replay the plan on a meta copy under the tracker (the search's verifier), every
    recomputation compared with its forward op by op: a region whose forward depends on
    more than its inputs fails here, named, instead of in training. ``within``: stop
    where the step passes those limits (NOTE [ Bounded measurements ])."""
    tiled = sum(r.decision == Decision.TILE for r in plan_.regions)
    logger.info("verifying a candidate plan on meta: %d regions%s", len(plan_.regions),
                f", {tiled} tiled" if tiled else "")
    copy_ = meta_copy(model)
    apply(copy_, plan_)
    limits = within or Limits()
    try:
        with op_by_op_checks(), stop_above(limits.peak_bytes, limits.flops):
            m = measure(copy_, *examples, device="meta", amp=amp, loss_fn=loss_fn)
    except LimitExceeded as stop:
        logger.info("stopped: %s (%s, %.3g FLOPs so far)", stop,
                    format_bytes(stop.peak_bytes), stop.flops)
        return Measured(stop.peak_bytes, 0, stop.flops, 0, stop.module, complete=False)
    return Measured(m.peak_bytes, m.recompute_flops, m.flops, m.host_bytes,
                    m.peak_modules[0] if m.peak_modules else None, m.tiled_peaks,
                    peak_phase=m.peak_phase)


@rare_full_collections()  # the search's meta steps make millions of objects
def plan(
    model: nn.Module,
    *inputs: Any,
    budget: str | int = "auto",
    strategy: str = "optimal",
    offload: bool = False,
    amp: str | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    verify: bool = True,
    tile: bool = True,
    host_budget: str | int | None = None,
    graph: bool | None = None,
    compiled: bool = False,
    objective: str = "time",
) -> Plan:
    """Plan checkpointing so one training step of ``model`` fits ``budget``.

    Args:
        inputs: example inputs or their shapes (only shapes and dtypes matter: the step is
            measured on the meta device).
        budget: ``"12GiB"``, ``"500MB"``, ``"0.25x"`` (of the unplanned peak), bytes, or
            ``"auto"`` (free CUDA memory less 5 %).
        strategy: a name from the registry (``remat3d.planner.registry.STRATEGIES``).
        offload: allow host memory: saved tensors moved there, and (when tiling) tiled
            outputs that only tiled stages read kept there (``runtime/tiling/host.py``).
        amp: ``None``, ``"bf16"`` or ``"fp16"`` — the precision the step will run in.
        tile: let ``optimal`` tile full-resolution stages when no plan of keep /
            recompute / offload decisions fits (``planner/tiling.py``; exact, but each
            normalisation in a tiled run costs extra passes). ``False``: such a budget is
            an error naming the smallest budget without tiling.
        host_budget: the most host memory the plan may use (``"32GiB"``, bytes; ``None``:
            no limit): offloaded saved tensors past it stay on the device (and count
            there when the plan is verified), and tiling layouts whose tiled outputs
            hold more of it on the host are passed over.
        graph: plan the step's aten graph instead of its modules (a *graph plan*: any
            op of forward, a parent's own ``cat`` included, may be recomputed in
            backward; ``docs/architecture.md``, Graph plans). ``None`` (the default):
            ``optimal`` and ``auto`` choose one by themselves (NOTE [ Which plan optimal
            chooses ]); ``True`` (or ``strategy="graph"``): a graph plan or an error;
            ``False``: module plans only. Graph plans recompute only, for now:
            ``offload`` and ``tile`` do not apply to them (``loss_fn`` does: its step is
            the one measured, its targets counted). Under
            ``amp`` the plan runs the forward under CUDA autocast's rules itself, on
            every device. A step that cannot be traced as one graph is planned by its
            modules (with ``graph=True`` a warning names why, and ``strategy="graph"``
            then means ``"optimal"``).
        compiled: the model will run compiled. ``optimal`` then plans the graph as for
            eager steps, and the plan's graphs are compiled by inductor when it is
            applied (``Plan.graph_backend == "inductor"``, ``runtime/inductor.py``: the
            forward saves what the plan keeps, inductor fuses what runs; a
            ``torch.compile`` around the model leaves the planned step to it, and a
            call without grad runs the model's own forward compiled). Where no graph
            plan fits, or with ``graph=False``: a module plan of recompute regions
            only (they compile as checkpoints, with no graph break; tiled and offload
            regions would each break the graph, so ``tile`` is off and ``offload``
            refused), searched and verified on meta without rebuilt saved tensors
            (``Plan.rebuild_saved``: saved-tensor hooks, which compiled graphs do not
            have; NOTE [ Plans under torch.compile ] rule 4). Either way the verified
            peak is the step run op by op; the compiled step's is measured (``python
            -m remat3d.bench.compile_check``), not verified. Planned without it, a
            compiled module plan can hold more than the verified peak (a warning says
            so while dynamo traces it).
        objective: what the plan minimises among those that fit (``Plan.objective``):
            ``"time"`` (the default) counts recomputed convolutions and matmuls in FLOPs
            and recomputed memory-bound ops (norms, activations, ``cat``) by their
            traffic at memory bandwidth, the time they take run unfused; ``"flops"``
            counts FLOPs only, as torch's ``FlopCounterMode`` and torch.compile's
            partitioner do (memory-bound recompute only breaks ties), for a plan that
            recomputes the fewest FLOPs even where many norms and activations are
            recomputed for it. It prices the graph search and the module planner's
            solver; module plans, once verified, are compared by FLOPs either way.

    Returns a :class:`Plan` with ``verified_peak_bytes`` and ``recompute_flops`` measured.
    Plans are cached by (model structure and settings, input shapes and dtypes, amp,
    budget, strategy, offload, tile, loss function (held weakly), host budget, verify, graph,
    compiled, objective, deterministic-algorithms mode): see
    :func:`remat3d.runtime.fingerprint.model_signature`.

    >>> import torch, remat3d
    >>> net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Conv3d(4, 4, 3, padding=1),
    ...                             torch.nn.GroupNorm(2, 4), torch.nn.Conv3d(4, 4, 1))
    ...                             for _ in range(4)])
    >>> p = remat3d.plan(net, (1, 4, 32, 32, 32), budget="0.6x")
    >>> p.verified_peak_bytes <= p.budget_bytes
    True
    """
    check_objective(objective)
    if strategy not in STRATEGIES and strategy not in ("auto", "graph"):
        raise PlanError(f"Unknown strategy {strategy!r}. Available: "
                        f"{', '.join(sorted([*STRATEGIES, 'auto', 'graph']))}.")
    if strategy == "auto":
        # ``optimal`` at the budget given (the default, "auto": the device's free memory);
        # one plan, cached once, that says it was asked for as ``auto``
        return dataclasses.replace(
            plan(model, *inputs, budget=budget, strategy="optimal", offload=offload, amp=amp,
                 loss_fn=loss_fn, verify=verify, tile=tile, host_budget=host_budget,
                 graph=graph, compiled=compiled, objective=objective), strategy="auto")
    explicit = graph is True or strategy == "graph"  # a graph plan or an error
    if explicit:
        _graph_options(offload=offload)
    if compiled:
        if offload:
            raise PlanError(
                "A plan for torch.compile (compiled=True, --compiled) does not offload: "
                "offload regions run eagerly, one graph break each. Leave out offload, or "
                "plan for eager steps.")
        tile = False  # tiled runs are Python loops: each would break the compiled graph
    chooses = explicit or (graph is None and strategy == "optimal")
    examples = _meta_examples(model, inputs)
    shapes = [tuple(x.shape) for x in examples]
    host_bytes = None if host_budget is None else parse_bytes(host_budget)
    key = _cache_key(model, examples, amp, budget, strategy, offload, tile,
                     _FunctionKey(loss_fn), host_bytes, verify, graph, compiled, objective)
    _forget_dead()
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return copy.deepcopy(_CACHE[key])  # the caller's own: editing it changes no cache

    logger.info("measuring the unplanned step on meta")
    prof = _profiled(model, examples, amp, loss_fn)
    budget_bytes = resolve_budget(budget, prof.peak_bytes)
    header = Plan(model=type(model).__name__, model_fingerprint=model_fingerprint(model),
                  input_shapes=[list(s) for s in shapes], amp=amp, budget_bytes=budget_bytes,
                  strategy=strategy, host_budget_bytes=host_bytes,
                  rebuild_saved=not compiled,
                  graph_backend="inductor" if compiled else "eager", objective=objective)

    fallback, graph_smallest, below_floor = None, None, None
    untiled_floor = 0  # NOTE rule 2: no plan without tiling peaks below it
    step_flops = prof.graph.forward_flops + prof.graph.backward_flops
    # an unplanned step that fits needs no graph (a module plan of nothing)
    conv = convolution_floor(prof.graph, amp, all(p.requires_grad for p in model.parameters()))
    if chooses and not explicit and conv.bytes * (1 - _FLOOR_SLACK) > budget_bytes:
        # NOTE rule 2, without capturing: one convolution's backward alone is over
        below_floor = _UNCAPTURED
        untiled_floor = int(conv.bytes * (1 - _FLOOR_SLACK))
        fallback = (f"no graph plan fits {format_bytes(budget_bytes)} (the backward of "
                    f"{conv.node} alone holds {format_bytes(conv.bytes)} with the "
                    "parameters: its input and its output's and input's gradients): a "
                    "module plan")
        logger.info("%s", fallback)
    elif chooses and (explicit or prof.peak_bytes > budget_bytes):
        logger.info("capturing the step's aten graph")
        try:
            captured = capture(model, *examples, amp=amp_dtype(header.amp))
            floor = recompute_floor(captured.graph)
            if not explicit and floor.bytes * (1 - _FLOOR_SLACK) > budget_bytes:
                # no recompute set can fit: the search and its measurement are skipped
                below_floor = captured
                untiled_floor = int(floor.bytes * (1 - _FLOOR_SLACK))
                fallback = (f"no graph plan fits {format_bytes(budget_bytes)} (every "
                            f"recompute set holds {format_bytes(floor.bytes)} or more, at "
                            f"{floor.node}): a module plan")
                logger.info("%s", fallback)
            else:
                logger.info("searching graph plans (%d ops)", len(captured.graph.nodes))
                chosen = _graph_plan(model, examples, header, captured, prof.peak_bytes,
                                     step_flops, strategy="graph" if explicit else strategy,
                                     loss_fn=loss_fn, tile=tile and explicit)
        except CaptureError as exc:  # one clear message, and the module plan instead
            fallback = f"{exc} Planned its modules instead (a module plan)."
            if explicit:
                warnings.warn(fallback, RuntimeWarning, stacklevel=2)
            else:
                logger.info("%s", fallback)
            if strategy == "graph":
                strategy = "optimal"
            header = dataclasses.replace(header, strategy=strategy)
        except InfeasibleBudgetError as exc:
            if explicit:
                raise
            graph_smallest = exc.smallest_feasible_bytes
            fallback = (f"no graph plan fits {format_bytes(budget_bytes)} (the smallest "
                        f"reaches {format_bytes(graph_smallest)}): a module plan")
        else:
            if below_floor is None:
                return _cached(key, chosen)
    # the modules as they are first, then with the parents' own ops between their
    # children as regions (runtime/spans.py: a span is coarser than its children, so it
    # is for the budgets they cannot reach); tiling only where no plan of keep /
    # recompute / offload decisions fits, the spans first (a tiled run may then span the
    # parent's own ops). Other strategies plan the spans where there are any (``blocks``:
    # a span is a block, as MONAI writes it).
    spans = spans_for(model, prof.graph)
    attempts = [_Attempt(model, examples, amp, loss_fn, prof, header, model)]
    if spans:
        spanned = _Attempt(model, examples, amp, loss_fn, None,
                           dataclasses.replace(header, spans=spans), None)
        attempts = [spanned] if strategy != "optimal" else [*attempts, spanned]
    # (structure, tiling allowed): the modules untiled; the spans, tiling where nothing
    # else fits; the modules, tiling likewise (their untiled candidates measured already)
    order = [(attempts[0], tile)]
    if len(attempts) == 2:
        order = [(attempts[0], False), (attempts[1], tile), *([(attempts[0], True)]
                                                              if tile else [])]
    failures: list[InfeasibleBudgetError] = []
    # NOTE rule 2: below the floor the untiled searches run last, only if tiling fails
    deferred = [(a, t) for a, t in order if t or below_floor is None] + \
        [(a, t) for a, t in order if not t and below_floor is not None]
    for attempt, tiled in deferred:
        # what an earlier module search verified (the graph's smallest stays the graph's:
        # the error names it as a graph plan's)
        known = min((e.smallest_feasible_bytes for e in failures), default=1 << 62)
        if not tiled and below_floor is not None and known <= untiled_floor:
            # NOTE rule 2: run for the error's smallest peak, which they cannot lower
            logger.info("module plans%s without tiling skipped: none peaks below %s",
                        " with spans" if attempt.header.spans else "",
                        format_bytes(untiled_floor))
            continue
        logger.info("searching module plans%s%s", " with spans" if attempt.header.spans else "",
                    ", tiling where nothing else fits" if tiled else "")
        try:
            chosen = attempt.search(budget_bytes, strategy, offload, verify, tiled,
                                    untiled_floor=untiled_floor, known_smallest=known)
            break
        except InfeasibleBudgetError as exc:
            failures.append(exc)
    else:
        lowest = min(failures, key=lambda e: e.smallest_feasible_bytes)
        if below_floor is not None and lowest.smallest_feasible_bytes > untiled_floor:
            # the graph's smallest, for the message only, where it may be the lower
            try:
                if below_floor is _UNCAPTURED:
                    logger.info("capturing the step's aten graph")
                    below_floor = capture(model, *examples, amp=amp_dtype(header.amp))
                _graph_plan(model, examples, header, below_floor, prof.peak_bytes,
                            step_flops, strategy=strategy, loss_fn=loss_fn)
            except InfeasibleBudgetError as exc:
                graph_smallest = exc.smallest_feasible_bytes
            except CaptureError as exc:
                logger.info("%s", exc)
        if graph_smallest is None or graph_smallest >= lowest.smallest_feasible_bytes:
            raise lowest
        # a graph plan goes lower than any module plan: the smallest feasible budget is
        # its (the module search's message named its own)
        modules = lowest.smallest_feasible_bytes
        said = smallest_feasible_phrase(modules)
        assert said in str(lowest), str(lowest)
        raise InfeasibleBudgetError(
            str(lowest).replace(said, f"{smallest_feasible_phrase(graph_smallest)}, a graph "
                                f"plan's (module plans reach {format_bytes(modules)})"),
            smallest_feasible_bytes=graph_smallest,
            unplanned_peak_bytes=lowest.unplanned_peak_bytes) from None
    if fallback is not None:
        chosen.notes.append(fallback)
    return _cached(key, chosen)


class _Attempt:
    """One structure the module search plans on (the model, or the model with its
    spans): copied with its spans and profiled when first searched (a budget the modules
    reach never makes the copy), its verifier's measurements kept, so the tiled phase
    does not verify again what the first phase did."""

    def __init__(self, model: nn.Module, examples: list[torch.Tensor], amp: str | None,
                 loss_fn: Callable[[Any], torch.Tensor] | None, prof: Any, header: Plan,
                 probed: nn.Module | None) -> None:
        self.model, self.examples, self.amp, self.loss_fn = model, examples, amp, loss_fn
        self.prof, self.header, self.probed = prof, header, probed
        self.measured: dict[str, Measured] = {}

    def search(self, budget: int, strategy: str, offload: bool, verify: bool,
               tiled: bool, untiled_floor: int = 0, known_smallest: int = 1 << 62) -> Plan:
        if self.probed is None:
            self.probed = spanned_copy(self.model, self.header.spans)
        if self.prof is None:
            self.prof = _profiled(self.probed, self.examples, self.amp, self.loss_fn)
        graph = self.prof.graph
        stages = build_stages(graph)
        verifier, tileable = _torch_side(self.model, self.examples, self.amp, self.loss_fn,
                                         stages, self.probed)

        # the candidates' tiled runs are mostly the same: their tiles are booked, not
        # run, from one candidate to the next (NOTE [ Repeats on meta ] rule 5)
        with shared_repeats():
            return search(Problem(
                stages=stages, graph=graph, budget=budget, strategy=strategy,
                options=PlannerOptions(offload=offload,
                                       costs=Costs(objective=self.header.objective),
                                       recomputable=_recomputable(stages)),
                header=self.header,
                step_flops=graph.forward_flops + graph.backward_flops,
                unplanned_peak=self.prof.peak_bytes, verify=verifier if verify else None,
                tileable=tileable if tiled else None,
                untiled_floor=untiled_floor if tiled else 0, known_smallest=known_smallest,
                measured=self.measured))


def _recomputable(stages: StageModel) -> list[bool] | None:
    """Which stages may be a recompute region of their own: not one whose module writes
    in place into a tensor it was called with (its recomputation would start from the
    overwritten values: ``InPlaceInputError``); None: every stage may."""
    ok = [not s.writes_input for s in stages.stages]
    return None if all(ok) else ok


def _cached(key: tuple, chosen: Plan) -> Plan:
    """Keep ``chosen`` for ``key``; the caller gets a copy (editing it changes no cache)."""
    _CACHE[key] = chosen
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return copy.deepcopy(chosen)


def check_objective(objective: str) -> None:
    """One clear error for an objective ``plan`` does not know."""
    if objective not in OBJECTIVES:
        raise PlanError(f"objective={objective!r} is not one of {', '.join(OBJECTIVES)}: "
                        "'time' (the default) or 'flops' (FLOPs only, as torch.compile's "
                        "partitioner counts them).")


def _graph_options(*, offload: bool) -> None:
    """Refuse, before any work, what graph plans do not take yet."""
    if offload:
        raise PlanError(
            "Graph plans do not take offload yet (they recompute); use a module plan for "
            "it (graph=False, or plan without --graph)."
        )


def _recomputed_modules(graph: OpGraph, recompute: list[str]) -> dict[str, str]:
    """``Plan.graph_modules``: the module of each recomputed node that has one, in the
    step's order (reports list them so)."""
    chosen = set(recompute)
    return {n.name: n.module for n in graph.forward
            if n.name in chosen and n.module is not None}


def _graph_plan(model: nn.Module, examples: list[torch.Tensor], header: Plan,
                captured: Captured, unplanned_peak: int, step_flops: int,
                strategy: str, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                tile: bool = False) -> Plan:
    """A graph plan (``graph=True``): the step captured as one aten graph, the search on
    its exact liveness (``planner/graph_search.py``), the choice measured under the
    tracker on fake tensors with ``loss_fn`` (default: remat3d's); a measured peak above
    the budget tightens the search's target by the excess (the loss outside the graph,
    and its targets, are not in the model), at most ``_ROUNDS`` times. Where none fits
    and ``tile``: a tiled graph plan (``_tiled_graph_plan``)."""
    graph = captured.graph
    budget = header.budget_bytes
    assert budget is not None
    target, smallest = budget, None
    for _ in range(_ROUNDS):
        # torch's min-cut's choices compete where the greedy fits (made when asked for)
        choice = search_graph(graph, target, Costs(objective=header.objective),
                              seeds=partitioner_choices(captured))
        measured = measure_graph_plan(model, tuple(examples), choice.recompute,
                                      amp=header.amp, twice=choice.twice,
                                      loss_fn=loss_fn).peak_bytes
        if smallest is None or measured < smallest:
            smallest = measured
        if measured <= budget:  # the measured peak is the promise, not the model's
            return dataclasses.replace(
                header, strategy=strategy, graph_recompute=choice.recompute,
                graph_twice=choice.twice, graph_digest=captured.digest,
                graph_modules=_recomputed_modules(graph, choice.recompute),
                predicted_peak_bytes=choice.liveness.peak_bytes,
                verified_peak_bytes=measured,
                recompute_flops=choice.liveness.recompute_flops,
                extra_flops=choice.liveness.recompute_flops, step_flops=step_flops,
                notes=[(f"graph plan: {choice.liveness.recompute_ops} ops of "
                       f"{len(graph.forward)} forward ops recomputed in backward"
                        + (", its graphs compiled by inductor when applied"
                           if header.graph_backend == "inductor" else ""))])
        if not choice.fits:
            break
        target -= measured - budget
    if tile:
        tiled, lowest = _tiled_graph_plan(model, examples, header, captured, step_flops,
                                          strategy, loss_fn)
        if tiled is not None:
            return tiled
        smallest = min(smallest or lowest, lowest)
    shapes = " ".join(format_shape(s) for s in header.input_shapes)
    raise InfeasibleBudgetError(
        f"Budget {format_bytes(budget)} is infeasible for a graph plan of {header.model} "
        f"{shapes}: the smallest peak reached is {format_bytes(smallest or 0)} "
        f"({smallest} bytes); the unplanned peak is {format_bytes(unplanned_peak)}. A "
        "module plan with offload (graph=False, offload=True) or tiling may go lower.",
        smallest_feasible_bytes=smallest or 0, unplanned_peak_bytes=unplanned_peak)


# NOTE [ Tiled graph plans ]
#   1. Where no recompute set fits, a graph plan may tile (``runtime/tiled_graph.py``):
#      every forward op is recomputed in backward, and the finest grids' ops run in tiled
#      regions. The tiling's layout (how many grids, copies across regions, the tile) is
#      tried from a short list, cheapest first: one grid without copies, then with, then
#      two grids with copies (each saves bytes and costs work), each at a quarter and an
#      eighth of the finest grid.
#   2. For a layout, the regions' stash policies are chosen per region: the step is
#      measured under each policy ("none" included), the tracker booking each region's
#      peak and FLOPs under its label; a region runs at one time, so its own peak under a
#      policy does not depend on the others' policies, and each region takes the policy
#      of fewest FLOPs whose peak there fits (a stash may lower a region's peak too: where
#      halos are wide, computing a tensor again per tile holds more than the stash). Where
#      some region fits under no policy, each takes its lowest (for the smallest feasible
#      budget). The mixture is measured again: the promise is that measurement.
#   3. The smallest peak measured is the infeasible budget's smallest feasible one.
_LAYOUTS = ((1, False), (1, True), (2, True))  # (levels, copy), cheapest first
_POLICIES = ("inputs", "sums")  # stash policies tried against "none", cheapest first


def _tiles(grid: Sequence[int], levels: int, parts: int) -> tuple[int, int, int]:
    """A tile of about ``1/parts`` of each axis of ``grid``, lined up with ``levels``
    grids and no smaller than 8 voxels."""
    step = 2 ** (levels - 1)
    return tuple(max(8, -(-max(n // parts, 1) // step) * step) for n in grid)  # type: ignore


def _tiled_graph_plan(model: nn.Module, examples: list[torch.Tensor], header: Plan,
                      captured: Captured, step_flops: int, strategy: str,
                      loss_fn: Callable[[Any], torch.Tensor] | None
                      ) -> tuple[Plan | None, int]:
    """The first tiled graph plan that fits (NOTE [ Tiled graph plans ]), or None, and the
    smallest peak measured."""
    graph = captured.graph
    budget = header.budget_bytes
    assert budget is not None
    recompute = sorted(closed_recompute(graph, [n.name for n in graph.forward]))
    grid = tuple(header.input_shapes[0][2:])
    smallest: int | None = None

    def measure(tiling: GraphTiling) -> GraphStep:
        nonlocal smallest
        logger.info("measuring a tiled graph plan: %s", tiling)
        step = measure_graph_plan(model, tuple(examples), recompute, amp=header.amp,
                                  loss_fn=loss_fn, tiling=tiling)
        smallest = step.peak_bytes if smallest is None else min(smallest, step.peak_bytes)
        return step

    for levels, copy_ in _LAYOUTS:
        tried: set[tuple[int, ...]] = set()
        for parts in (4, 8):
            tile = _tiles(grid, levels, parts)
            if tile in tried:
                continue
            tried.add(tile)
            steps = {policy: measure(GraphTiling(tile, levels, policy, copy_))
                     for policy in ("none", *_POLICIES)}
            chosen, lowest = {}, {}  # NOTE rule 2: per region
            for label in steps["none"].regions:
                options = {p: s.regions[label] for p, s in steps.items() if label in s.regions}
                lowest[label] = min(options, key=lambda p: options[p][0])
                fitting = [(flops, p) for p, (peak, flops) in options.items() if peak <= budget]
                if fitting:
                    chosen[label] = min(fitting)[1]
            mix = chosen if len(chosen) == len(lowest) else lowest
            best = GraphTiling(tile, levels, "none", copy_,
                               tuple((k, v) for k, v in mix.items() if v != "none"))
            same = set(mix.values()) or {"none"}
            step = steps[same.pop()] if len(same) == 1 else measure(best)
            if step.peak_bytes > budget:
                continue
            flops = sum(step.flops.values())
            stashed = sorted(set(dict(best.stashes).values())) or ["none"]
            note = (f"tiled graph plan: every forward op recomputed in backward, the "
                    f"{levels} finest grid(s) in tiles of {format_shape(best.tile)}"
                    f"{', copies across regions' if copy_ else ''}, stashing "
                    f"{' or '.join(stashed)} in {len(best.stashes)} of "
                    f"{len(step.regions)} regions")
            return dataclasses.replace(
                header, strategy=strategy, graph_recompute=recompute, graph_tiling=best,
                graph_digest=captured.digest,
                graph_modules=_recomputed_modules(graph, recompute),
                verified_peak_bytes=step.peak_bytes,
                recompute_flops=step.flops.get("recompute", 0),
                extra_flops=flops - step_flops, step_flops=step_flops,
                notes=[note]), step.peak_bytes
    return None, smallest or 0


def _torch_side(model: nn.Module, examples: list[torch.Tensor], amp: str | None,
                loss_fn: Callable[[Any], torch.Tensor] | None, stages: StageModel,
                probed: nn.Module
                ) -> tuple[Callable[[Plan], Measured], Callable[[], list[bool]]]:
    """What the pure search asks of torch: a verifier (each candidate replayed on a meta
    copy under the tracker) and which stages can run tiled (probed only when asked, on
    ``probed``: the model with its spans registered, where it has spans)."""
    def verifier(candidate: Plan, within: Limits | None = None) -> Measured:
        try:
            return _verify(model, examples, candidate, amp, loss_fn, within)
        except InPlaceInputError as exc:
            raise Remat3dError(f"Plan could not be verified: {exc}") from exc

    def tileable() -> list[bool]:
        from remat3d.runtime.tiling.probe import tileable as probe

        return probe(probed, examples, amp,
                     [(st.name, st.call_index) for st in stages.stages])

    return verifier, tileable


def _meta_examples(model: nn.Module, inputs: tuple) -> list[torch.Tensor]:
    """The example inputs as meta tensors without gradients, dtypes kept (a shape takes
    the model's: ``instrument.step.input_dtype``)."""
    dtype = input_dtype(model)
    return [example_input(x, "meta", dtype).detach() for x in inputs]


class _FunctionKey:
    """A loss function in a cache key without keeping it (or what it closes over: a
    trainer, its model and data) alive: equal while it lives, never again after."""

    def __init__(self, fn: Callable[..., Any] | None) -> None:
        self._none = fn is None
        self._ref: Callable[[], Any]
        try:
            self._ref = (weakref.WeakMethod(fn) if inspect.ismethod(fn)  # type: ignore[arg-type]
                         else weakref.ref(fn))  # type: ignore[arg-type]
        except TypeError:  # None, builtins: nothing that could pin a trainer
            self._ref = lambda: fn
        self._hash = hash((id(getattr(fn, "__func__", fn)), id(getattr(fn, "__self__", None))))

    @property
    def alive(self) -> bool:
        return self._none or self._ref() is not None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _FunctionKey) or other._hash != self._hash:
            return False
        if self._none or other._none:
            return self._none and other._none
        mine = self._ref()
        return mine is not None and mine == other._ref()


def _forget_dead() -> None:
    """Drop cached plans whose loss function is gone (they can never be asked for again)."""
    for cache in (_CACHE, _PROFILES):
        for key in [k for k in cache if any(isinstance(part, _FunctionKey) and not part.alive
                                             for part in k)]:
            del cache[key]


def _cache_key(model: nn.Module, examples: list[torch.Tensor], *settings: Any) -> tuple:
    """What a cached plan must have been made for: the model's signature, the inputs'
    shapes and dtypes, the call's settings (the loss function by identity, held weakly:
    a new function plans again), and the deterministic-algorithms switch (it changes which
    kernels, and temporaries, some ops use on meta)."""
    return (model_signature(model), tuple((tuple(x.shape), x.dtype) for x in examples),
            *settings, torch.are_deterministic_algorithms_enabled())

"""``remat3d.apply`` / ``remat3d.remove``: install a Plan on a live model, and undo it.

NOTE [ Installing a plan without changing the model ]
  1. A region's module gets an instance attribute ``forward`` that wraps the class's
     forward; ``nn.Module.__call__`` (and so every hook) is untouched, and nothing is added
     to the module tree, so ``state_dict()`` keys, ``named_parameters()`` and parameter
     identity stay as they were. A plan's spans (runtime/spans.py) are installed first,
     outside the tree too, and regions name them like modules. ``remove`` deletes the
     attribute (or puts back an instance ``forward`` the user had set).
     The model itself gets one too, holding the saved-tensor log of the forward (a
     ``with`` block: left even when the forward is interrupted).
  2. Calls are counted per module within one forward of the model, to pick the invocations
     a region names; a forward pre-hook on the model resets the counts. A recomputation
     replays the counts its region saw in forward, so nested regions pick the same calls.
  3. The plan's model fingerprint (module names, types, parameter shapes) must match, so a
     plan made for another model is refused instead of silently checkpointing nothing.
"""

from __future__ import annotations

import difflib
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat3d.decisions import Decision
from remat3d.instrument.state import is_recomputing, module_name, register_module_names
from remat3d.planspec import Plan, PlanError, Region
from remat3d.runtime.compiled import compiled_recompute, compiling, eager_region
from remat3d.runtime.fingerprint import model_fingerprint
from remat3d.runtime.graph_run import apply_graph_plan, graph_plan_of, remove_graph_plan
from remat3d.runtime.offload import HostUsage, OffloadHooks
from remat3d.runtime.rebuild import RebuildRecorder, Rebuilt
from remat3d.runtime.region import RegionStats, checkpoint_region
from remat3d.runtime.spans import install_spans, span_modules, uninstall_spans
from remat3d.units import format_bytes

__all__ = ["AppliedPlan", "applied_state", "apply", "is_applied", "remove"]

_STATE_ATTR = "_remat3d_applied"


@dataclass
class _SavedLog:
    """Tensors autograd saved outside every region during the last forward, by module."""

    by_module: dict[str, int] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)


@dataclass
class AppliedPlan:
    """What ``apply`` installed on a model (kept on the model until ``remove``)."""

    model: nn.Module
    plan: Plan
    stats: dict[str, RegionStats]
    host: HostUsage
    calls: dict[str, int] = field(default_factory=dict)
    saved: _SavedLog = field(default_factory=_SavedLog)
    originals: dict[str, Any] = field(default_factory=dict)  # module name -> instance forward
    handles: list[Any] = field(default_factory=list)
    group: int = 0
    prefetch: dict[int, list[Any]] = field(default_factory=dict)
    logger: Any = None  # the saved-tensor log active during the current forward
    # storage id -> weakref, of the parameters and buffers when the plan was applied (kept
    # whatever the step does; walking the module tree at every forward costs time)
    weights: dict[int, Any] = field(default_factory=dict)
    root_forward: Any = None  # the model's instance forward before apply (usually none)
    warned_compiled: bool = False  # _warn_rebuilt_when_compiled said it once


def applied_state(model: nn.Module) -> AppliedPlan | None:
    """The applied module plan's state (None: none, or a graph plan: ``is_applied``)."""
    return model.__dict__.get(_STATE_ATTR)


def is_applied(model: nn.Module) -> bool:
    """Whether a plan, of modules or of the step's graph, is applied to ``model``."""
    return applied_state(model) is not None or graph_plan_of(model) is not None


def apply(model: nn.Module, plan: Plan,
          compile_options: Mapping[str, Any] | None = None) -> nn.Module:
    """Install ``plan`` on ``model`` (in place) and return the same model object.

    ``compile_options`` (a plan made with ``compiled=True`` only): ``mode`` and
    ``options`` as ``torch.compile`` takes them, for the plan's graphs that inductor
    compiles (``runtime/inductor.py`` NOTE rule 5; CUDA graphs are refused).

    >>> import torch, remat3d
    >>> net = torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3), torch.nn.ReLU())
    >>> plan = remat3d.Plan(regions=[remat3d.Region("0")])
    >>> remat3d.apply(net, plan) is net
    True
    >>> list(net.state_dict()) == ["0.weight", "0.bias"]
    True
    >>> remat3d.remove(net)
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"apply() needs a remat3d.Plan, got {type(plan).__name__}.")
    if is_applied(model):
        raise PlanError(
            f"A plan is already applied to this {type(model).__name__}. Call "
            "remat3d.remove(model) before applying another."
        )
    fingerprint = model_fingerprint(model)
    if plan.model_fingerprint is not None and plan.model_fingerprint != fingerprint:
        raise PlanError(
            f"This plan was made for another model ({plan.model or 'unknown'}, fingerprint "
            f"{plan.model_fingerprint}); this {type(model).__name__} has fingerprint "
            f"{fingerprint}. Make a plan for this model (remat3d.plan(model, ...))."
        )
    if plan.graph_recompute is not None:  # runtime/graph_run.py
        return apply_graph_plan(model, plan.graph_recompute, plan.input_shapes or None,
                                amp=plan.amp, digest=plan.graph_digest,
                                twice=plan.graph_twice, backend=plan.graph_backend,
                                compile_options=compile_options, tiling=plan.graph_tiling)
    if compile_options:
        raise PlanError("compile_options are for a graph plan made with compiled=True "
                        "(remat3d compiles its graphs); this module plan runs under your "
                        "own torch.compile, with the options you give it there.")
    spans = install_spans(model, plan.spans) if plan.spans else {}  # runtime/spans.py
    try:
        modules = {**dict(model.named_modules()), **spans}
        by_module: dict[str, list[Region]] = {}
        for region in plan.regions:
            _check_region(region, modules)
            by_module.setdefault(region.module, []).append(region)
    except BaseException:
        uninstall_spans(model)
        raise

    state = AppliedPlan(
        model=model, plan=plan,
        stats={r.label: RegionStats(r.label, r.decision) for r in plan.regions},
        host=HostUsage(budget_bytes=plan.host_budget_bytes),
    )
    register_module_names(model, spans)
    for t in (*model.parameters(), *model.buffers()):
        storage = t.untyped_storage()
        state.weights[id(storage)] = weakref.ref(storage)
    for name, regions in by_module.items():
        module = modules[name]
        state.originals[name] = module.__dict__.get("forward")
        original = module.forward
        object.__setattr__(module, "forward", _PlannedForward(state, name, module, original,
                                                              regions))
    state.handles.append(model.register_forward_pre_hook(_start_step(state)))
    # the saved-tensor log wraps the model's forward in a ``with``: undone even when the
    # forward is interrupted (hooks with always_call=True do not run for KeyboardInterrupt)
    state.root_forward = model.__dict__.get("forward")
    object.__setattr__(model, "forward", _LoggedForward(state, model.forward))
    model.__dict__[_STATE_ATTR] = state
    return model


def remove(model: nn.Module) -> None:
    """Undo ``apply``: the model's forwards are exactly as they were before."""
    if graph_plan_of(model) is not None:
        remove_graph_plan(model)
        return
    state = applied_state(model)
    if state is None:
        raise PlanError("No remat3d plan is applied to this model; nothing to remove.")
    if state.root_forward is None:
        model.__dict__.pop("forward", None)
    else:
        object.__setattr__(model, "forward", state.root_forward)
    modules = {**dict(model.named_modules()), **span_modules(model)}
    for name, original in state.originals.items():
        module = modules[name]
        if original is None:
            module.__dict__.pop("forward", None)
        else:
            object.__setattr__(module, "forward", original)
    for handle in state.handles:
        handle.remove()
    uninstall_spans(model)  # after the regions: a parent's region wrapped its spanned forward
    del model.__dict__[_STATE_ATTR]


def _check_region(region: Region, modules: dict[str, nn.Module]) -> None:
    if region.module not in modules:
        close = difflib.get_close_matches(region.module, list(modules), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise PlanError(
            f"Plan region {region.label} names module '{region.module}', which this model "
            f"does not have.{hint}"
        )
    if region.segment:
        module = modules[region.module]
        if not isinstance(module, nn.Sequential):
            raise PlanError(
                f"Plan region {region.label}: a segment needs an nn.Sequential, but "
                f"'{region.module}' is a {type(module).__name__}. Make one region per child "
                "module instead."
            )
        names = list(module._modules)
        try:
            start = names.index(region.segment[0])
        except ValueError:
            start = -1
        if start < 0 or names[start:start + len(region.segment)] != list(region.segment):
            raise PlanError(
                f"Plan region {region.label}: {region.segment} is not a contiguous run of "
                f"the children of '{region.module}' ({', '.join(names)})."
            )


def _start_step(state: AppliedPlan) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        if is_recomputing():
            return
        state.calls.clear()
        state.group = 0
        state.prefetch.clear()
        for stats in state.stats.values():
            stats.reset()
        state.saved = _SavedLog()

    return hook


class _LogSaved(torch.autograd.graph.saved_tensors_hooks):
    """Note which module saves what outside regions (for ``report``); keeps the tensor,
    or the recipe that rebuilds it (runtime/rebuild.py)."""

    def __init__(self, state: AppliedPlan) -> None:
        self.state = state
        self.kept: dict[int, Any] = {}  # storage id -> weakref: saved by now
        self.recipes = (RebuildRecorder(self._is_kept, self._is_weight)
                        if state.plan.rebuild_saved
                        else None)
        super().__init__(self._pack, _unpack)

    def _keep(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        self.kept[id(storage)] = weakref.ref(storage)

    def _is_kept(self, storage_id: int) -> bool:
        ref = self.kept.get(storage_id)
        return (ref is not None and ref() is not None) or self._is_weight(storage_id)

    def _is_weight(self, storage_id: int) -> bool:
        ref = self.state.weights.get(storage_id)
        return ref is not None and ref() is not None

    def _pack(self, t: torch.Tensor) -> torch.Tensor | Rebuilt:
        rebuilt = self.recipes.rebuilt(t) if self.recipes is not None else None
        saved: torch.Tensor | Rebuilt = t if rebuilt is None else rebuilt
        stored = (t,) if rebuilt is None else tuple(rebuilt.leaves)
        log = self.state.saved
        for tensor in stored:
            key = id(tensor.untyped_storage())
            if not self._is_kept(key) and key not in log.seen:
                log.seen.add(key)
                name = _calling_module()
                log.by_module[name] = (log.by_module.get(name, 0)
                                       + tensor.untyped_storage().nbytes())
            self._keep(tensor)
        return saved

    def __enter__(self) -> Any:
        if self.recipes is not None:
            self.recipes.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.recipes is not None:
            self.recipes.__exit__(*exc)


_CALL = nn.Module._call_impl.__code__


def _calling_module() -> str:
    """The innermost module being called, from the Python stack: asked only when a tensor
    is saved outside the regions (module hooks would cost time at every module call)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CALL:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                return module_name(module)
        frame = frame.f_back
    return "(outside any module)"


def _unpack(saved: torch.Tensor | Rebuilt) -> torch.Tensor:
    return saved if isinstance(saved, torch.Tensor) else saved.unpack()


def _warn_rebuilt_when_compiled(state: AppliedPlan) -> None:
    """A verified plan counting rebuilt saved tensors, run compiled with grad (NOTE [ Plans
    under torch.compile ] rule 4): its promise does not hold there; say so once per
    applied plan (a warning is no graph break)."""
    plan = state.plan
    if not plan.rebuild_saved or plan.verified_peak_bytes is None or \
            state.warned_compiled or not torch.is_grad_enabled():
        return
    state.warned_compiled = True
    warnings.warn(
        f"This plan was verified at {format_bytes(plan.verified_peak_bytes)} with rebuilt "
        "saved tensors (Plan.rebuild_saved), which a compiled step does not have: under "
        "torch.compile it can hold more. Plan it for compilation (remat3d.plan(..., "
        "compiled=True), remat3d plan --compiled) to verify it as it runs compiled.",
        RuntimeWarning, stacklevel=2)


class _LoggedForward:
    """The model's forward with the saved-tensor log around it (one per forward with
    gradients, not in recomputations)."""

    def __init__(self, state: AppliedPlan, inner: Callable[..., Any]) -> None:
        self.state = state
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.state
        if compiling():  # NOTE [ Plans under torch.compile ] rule 4
            _warn_rebuilt_when_compiled(state)
            return self.inner(*args, **kwargs)
        if is_recomputing() or not torch.is_grad_enabled() or state.logger is not None:
            return self.inner(*args, **kwargs)
        state.logger = _LogSaved(state)
        try:
            with state.logger:
                return self.inner(*args, **kwargs)
        finally:
            state.logger = None


class _PlannedForward:
    """The ``forward`` installed on a region's module (see NOTE rules 1 and 2)."""

    def __init__(self, state: AppliedPlan, name: str, module: nn.Module,
                 original: Callable[..., Any], regions: list[Region]) -> None:
        self.state = state
        self.name = name
        self.module = module
        self.original = original
        self.whole = [r for r in regions if not r.segment]
        self.segments = [r for r in regions if r.segment]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        index = self.state.calls.get(self.name, 0)
        self.state.calls[self.name] = index + 1
        region = next((r for r in self.whole if r.calls is None or index in r.calls), None)
        segments = [r for r in self.segments if r.calls is None or index in r.calls]
        if region is not None:
            inner = self._sequential(segments) if segments else self.original
            return self._run(region, inner, args, kwargs)
        if segments:
            return self._sequential(segments)(*args, **kwargs)
        return self.original(*args, **kwargs)

    def _run(self, region: Region, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if compiling():  # NOTE [ Plans under torch.compile ] rules 2 and 3
            if region.decision == Decision.RECOMPUTE:
                self.state.stats[region.label].forward_runs += 1
                return compiled_recompute(region, fn, args, kwargs)
            return eager_region(self._run_eager, region.label)(region, fn, args, kwargs)
        return self._run_eager(region, fn, args, kwargs)

    def _run_eager(self, region: Region, fn: Callable[..., Any], args: tuple,
                   kwargs: dict) -> Any:
        state = self.state
        stats = state.stats[region.label]
        if region.decision == Decision.TILE:
            return self._tile(region, fn, args, kwargs)
        from remat3d.runtime.tiling.fused import materialize  # here: nn imports runtime modules

        args, kwargs = materialize((args, kwargs))
        if region.decision == Decision.RECOMPUTE:
            calls_at_start = dict(state.calls)

            def replay_calls() -> None:
                state.calls.clear()
                state.calls.update(calls_at_start)

            return checkpoint_region(fn, args, kwargs, policy=region.policy,
                               name=region.label, stats=stats, on_recompute=replay_calls,
                               offload_min_bytes=state.plan.offload_min_bytes)
        if not is_recomputing():
            stats.forward_runs += 1
        state.group += 1
        hooks = OffloadHooks(
            offload=region.decision == Decision.OFFLOAD,
            storage_dtype=_dtype(region.storage_dtype),
            min_bytes=state.plan.offload_min_bytes,
            usage=state.host, stats=None if is_recomputing() else stats,
            group=state.group, prefetch=state.prefetch, early=state.plan.prefetch,
        )
        with hooks:
            return fn(*args, **kwargs)

    def _tile(self, region: Region, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        from remat3d.instrument.step import model_device
        from remat3d.runtime.tiling import tile  # here: nn imports runtime modules
        from remat3d.runtime.tiling.fused import defer, fold
        from remat3d.runtime.tiling.tiled import labelled

        if kwargs:
            raise PlanError(f"Plan region {region.label} is tiled, but its module was called "
                            f"with keyword arguments ({', '.join(kwargs)}); a tiled region "
                            "takes its tensors positionally. Use decision 'recompute'.")
        if not is_recomputing():
            self.state.stats[region.label].forward_runs += 1
        size = region.tile or [1]
        edge = size[0] if len(size) == 1 else tuple(size)
        fn, inputs = fold(fn, args)  # fused producers run inside this region's tiles
        # where the run computes: the module's own device (its inputs may be in host memory)
        device = model_device(self.module)
        if region.fuse or region.host:
            return defer(fn, inputs, edge, region.label, host=region.host, device=device,
                         stash=region.stash, stash_norms=region.stash_norms)
        # a region's outputs are its module's internals: its tiled readers share their
        # gradients (NOTE [ Shared input gradients ] rule 4)
        with labelled(region.label):
            return tile(fn, *inputs, tile=edge, device=device, stash=region.stash,
                        stash_norms=region.stash_norms, share_grads=True,
                        rebuild=region.rebuild, hand_inputs=region.hand_inputs,
                        rebuild_in_tiles=region.rebuild_in_tiles)

    def _sequential(self, segments: list[Region]) -> Callable[..., Any]:
        """The Sequential's forward with its segment regions; segments may nest (a
        laminar family: nested or disjoint), outer regions running their inner ones."""
        children = [(n, m) for n, m in self.module._modules.items() if m is not None]
        names = [n for n, _ in children]
        spans = sorted(((names.index((r.segment or [""])[0]),
                         names.index((r.segment or [""])[0]) + len(r.segment or []), r)
                        for r in segments), key=lambda s: (s[0], -s[1]))
        for a, b, r in spans:
            for c, d, q in spans:
                if a < c < b < d:
                    raise PlanError(f"Plan regions {r.label} and {q.label} overlap without "
                                    "one containing the other; segments must nest.")

        def run(lo: int, hi: int, inner: list[tuple[int, int, Region]], x: Any) -> Any:
            i = lo
            while i < hi:
                here = [s for s in inner if s[0] == i]
                if not here:
                    x = children[i][1](x)
                    i += 1
                    continue
                start, stop, region = here[0]  # the outermost one starting here
                nested = [s for s in inner if s is not here[0] and start <= s[0]
                          and s[1] <= stop]

                def body(y: Any, start: int = start, stop: int = stop,
                         nested: list[tuple[int, int, Region]] = nested) -> Any:
                    return run(start, stop, nested, y)

                body.__qualname__ = "segment"
                x = self._run(region, body, (x,), {})
                i = stop
            return x

        def forward(x: Any) -> Any:
            return run(0, len(children), spans, x)

        return forward


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise PlanError(f"Unknown storage dtype {name!r}; use e.g. 'bfloat16' or 'float16'.")
    return dtype


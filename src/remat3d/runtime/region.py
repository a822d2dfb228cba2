"""``remat3d.checkpoint``: the recompute region, on ``torch.utils.checkpoint``.

Semantics are those of ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``
— keep the inputs, recompute the rest in backward (once per backward pass: backward twice
and double backward work), RNG replayed — plus the guards of ``guards.py``: running
statistics updated once, a recomputation that diverges named by op and module, kept
outputs protected from later in-place ops, and a clear error when ``fn`` writes in place
into its own inputs (recomputation would start from the overwritten values).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import noop_context_fn, set_checkpoint_debug_enabled

from remat3d.errors import InPlaceInputError, Remat3dError
from remat3d.instrument.amp import MetaAutocast, active_meta_autocast, ambient_autocast
from remat3d.instrument.ledger import unique_storage_bytes
from remat3d.instrument.state import enter_recompute, exit_recompute, is_recomputing
from remat3d.runtime.compat import (
    checkpoint_debug_enabled,
    checkpoint_early_stop,
    register_determinism_check,
)
from remat3d.runtime.compiled import compiled_checkpoint, compiling
from remat3d.runtime.guards import (
    BufferGuard,
    Diagnosis,
    ForwardSaves,
    ModuleStack,
    OpChecker,
    OpRecorder,
    RecomputeOverwritten,
    SavedMeta,
    diverged,
    saved_metadata,
)
from remat3d.runtime.policies import resolve_policy, selective_contexts

__all__ = ["InPlaceInputError", "RegionStats", "checkpoint", "checkpoint_region",
           "op_by_op_checks"]


@dataclass
class RegionStats:
    """What happened to one region during the current step (reset at each forward)."""

    label: str
    decision: str = "recompute"
    forward_runs: int = 0
    recomputes: int = 0
    input_bytes: int = 0  # kept alive for recomputation
    offloaded_bytes: int = 0
    kept_bytes: int = 0  # saved tensors left on the device by an offload region

    def reset(self) -> None:
        self.forward_runs = self.recomputes = 0
        self.input_bytes = self.offloaded_bytes = self.kept_bytes = 0


def _input_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments, as ``tree_leaves`` finds them; plain
    positional arguments (a region's usual call) without its cost, paid on every call."""
    if not kwargs and all(isinstance(a, torch.Tensor) or a is None
                          or isinstance(a, (int, float, bool, str)) for a in args):
        return [a for a in args if isinstance(a, torch.Tensor)]
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _owner_module(fn: Any) -> nn.Module | None:
    """The module whose subtree holds every module ``fn`` runs (guards.py NOTE rule 1), or
    None: the modules are found as they are called. A module with no children and no
    buffers of its own (a span of its parent's forward, ``runtime/spans.py``) calls modules
    it does not own, so it is no such owner."""
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(owner, nn.Module) or not (owner._modules or owner._buffers):
        return None
    return owner


class _Stack(contextlib.ExitStack):
    """Enter several context managers in order, as one."""

    def __init__(self, *managers: Any) -> None:
        super().__init__()
        self._managers = managers

    def __enter__(self) -> _Stack:
        super().__enter__()
        for manager in self._managers:
            self.enter_context(manager)
        return self


class _Region:
    """One call of ``checkpoint``: the function run twice and the contexts around it."""

    def __init__(self, fn: Callable[..., Any], label: str, policy: Any, check: str,
                 stats: RegionStats | None, on_recompute: Callable[[], Any] | None,
                 early_stop: bool, context_fn: Callable[[], tuple[Any, Any]] | None) -> None:
        self.fn = fn
        self.label = label
        self.policy_fn = resolve_policy(policy)
        self.check = check
        self.stats = stats
        self.on_recompute = on_recompute
        self.owner = _owner_module(fn)
        self.early_stop = early_stop
        self.context_fn = context_fn
        self.saves = ForwardSaves(self._mismatch) if check != "none" else None
        self.recorder: OpRecorder | None = None
        self.caching: Any = None  # the selective-checkpoint modes (with a policy)
        self.cached: Any = None
        self.meta_amp = active_meta_autocast()
        # the recomputation's inputs (held weakly: torch frees them when the recomputation
        # and its check are done, and rebuilt inputs must not outlive that) and autocast
        # state: for a diagnosis run (NOTE rule 2 of guards.py)
        self.recompute_inputs: tuple[list[Any], Any] | None = None
        self.recompute_autocast: list[tuple[str, torch.dtype]] = []
        self.recomputing = False

    # torch.utils.checkpoint calls this once in forward and again for each recomputation
    def run(self, *args: Any, **kwargs: Any) -> Any:
        if self.recomputing:
            leaves, spec = tree_flatten((args, kwargs))
            self.recompute_inputs = ([weakref.ref(v) if isinstance(v, torch.Tensor)
                                      else (lambda v=v: v) for v in leaves], spec)
        # (inference tensors have no version counter, and nothing is saved for a backward
        # under inference mode: no recomputation to protect)
        inputs = [t for t in _input_tensors(args, kwargs) if not t.is_inference()]
        versions = [t._version for t in inputs]
        out = self.fn(*args, **kwargs)
        for t, version in zip(inputs, versions):
            if t._version != version:
                raise InPlaceInputError(
                    f"Region '{self.label}' writes in place into its own input "
                    f"(a {tuple(t.shape)} tensor), so its recomputation would start from "
                    "the overwritten values. Put the op that produced this input in the "
                    "same region (checkpoint the enclosing block), or make the in-place "
                    "op out-of-place (e.g. inplace=False)."
                )
        return out

    def contexts(self) -> tuple[Any, Any]:
        """The forward's contexts and the recomputation's (made afresh for each one)."""
        user_forward, user_recompute = (self.context_fn() if self.context_fn is not None
                                        else (None, None))
        forward: list[Any] = [] if self.saves is None else [self.saves]
        if self.policy_fn is not None:
            self.caching, self.cached = selective_contexts(self.policy_fn)
            forward.append(self.caching)
        if self.check == "ops":
            modules = ModuleStack()
            self.recorder = OpRecorder(modules)
            forward += [modules, self.recorder]
        if user_forward is not None:
            forward.append(user_forward)
        # one context (the usual: the saves' count) is entered as itself: every region call
        # pays for a stack
        return (forward[0] if len(forward) == 1 else _Stack(*forward),
                _Recomputation(self, user_recompute))

    def _guards(self, modules: ModuleStack | None, count: bool) -> list[Any]:
        """What makes a run of the function a recomputation (guards.py rule 1). Module
        hooks (``modules``) are needed to name modules, and for a region on a plain
        function to find the modules whose buffers to restore."""
        if modules is None and self.owner is None:
            modules = ModuleStack()
        guards: list[Any] = [_RecomputeFlag(self, count),
                             *([] if modules is None else [modules]),
                             BufferGuard(modules, self.owner)]
        # torch.utils.checkpoint restores torch.autocast for the recomputation; our
        # meta-device autocast (a function mode) must be restored the same way.
        if self.meta_amp is not None:
            guards.insert(0, MetaAutocast(self.meta_amp.dtype))
        return guards

    def _mismatch(self, index: int, forward: tuple, recomputed: tuple) -> Exception:
        """A recomputed saved tensor's metadata differs from the forward's (torch found it)."""
        diagnosis = self._rerun()
        before, after = SavedMeta(forward, None, -1), SavedMeta(recomputed, None, -1)
        return diverged(
            self.label, f"at saved tensor #{index}: the forward saved a {before} there, the "
            f"recomputation a {after} (run once more, it was {diagnosis.describe(index)})",
            self._hint())

    def stopped_short(self, checker: OpChecker | None) -> Exception:
        """The recomputation ran to its end: it saved fewer tensors than the forward."""
        if checker is not None:
            return checker.stopped_early()
        diagnosis = self._rerun()
        count = self.saves.count if self.saves is not None else 0
        last = len(diagnosis.saves) - 1
        return diverged(
            self.label, f": the forward saved {count} tensors for backward, the "
            f"recomputation fewer (run once more it saved {last + 1}, the last "
            f"{diagnosis.describe(last)})", self._hint())

    def _hint(self) -> str:
        return ("" if self.check == "ops" else
                " To compare both runs op by op, pass determinism_check='ops'.")

    def _rerun(self) -> Diagnosis:
        """The function once more, recording what it runs and saves (guards.py NOTE rule 2)."""
        diagnosis = Diagnosis()
        if self.recompute_inputs is None:
            return diagnosis
        refs, spec = self.recompute_inputs
        leaves = [ref() for ref in refs]
        if any(ref() is None and isinstance(ref, weakref.ref) for ref in refs):
            return diagnosis  # freed already: nothing to run again
        args, kwargs = tree_unflatten(leaves, spec)
        amp = [torch.autocast(device, dtype=dtype) for device, dtype in self.recompute_autocast]
        # what ran up to an error is the diagnosis: suppressed, innermost
        with _Stack(torch.random.fork_rng(devices=[]), torch.enable_grad(), *amp,
                    *self._guards(diagnosis.modules, count=False),
                    torch.autograd.graph.saved_tensors_hooks(diagnosis.pack, _same),
                    diagnosis.recorder, contextlib.suppress(Exception)):
            self.fn(*args, **kwargs)
        return diagnosis


def _same(t: Any) -> Any:
    return t


class _Recomputation:
    """The contexts of one recomputation, entered afresh each time backward needs one
    (backward twice, double backward): the guards, the op checker from op #0."""

    def __init__(self, region: _Region, user: Any) -> None:
        self.region = region
        self.user = user
        self.stack: _Stack | None = None
        self.checker: OpChecker | None = None

    def __enter__(self) -> _Recomputation:
        region = self.region
        modules = ModuleStack() if region.recorder is not None else None
        managers = region._guards(modules, count=True)
        if region.cached is not None:
            managers += [RecomputeOverwritten(region.caching, region.label), region.cached]
        self.checker = None
        if region.recorder is not None:
            assert modules is not None
            self.checker = OpChecker(region.recorder, modules, region.label)
            managers.append(self.checker)
        if self.user is not None:
            managers.append(self.user)
        region.recompute_autocast = ambient_autocast()
        region.recomputing = True
        self.stack = _Stack(*managers)
        try:
            self.stack.__enter__()
        except BaseException:
            region.recomputing = False
            raise
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        region = self.region
        region.recomputing = False
        assert self.stack is not None
        suppressed = bool(self.stack.__exit__(typ, exc, tb))
        self.stack = None
        # torch stops a recomputation once it has saved all the forward saved; one that
        # ran to its end saved fewer (guards.py NOTE rule 2)
        if (typ is None and region.early_stop and region.saves is not None
                and region.saves.count > 0):
            raise region.stopped_short(self.checker)
        return suppressed


class _RecomputeFlag:
    def __init__(self, region: _Region, count: bool) -> None:
        self.region = region
        self.count = count

    def __enter__(self) -> None:
        enter_recompute()
        if self.count and self.region.stats is not None:
            self.region.stats.recomputes += 1
        if self.region.on_recompute is not None:
            self.region.on_recompute()

    def __exit__(self, *exc: object) -> None:
        exit_recompute()


_CHECKS = ("default", "ops", "none")
_TORCH_CHECK = "remat3d"  # our metadata function in torch's determinism-check table
_op_by_op = contextvars.ContextVar("remat3d_op_by_op_checks", default=False)


@contextlib.contextmanager
def op_by_op_checks() -> Iterator[None]:
    """Regions made inside compare their recomputations op by op (``determinism_check=
    "ops"``) unless they turn checking off: how plans are verified."""
    token = _op_by_op.set(True)
    try:
        yield
    finally:
        _op_by_op.reset(token)


def _check_mode(value: Any, debug: bool) -> str:
    if value is True or value is False:
        value = "default" if value else "none"
    if value not in _CHECKS:
        raise Remat3dError(
            f"determinism_check={value!r} is not a check remat3d knows. Use 'default' "
            "(saved tensors' shapes, dtypes and devices, as torch.utils.checkpoint), "
            "'ops' (every op compared) or 'none'."
        )
    if value == "default" and (debug or checkpoint_debug_enabled() or _op_by_op.get()):
        return "ops"
    return str(value)


def _torch_check(check: str) -> str:
    if check == "none":
        return "none"
    return _TORCH_CHECK if _registered() else "default"


@functools.cache
def _registered() -> bool:
    """remat3d's metadata function is in torch's determinism-check table (once)."""
    return register_determinism_check(_TORCH_CHECK, saved_metadata)


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    policy: str | list[str] | Callable[..., Any] | None = None,
    offload: bool = False,
    determinism_check: str | bool = "default",
    name: str | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    debug: bool = False,
    early_stop: bool = True,
    use_reentrant: bool | None = None,
    fn_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` as a recompute region.

    The semantics, and the options shared with it, are those of
    ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``: backward twice
    (``retain_graph``), double backward, nested regions and regions that run
    ``torch.autograd.grad`` themselves work as there.

    Args:
        fn: a module or function; it must compute the same thing from the same inputs.
        policy: op-level policy (see ``policies.py``): ``None``/``"recompute-all"``,
            ``"save-compute-heavy"``, ``"save-norm-and-pool"``, a list of aten op names to
            keep, or a ``policy_fn(ctx, func, *args, **kwargs)``.
        offload: keep the region's inputs in host memory instead of on the device (they
            are copied back when the recomputation starts); tensors under 1 MiB stay.
        determinism_check: ``"default"``: the recomputation must save tensors of the same
            shapes, dtypes and devices as the forward (torch's check, no cost per op); if
            not, the function is run once more to name the op and module at fault.
            ``"ops"``: the forward's ops are recorded and the recomputation compared op by
            op (names the op and module in both runs; costs time per op). ``"none"``.
        name: how errors and reports call the region.
        preserve_rng_state: replay the forward's RNG state in the recomputation (dropout).
        context_fn: torch's: a function returning a forward and a recomputation context
            (e.g. ``create_selective_checkpoint_contexts``); not together with ``policy``.
        debug: torch's: here it means ``determinism_check="ops"`` (as does
            ``torch.utils.checkpoint.set_checkpoint_debug_enabled(True)``).
        early_stop: torch's: stop a recomputation once it rebuilt what backward needs.
        use_reentrant: accepted as ``False`` (or ``None``) only: remat3d's regions are
            torch's non-reentrant checkpoint.
        fn_kwargs: keyword arguments for ``fn`` whose names are also this function's
            (``policy``, ``offload``, ``name``, ...); the others may be given directly.

    >>> import torch, remat3d
    >>> block = torch.nn.Sequential(torch.nn.Conv3d(1, 2, 3), torch.nn.BatchNorm3d(2))
    >>> x = torch.randn(2, 1, 8, 8, 8, requires_grad=True)
    >>> y = remat3d.checkpoint(block, x)
    >>> y.sum().backward()   # block ran again here; its running statistics did not change
    >>> int(block[1].num_batches_tracked)
    1
    """
    if use_reentrant:
        raise Remat3dError(
            "remat3d.checkpoint is torch's non-reentrant checkpoint (use_reentrant=False); "
            "use_reentrant=True is not offered. Drop the argument."
        )
    if fn_kwargs:
        both = sorted(set(fn_kwargs) & set(kwargs))
        if both:
            raise Remat3dError(f"Keyword {both[0]!r} is given both directly and in "
                               "fn_kwargs; give it once.")
        kwargs = {**kwargs, **fn_kwargs}
    if compiling():  # NOTE [ Plans under torch.compile ] rule 5
        if not offload:
            return compiled_checkpoint(fn, args, kwargs, policy=policy,
                                       context_fn=context_fn,
                                       preserve_rng_state=preserve_rng_state)
        return torch.compiler.disable(checkpoint_region)(
            fn, args, kwargs, policy=policy, offload=offload,
            determinism_check=determinism_check, name=name,
            preserve_rng_state=preserve_rng_state, context_fn=context_fn, debug=debug,
            early_stop=early_stop)
    return checkpoint_region(fn, args, kwargs, policy=policy, offload=offload,
                             determinism_check=determinism_check, name=name,
                             preserve_rng_state=preserve_rng_state, context_fn=context_fn,
                             debug=debug, early_stop=early_stop)


def checkpoint_region(fn: Callable[..., Any], args: tuple, kwargs: dict, *,
                      policy: Any = None, offload: bool = False,
                      determinism_check: str | bool = "default", name: str | None = None,
                      stats: RegionStats | None = None,
                      on_recompute: Callable[[], Any] | None = None,
                      offload_min_bytes: int = 1 << 20, preserve_rng_state: bool = True,
                      context_fn: Callable[[], tuple[Any, Any]] | None = None,
                      debug: bool = False, early_stop: bool = True) -> Any:
    label = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    if context_fn is noop_context_fn:
        context_fn = None
    if context_fn is not None and policy is not None:
        raise Remat3dError(
            f"Region '{label}' is given both an op policy and a context_fn; both choose "
            "what to keep. Pass one (a policy_fn can be given as policy=)."
        )
    check = _check_mode(determinism_check, debug)
    region = _Region(fn, label, policy, check, stats, on_recompute,
                     checkpoint_early_stop(early_stop), context_fn)
    tensors = _input_tensors(args, kwargs)
    if offload:
        args, kwargs, region.fn = _offload_inputs(fn, args, kwargs, label, offload_min_bytes,
                                                  stats)
    if stats is not None and not is_recomputing():
        stats.forward_runs += 1
        stats.input_bytes += unique_storage_bytes(tensors)
    # torch's debug mode brings its own context_fn, which cannot be combined with ours;
    # remat3d's "ops" check (chosen above) is its equivalent
    debug_off = (set_checkpoint_debug_enabled(None) if checkpoint_debug_enabled() is not None
                 else contextlib.nullcontext())
    with debug_off:
        return torch_checkpoint(
            region.run, *args, use_reentrant=False, context_fn=region.contexts,
            preserve_rng_state=preserve_rng_state, determinism_check=_torch_check(check),
            early_stop=early_stop, **kwargs,
        )


def _offload_inputs(fn: Callable[..., Any], args: tuple, kwargs: dict, label: str,
                    min_bytes: int, stats: RegionStats | None) -> tuple[Any, Any, Any]:
    """Hand the checkpoint host copies of the inputs; the region copies them back.

    Both copies are ordinary autograd ops, so gradients flow through them unchanged, and
    the copy back to the device is part of the recomputation.
    """
    leaves, spec = tree_flatten((args, kwargs))
    devices: dict[int, torch.device] = {}
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or isinstance(leaf, nn.Parameter):
            continue
        if leaf.untyped_storage().nbytes() < min_bytes:
            continue
        if leaf.device.type == "meta":
            raise Remat3dError(
                f"Region '{label}': offloading a recompute region's inputs needs real "
                "tensors (meta tensors have no data to copy). Plan offload on meta with "
                "decision 'offload' regions, or run this step on cpu/cuda."
            )
        devices[i] = leaf.device
        leaves[i] = leaf.to("cpu", copy=True)
        if stats is not None and not is_recomputing():
            stats.offloaded_bytes += leaf.untyped_storage().nbytes()
    host_args, host_kwargs = tree_unflatten(leaves, spec)

    def run_on_device(*a: Any, **k: Any) -> Any:
        flat, flat_spec = tree_flatten((a, k))
        for i, device in devices.items():
            flat[i] = flat[i].to(device)
        dev_args, dev_kwargs = tree_unflatten(flat, flat_spec)
        return fn(*dev_args, **dev_kwargs)

    return host_args, host_kwargs, run_on_device

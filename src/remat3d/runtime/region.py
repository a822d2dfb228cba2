"""``remat3d.checkpoint``: the recompute region, on ``torch.utils.checkpoint``.

Semantics are those of ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``
— keep the inputs, recompute the rest in backward, RNG replayed — plus the guards of
``guards.py``: running statistics updated once, a recomputation that diverges named op by
op, kept outputs protected from later in-place ops, and a clear error when ``fn`` writes
in place into its own inputs (recomputation would start from the overwritten values).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from remat3d.errors import InPlaceInputError, Remat3dError
from remat3d.instrument.amp import MetaAutocast, active_meta_autocast
from remat3d.instrument.ledger import unique_storage_bytes
from remat3d.instrument.state import enter_recompute, exit_recompute, is_recomputing
from remat3d.runtime.guards import (
    BufferGuard,
    ModuleStack,
    OpChecker,
    OpRecorder,
    RecomputeOverwritten,
)
from remat3d.runtime.policies import resolve_policy, selective_contexts

__all__ = ["InPlaceInputError", "RegionStats", "checkpoint", "checkpoint_region"]


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


def _owner_module(fn: Any) -> nn.Module | None:
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


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

    def __init__(self, fn: Callable[..., Any], label: str, policy: Any,
                 determinism_check: bool, stats: RegionStats | None,
                 on_recompute: Callable[[], Any] | None) -> None:
        self.fn = fn
        self.label = label
        self.policy_fn = resolve_policy(policy)
        self.determinism_check = determinism_check
        self.stats = stats
        self.on_recompute = on_recompute
        self.owner = _owner_module(fn)
        self.recorder: OpRecorder | None = None

    # torch.utils.checkpoint calls this once in forward and again for each recomputation
    def run(self, *args: Any, **kwargs: Any) -> Any:
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
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
        forward_modules, recompute_modules = ModuleStack(), ModuleStack()
        forward: list[Any] = [forward_modules]
        recompute: list[Any] = [_RecomputeFlag(self), recompute_modules,
                                BufferGuard(recompute_modules, self.owner)]
        # torch.utils.checkpoint restores torch.autocast for the recomputation; our
        # meta-device autocast (a function mode) must be restored the same way.
        meta_amp = active_meta_autocast()
        if meta_amp is not None:
            recompute.insert(0, MetaAutocast(meta_amp.dtype))
        if self.policy_fn is not None:
            caching, cached = selective_contexts(self.policy_fn)
            forward.append(caching)
            recompute += [RecomputeOverwritten(caching, self.label), cached]
        if self.determinism_check:
            self.recorder = OpRecorder(forward_modules)
            forward.append(self.recorder)
            recompute.append(OpChecker(self.recorder, recompute_modules, self.label))
        return _Stack(*forward), _Stack(*recompute)


class _RecomputeFlag:
    def __init__(self, region: _Region) -> None:
        self.region = region

    def __enter__(self) -> None:
        enter_recompute()
        if self.region.stats is not None:
            self.region.stats.recomputes += 1
        if self.region.on_recompute is not None:
            self.region.on_recompute()

    def __exit__(self, *exc: object) -> None:
        exit_recompute()


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    policy: str | list[str] | Callable[..., Any] | None = None,
    offload: bool = False,
    determinism_check: bool = True,
    name: str | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` as a recompute region.

    Args:
        fn: a module or function; it must compute the same thing from the same inputs.
        policy: op-level policy (see ``policies.py``): ``None``/``"recompute-all"``,
            ``"save-compute-heavy"``, ``"save-norm-and-pool"``, a list of aten op names to
            keep, or a ``policy_fn(ctx, func, *args, **kwargs)``.
        offload: keep the region's inputs in host memory instead of on the device (they
            are copied back when the recomputation starts); tensors under 1 MiB stay.
        determinism_check: compare the recomputation with the forward op by op.
        name: how errors and reports call the region.

    >>> import torch, remat3d
    >>> block = torch.nn.Sequential(torch.nn.Conv3d(1, 2, 3), torch.nn.BatchNorm3d(2))
    >>> x = torch.randn(2, 1, 8, 8, 8, requires_grad=True)
    >>> y = remat3d.checkpoint(block, x)
    >>> y.sum().backward()   # block ran again here; its running statistics did not change
    >>> int(block[1].num_batches_tracked)
    1
    """
    return checkpoint_region(fn, args, kwargs, policy=policy, offload=offload,
                       determinism_check=determinism_check, name=name)


def checkpoint_region(fn: Callable[..., Any], args: tuple, kwargs: dict, *,
                      policy: Any = None, offload: bool = False,
                      determinism_check: bool = True, name: str | None = None,
                      stats: RegionStats | None = None,
                      on_recompute: Callable[[], Any] | None = None,
                      offload_min_bytes: int = 1 << 20) -> Any:
    label = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    region = _Region(fn, label, policy, determinism_check, stats, on_recompute)
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if offload:
        args, kwargs, region.fn = _offload_inputs(fn, args, kwargs, label, offload_min_bytes,
                                                  stats)
    if stats is not None and not is_recomputing():
        stats.forward_runs += 1
        stats.input_bytes += unique_storage_bytes(tensors)
    return torch_checkpoint(
        region.run, *args, use_reentrant=False, context_fn=region.contexts,
        preserve_rng_state=True, determinism_check="default", **kwargs,
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

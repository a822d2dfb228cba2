"""Op-level policies inside a recompute region (selective activation checkpointing).

A policy decides, op by op, whether the output is kept from the forward or recomputed in
backward. It is built on PyTorch's ``create_selective_checkpoint_contexts``.

- ``"recompute-all"``: keep nothing but the region's inputs (plain checkpointing).
- ``"save-compute-heavy"``: keep convolution, matmul and attention outputs; recompute
  pointwise ops and norms (cheap to redo, as large as the conv outputs they follow).
- ``"save-norm-and-pool"``: the inverse: keep normalisation and pooling outputs;
  recompute convolutions, matmuls and pointwise ops.
- a list of op names (``["convolution", "native_batch_norm"]``) or ``OpOverloadPacket``s:
  keep exactly those.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from remat3d.errors import Remat3dError

__all__ = [
    "COMPUTE_HEAVY_OPS",
    "NORM_AND_POOL_OPS",
    "POLICY_NAMES",
    "resolve_policy",
    "selective_contexts",
]

aten = torch.ops.aten


def _packets(*names: str) -> frozenset[Any]:
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


COMPUTE_HEAVY_OPS = _packets(
    "convolution", "_convolution", "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
)
NORM_AND_POOL_OPS = _packets(
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "cudnn_batch_norm", "miopen_batch_norm", "native_group_norm", "native_layer_norm",
    "max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices",
    "avg_pool1d", "avg_pool2d", "avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d",
    "adaptive_max_pool2d", "adaptive_max_pool3d",
)
POLICY_NAMES = ("recompute-all", "save-compute-heavy", "save-norm-and-pool")

PolicyFn = Callable[..., CheckpointPolicy]


def _keep(ops: frozenset[Any]) -> PolicyFn:
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func.overloadpacket in ops:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    policy.kept_ops = ops  # type: ignore[attr-defined]
    return policy


def _op_packet(name: Any) -> Any:
    if isinstance(name, torch._ops.OpOverloadPacket):
        return name
    if isinstance(name, torch._ops.OpOverload):
        return name.overloadpacket
    text = str(name).removeprefix("torch.ops.").removeprefix("aten.").removeprefix("aten::")
    text = text.split(".")[0]
    if not hasattr(aten, text):
        raise Remat3dError(
            f"Unknown aten op {name!r} in an op policy. Use names like 'convolution', "
            "'mm', 'native_batch_norm' (see torch.ops.aten)."
        )
    return getattr(aten, text)


def resolve_policy(policy: str | Iterable[Any] | Callable[..., Any] | None) -> PolicyFn | None:
    """Turn a policy name, op list or policy function into a policy function (None: all)."""
    if policy is None or policy == "recompute-all":
        return None
    if callable(policy):
        return policy  # a user's own policy_fn(ctx, func, *args, **kwargs)
    if isinstance(policy, str):
        if policy == "save-compute-heavy":
            return _keep(COMPUTE_HEAVY_OPS)
        if policy == "save-norm-and-pool":
            return _keep(NORM_AND_POOL_OPS)
        raise Remat3dError(
            f"Unknown op policy {policy!r}. Use one of {', '.join(POLICY_NAMES)}, or a list "
            "of aten op names to keep."
        )
    return _keep(frozenset(_op_packet(p) for p in policy))


def _is_weight_cast(func: Any, args: tuple) -> bool:
    return (func is aten._to_copy.default and bool(args)
            and isinstance(args[0], torch.Tensor) and args[0].is_leaf
            and args[0].requires_grad)


def selective_contexts(policy_fn: PolicyFn) -> tuple[Any, Any]:
    """``create_selective_checkpoint_contexts``, tolerant of autocast's weight-cast cache.

    NOTE [ Autocast's weight casts under selective checkpointing ]
      Autocast casts each weight once per autocast context and reuses the cast. A region's
      forward may therefore find a weight's cast already made (no ``_to_copy`` op) while
      its recomputation, in backward, makes it afresh — and selective checkpointing matches
      ops by position, so it fails. Weight casts are cheap and never worth keeping; these
      contexts let them pass without being counted, in forward and recomputation alike.
      The cast reuse itself is untouched, so gradients stay bit-identical.
    """
    from torch.utils import checkpoint as ckpt

    # The public contexts, made by PyTorch itself (their constructors and storage change
    # between versions: 2.11 requires ``allow_cache_entry_mutation``, 2.13 keeps a dict
    # per op where 2.11 keeps a list); only their dispatch gains the weight-cast bypass.
    caching, cached = ckpt.create_selective_checkpoint_contexts(policy_fn)
    for mode in (caching, cached):
        if not hasattr(type(mode), "__torch_dispatch__"):  # not a dispatch mode: leave it
            return caching, cached
    caching.__class__ = _bypassing_weight_casts(type(caching))
    cached.__class__ = _bypassing_weight_casts(type(cached))
    return caching, cached


_BYPASSING: dict[type, type] = {}


def _bypassing_weight_casts(cls: type) -> type:
    """A subclass of the dispatch mode ``cls`` that runs autocast's weight casts untouched
    (NOTE [ Autocast's weight casts under selective checkpointing ])."""
    if cls not in _BYPASSING:
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if _is_weight_cast(func, args):
                return func(*args, **(kwargs or {}))
            return cls.__torch_dispatch__(self, func, types, args, kwargs)  # type: ignore[attr-defined]

        _BYPASSING[cls] = type(cls.__name__, (cls,), {"__torch_dispatch__": __torch_dispatch__})
    return _BYPASSING[cls]

"""An applied module plan under ``torch.compile``: what each region becomes when dynamo
traces it.

NOTE [ Plans under torch.compile ]
  1. The planned forwards (``runtime/apply.py``) are plain Python; dynamo traces through
     them, call counting included, as through the model's own code.
  2. A recompute region runs as ``torch.utils.checkpoint.checkpoint`` (non-reentrant),
     which dynamo captures as a higher-order op: AOTAutograd's partitioner recomputes the
     region's ops in backward (they are tagged), inside the compiled graphs, with no graph
     break. An op policy (``save-compute-heavy``, an op list) becomes selective
     checkpointing's context: its ops are saved, the others recomputed
     (``runtime/policies.py``). What the compiled step saves outside regions is the
     partitioner's choice, as in any compiled step.
  3. Regions whose mechanism is Python at run time run eagerly, behind
     ``torch.compiler.disable`` (one graph break each, their memory as planned): tiled
     runs (loops over tiles, statistics passes), offload and storage-dtype regions
     (saved-tensor hooks). A fused or host-resident tiled output is materialised on the
     device before the compiled graph reads it (a graph cannot take a pending output):
     the compiled step then holds it, above the plan's verified peak, and a warning says
     so once per region.
  4. The model-level saved-tensor log and rebuilt saved tensors (``Plan.rebuild_saved``)
     are saved-tensor hooks too; compiled, they are left out (the partitioner decides what
     the step outside regions saves). A plan verified with rebuilt tensors promises a
     peak the compiled step need not keep: dynamo's trace warns once per plan (a warning
     is no graph break), and ``remat3d.plan(..., compiled=True)`` plans and verifies
     without them, as the compiled step runs.
  5. ``remat3d.checkpoint`` called inside a compiled model is rule 2 too (with
     ``offload=True``: eager, rule 3).
  6. The op-by-op check of recomputations (``runtime/region.py``) does not run in compiled
     regions: inductor's kernels are not eager's op sequence. Plans are verified on meta,
     and eager steps check as before.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from remat3d.errors import Remat3dError
from remat3d.planspec import Region
from remat3d.runtime.policies import resolve_policy
from remat3d.units import format_bytes

__all__ = ["compiled_checkpoint", "compiled_recompute", "compiling", "eager_region"]

_WARNED: set[str] = set()  # regions whose materialised output was warned of (NOTE rule 3)


def compiling() -> bool:
    """Whether dynamo is tracing the current call (NOTE rule 1)."""
    return bool(torch.compiler.is_compiling())


def compiled_checkpoint(fn: Callable[..., Any], args: tuple, kwargs: dict, *,
                        policy: Any = None, context_fn: Callable[[], Any] | None = None,
                        preserve_rng_state: bool = True) -> Any:
    """NOTE rule 2: ``fn`` as a non-reentrant checkpoint dynamo captures (an op policy as
    selective checkpointing's context)."""
    policy_fn = resolve_policy(policy)
    if policy_fn is not None and context_fn is not None:
        raise Remat3dError(  # as in eager (runtime/region.py): both choose what to keep
            "A checkpoint is given both an op policy and a context_fn; both choose what "
            "to keep. Pass one (a policy_fn can be given as policy=).")
    if policy_fn is not None:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        # a partial, not a closure: dynamo takes selective checkpointing's context only so
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)
    extra = {} if context_fn is None else {"context_fn": context_fn}
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                      **extra, **kwargs)


def compiled_recompute(region: Region, fn: Callable[..., Any], args: tuple,
                       kwargs: dict) -> Any:
    """A plan's recompute region, compiled (NOTE rule 2)."""
    return compiled_checkpoint(fn, args, kwargs, policy=region.policy)


def eager_region(run: Callable[..., Any], label: str) -> Callable[..., Any]:
    """NOTE rule 3: ``run`` outside the compiled graph, its outputs materialised."""
    def eager(*args: Any, **kwargs: Any) -> Any:
        from remat3d.runtime.tiling.fused import Deferred, materialize

        out = run(*args, **kwargs)
        pending = [t for t in tree_leaves(out) if isinstance(t, Deferred)]
        if pending and label not in _WARNED:
            _WARNED.add(label)
            nbytes = sum(t.numel() * t.element_size() for t in pending)
            warnings.warn(
                f"Plan region {label} is tiled with its output fused or in host memory; "
                "under torch.compile that output is stored on the device before the "
                f"compiled graph reads it ({format_bytes(nbytes)}), so the compiled step "
                "can peak above the plan's verified peak by as much. Run the step eagerly "
                "to keep the plan's peak (NOTE [ Plans under torch.compile ]).",
                RuntimeWarning, stacklevel=2)
        return materialize(out)

    eager.__qualname__ = f"eager({getattr(run, '__qualname__', 'region')})"
    return torch.compiler.disable(eager)

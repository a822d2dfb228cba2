"""What users would pick instead of remat3d, installed with plain PyTorch.

- ``install_block_checkpoints``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
  around every block (the MONAI/HF/timm practice). The blocks are the CostGraph's
  (``CostGraph.blocks()``), the same ones remat3d's ``blocks`` strategy uses, so the two
  differ only in the executor.
- ``install_checkpoint_sequential``: ``torch.utils.checkpoint.checkpoint_sequential`` on
  every outermost ``nn.Sequential`` of two or more children (a U-Net's skips are no chain,
  so this is the most of the network it can cover).

Both change only ``forward`` attributes of module instances; build a fresh model per
method.

NOTE [ Autocast on meta in recomputation ]
  ``torch.utils.checkpoint`` restores ``torch.autocast`` around a recomputation. On the
  meta device autocast is remat3d's ``MetaAutocast`` function mode, which it does not
  know about, so a recomputation would run in fp32 and be counted twice as large. Each
  checkpointed function therefore remembers the MetaAutocast active in its forward and
  re-enters one like it when it runs outside any (in backward): what CUDA autocast would
  do, on meta. On CPU and CUDA nothing is added.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from remat3d.instrument.amp import MetaAutocast, active_meta_autocast

__all__ = [
    "install_block_checkpoints",
    "install_checkpoint_sequential",
    "outermost_sequentials",
]


def _amp_restoring(fn: Callable[..., Any], dtype: torch.dtype | None) -> Callable[..., Any]:
    """``fn`` run under MetaAutocast(dtype) when called outside one (NOTE above)."""
    if dtype is None:
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        ctx = MetaAutocast(dtype) if active_meta_autocast() is None else contextlib.nullcontext()
        with ctx:
            return fn(*args, **kwargs)

    return run


def _meta_amp_dtype() -> torch.dtype | None:
    mode = active_meta_autocast()
    return None if mode is None else mode.dtype


def install_block_checkpoints(model: nn.Module, block_names: list[str]) -> int:
    """Wrap each named module's forward in ``checkpoint(use_reentrant=False)``.

    Returns how many modules were wrapped.

    >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> install_block_checkpoints(net, ["0", "2"])
    2
    """
    modules = dict(model.named_modules())
    for name in block_names:
        module = modules[name]
        original = module.forward

        def forward(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            fn = _amp_restoring(_original, _meta_amp_dtype())
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)

        module.forward = forward  # type: ignore[method-assign]
    return len(block_names)


def outermost_sequentials(model: nn.Module) -> list[tuple[str, nn.Sequential]]:
    """``nn.Sequential`` modules of two or more children not inside another such one.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.ReLU()))
    >>> [name for name, _ in outermost_sequentials(net)]
    ['']
    """
    found: list[tuple[str, nn.Sequential]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        if isinstance(module, nn.Sequential) and len(module) >= 2:
            found.append((prefix, module))
            return
        for name, child in module.named_children():
            walk(child, f"{prefix}.{name}" if prefix else name)

    walk(model, "")
    return found


def install_checkpoint_sequential(model: nn.Module, segments: int) -> int:
    """Run every outermost ``nn.Sequential`` through ``checkpoint_sequential``.

    ``segments`` is capped at each Sequential's length (PyTorch never checkpoints the last
    segment). Returns how many Sequentials were wrapped (0: not applicable).
    """
    wrapped = outermost_sequentials(model)
    for _name, seq in wrapped:
        children = list(seq.children())
        k = max(1, min(segments, len(children)))

        def forward(x: Any, _children: list[nn.Module] = children, _k: int = k) -> Any:
            dtype = _meta_amp_dtype()
            functions = [_amp_restoring(c, dtype) for c in _children]
            return checkpoint_sequential(functions, _k, x, use_reentrant=False)

        seq.forward = forward  # type: ignore[method-assign]
    return len(wrapped)

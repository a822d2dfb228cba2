"""Contexts that make recomputation exact, and say so when it cannot be.

NOTE [ Exact recomputation ]
  A region's forward runs twice: once in forward, once (or more) during backward. The
  second run must rebuild exactly what the first saved, and must not do anything the first
  did not. Each guard here enforces one rule:
  1. ``BufferGuard``: modules with running buffers (BatchNorm) update them in every
     training-mode forward. During recomputation every buffer of every module called is
     snapshotted on first call and restored when recomputation ends, so running statistics
     change exactly once per step, bitwise.
  2. ``OpRecorder``/``OpChecker``: the forward records each op with its output shapes and
     dtypes and the module it ran in; the recomputation compares op by op and, at the first
     difference, raises an error naming the op and the module in both runs (PyTorch's own
     check only says that some saved tensor's metadata differs).
  3. ``RecomputeOverwritten``: with an op policy, a kept op output that a later in-place op
     overwrote (InstanceNorm -> in-place LeakyReLU, the nnU-Net block) is recomputed from
     its inputs instead of read back, so backward sees the value the forward saw.
  RNG state is restored by ``torch.utils.checkpoint`` itself (CPU and the devices of the
  region's tensor inputs), so dropout masks repeat.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from remat3d.errors import RecomputeDivergedError
from remat3d.instrument.state import module_name
from remat3d.units import format_shape

__all__ = [
    "BufferGuard",
    "ModuleStack",
    "OpChecker",
    "OpRecorder",
    "RecomputeDivergedError",
    "RecomputeOverwritten",
]


class ModuleStack:
    """Which module is running, via process-wide module hooks active only inside a region."""

    def __init__(self) -> None:
        self.stack: list[nn.Module] = []
        self._handles: list[Any] = []
        self.on_enter: list[Any] = []

    def current(self) -> str:
        return module_name(self.stack[-1]) if self.stack else "(region function)"

    def __enter__(self) -> ModuleStack:
        def pre(module: nn.Module, args: Any) -> None:
            self.stack.append(module)
            for callback in self.on_enter:
                callback(module)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            if self.stack and self.stack[-1] is module:
                self.stack.pop()

        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(pre),
            nn.modules.module.register_module_forward_hook(post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.stack = []


class BufferGuard:
    """Restore every buffer of every module called while active (see NOTE rule 1)."""

    def __init__(self, modules: ModuleStack, root: nn.Module | None = None) -> None:
        self._saved: dict[tuple[int, str], tuple[nn.Module, str, torch.Tensor, torch.Tensor]]
        self._saved = {}
        self._root = root
        modules.on_enter.append(self.snapshot)

    def snapshot(self, module: nn.Module) -> None:
        for name, buf in module._buffers.items():
            key = (id(module), name)
            if buf is None or key in self._saved:
                continue
            with torch.no_grad(), _disable_current_modes():
                self._saved[key] = (module, name, buf, buf.detach().clone())

    def __enter__(self) -> BufferGuard:
        if self._root is not None:  # the region's own module runs without __call__
            for module in self._root.modules():
                self.snapshot(module)
        return self

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad(), _disable_current_modes():
            for module, name, original, copy in self._saved.values():
                module._buffers[name] = original
                original.copy_(copy)
        self._saved = {}


# Left out of the comparison on both sides: torch.utils.checkpoint detaches the inputs
# inside the recomputation context, and autocast casts a weight once per autocast context
# (cached in forward, cast again when backward recomputes). Neither computes anything; a
# cast that really changes the program shows up in the dtypes of the ops that follow.
_IGNORED = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default,
                      torch.ops.aten.lift_fresh.default, torch.ops.aten._to_copy.default})


def _signature(out: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tree_leaves(out)
                 if isinstance(t, torch.Tensor))


class OpRecorder(TorchDispatchMode):
    """Record the ops of a region's forward (see NOTE rule 2)."""

    def __init__(self, modules: ModuleStack) -> None:
        super().__init__()
        self.modules = modules
        self.ops: list[tuple[str, tuple, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if func not in _IGNORED:
            self.ops.append((str(func), _signature(out), self.modules.current()))
        return out


class OpChecker(TorchDispatchMode):
    """Compare a recomputation op by op with the recorded forward (see NOTE rule 2)."""

    def __init__(self, recorder: OpRecorder, modules: ModuleStack, region: str) -> None:
        super().__init__()
        self.recorder = recorder
        self.modules = modules
        self.region = region
        self.index = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if func in _IGNORED:
            return out
        ops = self.recorder.ops
        here = (str(func), _signature(out), self.modules.current())
        if self.index >= len(ops) or ops[self.index][:2] != here[:2]:
            expected = ops[self.index] if self.index < len(ops) else None
            raise RecomputeDivergedError(
                f"Recomputation of region '{self.region}' diverged from its forward at op "
                f"#{self.index}: the forward ran "
                + (f"{expected[0]} -> {_fmt(expected[1])} in module '{expected[2]}'"
                   if expected else "no further op")
                + f", the recomputation ran {here[0]} -> {_fmt(here[1])} in module "
                f"'{here[2]}'. The region's forward depends on something other than its "
                "inputs (a flag, a counter, data-dependent control flow). Make it depend "
                "only on its inputs, or leave this module out of the plan."
            )
        self.index += 1
        return out


def _fmt(sig: tuple) -> str:
    return ", ".join(f"{format_shape(s) or 'scalar'} {str(d).replace('torch.', '')}"
                     for s, d in sig) or "()"


class RecomputeOverwritten:
    """Entered as recomputation starts: kept outputs overwritten since are recomputed.

    See NOTE rule 3. PyTorch's selective checkpointing raises when a kept tensor was
    modified in place after the forward kept it; but the op that produced it can simply be
    run again (it is deterministic and its inputs are rebuilt first), which gives exactly
    the value the forward saw. This marks such entries for recomputation.
    """

    def __init__(self, caching_mode: Any, region: str) -> None:
        self.caching_mode = caching_mode
        self.region = region

    def __enter__(self) -> None:
        from torch.utils import checkpoint as ckpt

        wrapper_cls = getattr(ckpt, "_VersionWrapper", None)
        recompute = getattr(ckpt, "_RECOMPUTE", None)
        storage = getattr(self.caching_mode, "storage", None)
        if wrapper_cls is None or recompute is None or not isinstance(storage, dict):
            return  # PyTorch's own check will name the problem
        for per_op in storage.values():
            # per op: a dict of call index -> entry (PyTorch 2.13), a list (2.11)
            entries = per_op.items() if isinstance(per_op, dict) else enumerate(per_op)
            for idx, entry in list(entries):
                leaves = tree_leaves(entry, is_leaf=lambda x: isinstance(x, wrapper_cls))
                if any(isinstance(w, wrapper_cls) and w.version is not None
                       and w.val._version != w.version for w in leaves):
                    per_op[idx] = recompute

    def __exit__(self, *exc: object) -> None:
        return None

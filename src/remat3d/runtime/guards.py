"""Contexts that make recomputation exact, and say so when it cannot be.

NOTE [ Exact recomputation ]
  A region's forward runs twice: once in forward, once (or more) during backward. The
  second run must rebuild exactly what the first saved, and must not do anything the first
  did not. Each guard here enforces one rule:
  1. ``BufferGuard``: modules with running buffers (BatchNorm) update them in every
     training-mode forward. During recomputation the buffers of the region's module and
     its submodules (for a region on a plain function: of every module called, on first
     call) are copied, and their values put back when recomputation ends, so running
     statistics change exactly once per step, bitwise.
     A module with no children and no buffers is no owner (a span of its parent's forward
     calls its parent's children): its modules are found as they are called, like a
     function's. (A module region with children that also calls a module outside its own
     subtree, one it does not own, is not covered: make the region on a function.)
  2. Divergence, named. By default nothing runs per op: like ``torch.utils.checkpoint``,
     each tensor the forward saves for backward is noted with its shape, dtype and device
     (``SavedMeta``, through torch's own determinism check), and the recomputation must
     save as many tensors with the same metadata. Only when it does not is the region's
     function run once more, under ``OpRecorder`` and a saved-tensor counter, to name the
     op and the module that saved the differing tensor (``Diagnosis``). With
     ``determinism_check="ops"`` (or torch's ``debug=True``; plans are verified this way)
     the forward records every op (``OpRecorder``) and the recomputation is compared op by
     op (``OpChecker``), which also catches a different op with same-shaped results and
     names the op and module in both runs. Either way a recomputation of the region's own
     nested recomputations (a region whose forward runs ``autograd.grad``) and profiler
     bookkeeping ops (``record_function``) are not part of the comparison, and every
     recomputation (backward twice, double backward) is compared from the start.
  3. ``RecomputeOverwritten``: with an op policy, a kept op output that a later in-place op
     overwrote (InstanceNorm -> in-place LeakyReLU, the nnU-Net block) is recomputed from
     its inputs instead of read back, so backward sees the value the forward saw.
  RNG state is restored by ``torch.utils.checkpoint`` itself (CPU and the devices of the
  region's tensor inputs), so dropout masks repeat.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from remat3d.errors import RecomputeDivergedError
from remat3d.instrument.state import module_name, recompute_depth
from remat3d.runtime.compat import selective_cache_entries, selective_cache_internals
from remat3d.units import format_shape

__all__ = [
    "BufferGuard",
    "Diagnosis",
    "ForwardSaves",
    "ModuleStack",
    "OpChecker",
    "OpRecorder",
    "RecomputeDivergedError",
    "RecomputeOverwritten",
    "SavedMeta",
    "diverged",
    "saved_metadata",
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
    """Restore the buffers a recomputation may update (see NOTE rule 1): those of a
    region's module and all its submodules, or, for a region on a plain function (whose
    modules are not known beforehand), of every module called while active."""

    def __init__(self, modules: ModuleStack | None, root: nn.Module | None = None) -> None:
        self._saved: dict[tuple[int, str], tuple[nn.Module, str, torch.Tensor, torch.Tensor]]
        self._saved = {}
        self._root = root
        if modules is not None:
            modules.on_enter.append(self.snapshot)

    def snapshot(self, module: nn.Module) -> None:
        if not any(buf is not None and (id(module), name) not in self._saved
                   for name, buf in module._buffers.items()):
            return  # most modules have no buffers: no modes left and re-entered for them
        with torch.no_grad(), _outside_modes():
            self._copy(module)

    def _copy(self, module: nn.Module) -> None:
        for name, buf in module._buffers.items():
            key = (id(module), name)
            if buf is None or key in self._saved:
                continue
            self._saved[key] = (module, name, buf, buf.detach().clone())

    def __enter__(self) -> BufferGuard:
        if self._root is not None:
            modules = _with_buffers(self._root)
            if modules:
                with torch.no_grad(), _outside_modes():
                    for module in modules:
                        self._copy(module)
        return self

    def __exit__(self, *exc: object) -> None:
        # the values written into the buffers are undone in place: code that holds a
        # buffer itself (tiled runs update running statistics once) sees them restored
        if self._saved:
            with torch.no_grad(), _outside_modes():
                for module, name, original, copy in self._saved.values():
                    module._buffers[name] = original
                    original.copy_(copy)
        self._saved = {}


def _outside_modes() -> contextlib.AbstractContextManager[Any]:
    """Buffer copies out of sight of any dispatch or function mode (the tracker, a tiled
    run's); no context to enter when none is active (every recomputation asks)."""
    if torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack():
        return _disable_current_modes()
    return contextlib.nullcontext()


_BUFFERED: weakref.WeakKeyDictionary[nn.Module, tuple[int, list[nn.Module]]]
_BUFFERED = weakref.WeakKeyDictionary()


def _with_buffers(root: nn.Module) -> list[nn.Module]:
    """The modules under ``root`` (itself included) that hold buffers, remembered per
    root while it keeps the same number of direct submodules (one walk per step
    instead of one per recomputation)."""
    count = len(root._modules)
    known = _BUFFERED.get(root)
    if known is None or known[0] != count:
        known = (count, [m for m in root.modules() if m._buffers])
        _BUFFERED[root] = known
    return known[1]


# Left out of the comparison on both sides: torch.utils.checkpoint detaches the inputs
# inside the recomputation context, and autocast casts a weight once per autocast context
# (cached in forward, cast again when backward recomputes). Neither computes anything; a
# cast that really changes the program shows up in the dtypes of the ops that follow.
_IGNORED = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default,
                      torch.ops.aten.lift_fresh.default, torch.ops.aten._to_copy.default})


def _compared(func: Any, depth: int) -> bool:
    """An op that counts (NOTE rule 2): not bookkeeping, not a nested recomputation's."""
    return (func not in _IGNORED and func.namespace != "profiler"
            and recompute_depth() == depth)


def _signature(out: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tree_leaves(out)
                 if isinstance(t, torch.Tensor))


class OpRecorder(TorchDispatchMode):
    """Record the ops of a region's run (see NOTE rule 2)."""

    def __init__(self, modules: ModuleStack) -> None:
        super().__init__()
        self.modules = modules
        self.ops: list[tuple[str, tuple, str]] = []
        self.last_outputs: set[int] = set()  # storages the latest op wrote
        self._depth = 0

    def __enter__(self) -> OpRecorder:
        self._depth = recompute_depth()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if _compared(func, self._depth):
            self.ops.append((str(func), _signature(out), self.modules.current()))
            self.last_outputs = {id(t.untyped_storage()) for t in tree_leaves(out)
                                 if isinstance(t, torch.Tensor)}
        return out


class OpChecker(TorchDispatchMode):
    """Compare one recomputation op by op with the recorded forward (see NOTE rule 2)."""

    def __init__(self, recorder: OpRecorder, modules: ModuleStack, region: str) -> None:
        super().__init__()
        self.recorder = recorder
        self.modules = modules
        self.region = region
        self.index = 0
        self._depth = 0

    def __enter__(self) -> OpChecker:
        self._depth = recompute_depth()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if not _compared(func, self._depth):
            return out
        ops = self.recorder.ops
        here = (str(func), _signature(out), self.modules.current())
        if self.index >= len(ops) or ops[self.index][:2] != here[:2]:
            expected = ops[self.index] if self.index < len(ops) else None
            raise diverged(self.region, f"at op #{self.index}: the forward ran "
                           + (_op(expected) if expected else "no further op")
                           + f", the recomputation ran {_op(here)}")
        self.index += 1
        return out

    def stopped_early(self) -> RecomputeDivergedError:
        """The error for a recomputation that ended before saving all the forward saved."""
        ops = self.recorder.ops
        nxt = ops[self.index] if self.index < len(ops) else None
        return diverged(self.region, f"after op #{self.index}: the forward then ran "
                        + (_op(nxt) if nxt else "no further op")
                        + ", the recomputation ran no further op and saved fewer tensors "
                        "for backward")


def _op(entry: tuple[str, tuple, str]) -> str:
    return f"{entry[0]} -> {_fmt(entry[1])} in module '{entry[2]}'"


def diverged(region: str, where: str, hint: str = "") -> RecomputeDivergedError:
    return RecomputeDivergedError(
        f"Recomputation of region '{region}' diverged from its forward {where}. The "
        "region's forward depends on something other than its inputs (a flag, a counter, "
        "data-dependent control flow). Make it depend only on its inputs, or leave this "
        f"module out of the plan.{hint}"
    )


def _fmt(sig: tuple) -> str:
    return ", ".join(f"{format_shape(s) or 'scalar'} {str(d).replace('torch.', '')}"
                     for s, d in sig) or "()"


class SavedMeta:
    """What torch's determinism check keeps of one tensor a region's forward saved
    (NOTE rule 2): its shape, dtype and device, and where it was saved. Compared with the
    recomputation's by torch (``!=``); a difference raises the region's diagnosis."""

    __slots__ = ("index", "key", "saves")

    def __init__(self, key: tuple, saves: ForwardSaves | None, index: int) -> None:
        self.key = key
        self.saves = saves
        self.index = index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SavedMeta) and other.key == self.key

    def __ne__(self, other: object) -> bool:
        if self == other:
            return False
        if self.saves is not None and isinstance(other, SavedMeta):
            raise self.saves.on_mismatch(self.index, self.key, other.key)
        return True

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return _fmt_key(self.key)


def _fmt_key(key: tuple) -> str:
    shape, dtype, device = key
    return f"{format_shape(shape) or 'scalar'} {str(dtype).replace('torch.', '')} on {device}"


_forward = threading.local()


def saved_metadata(t: torch.Tensor) -> SavedMeta:
    """torch's determinism-check function for remat3d's regions (``compat``): the
    metadata of a saved tensor, counted against the region whose forward is running.

    (A recomputed tensor's metadata is taken by torch after its recomputation has ended;
    it is counted against no region unless one's forward is running then, which only a
    region whose forward runs a backward through another region does, and which only
    shifts the positions that region's diagnosis would name.)"""
    stack = getattr(_forward, "stack", None)
    saves = stack[-1] if stack else None
    key = (tuple(t.shape), t.dtype, t.device)
    if saves is None:
        return SavedMeta(key, None, -1)
    saves.count += 1
    return SavedMeta(key, saves, saves.count - 1)


class ForwardSaves:
    """Entered around a region's forward: counts what it saves for backward (``saved_metadata``)
    and says what to do when a recomputation's saved tensor differs."""

    def __init__(self, on_mismatch: Any) -> None:
        self.count = 0
        # the region's method, held weakly: the region holds these saves, and a cycle
        # would keep its selective-checkpoint cache (every kept op output) alive after the
        # graph is gone, until Python's cyclic collector happened to run
        self._on_mismatch = weakref.WeakMethod(on_mismatch)

    def on_mismatch(self, *args: Any) -> Exception:
        method = self._on_mismatch()
        assert method is not None  # the region runs this recomputation
        return method(*args)

    def __enter__(self) -> ForwardSaves:
        self.count = 0
        stack = getattr(_forward, "stack", None)
        if stack is None:
            stack = _forward.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _forward.stack.remove(self)


class Diagnosis:
    """Run a region's function once more, recording its ops and what it saves, to name the
    op and module behind a saved tensor (NOTE rule 2: only after a recomputation diverged).
    """

    def __init__(self) -> None:
        self.modules = ModuleStack()
        self.recorder = OpRecorder(self.modules)
        # per saved tensor: (index of the op that saved it, module, metadata)
        self.saves: list[tuple[int, str, tuple]] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ops = len(self.recorder.ops)
        # an op's outputs are saved after it ran, its inputs before
        index = ops - 1 if id(t.untyped_storage()) in self.recorder.last_outputs else ops
        self.saves.append((index, self.modules.current(), (tuple(t.shape), t.dtype,
                                                            t.device)))
        return t

    def describe(self, position: int) -> str:
        """The op that saved tensor ``position`` (or the last one), in words."""
        if not self.saves:
            return "the recomputation, run again, saved no tensor"
        index, module, key = self.saves[min(position, len(self.saves) - 1)]
        ops = self.recorder.ops
        op = ops[min(index, len(ops) - 1)][0] if ops else "(no op)"
        return f"saved as a {_fmt_key(key)} by {op} (op #{index}) in module '{module}'"


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
        internals = selective_cache_internals()
        entries = selective_cache_entries(self.caching_mode)
        if internals is None or entries is None:
            return  # PyTorch's own check will name the problem
        wrapper_cls, recompute = internals
        for per_op, key, entry in entries:
            leaves = tree_leaves(entry, is_leaf=lambda x: isinstance(x, wrapper_cls))
            if any(isinstance(w, wrapper_cls) and w.version is not None
                   and w.val._version != w.version for w in leaves):
                per_op[key] = recompute

    def __exit__(self, *exc: object) -> None:
        return None

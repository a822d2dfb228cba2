"""Saved tensors rebuilt from cheap ops instead of stored.

NOTE [ Rebuilt saved tensors ]
  In a kept (not recomputed) block, autograd saves every intermediate its backward reads:
  a norm's output after an in-place activation (read by the next convolution), the sum of
  an upsampled decoder input and a skip connection (read by the next norm), a
  concatenation. Each is a full-resolution tensor computed from other tensors that are
  kept anyway, by ops that cost no FLOPs. Outside recompute regions, while a planned model
  runs forward:
  1. :class:`RebuildRecorder` (a ``TorchDispatchMode``) notes, for the output of every
     *cheap* aten op, a :class:`Recipe`: the op and its arguments, where an argument that
     is itself a cheap op's output points at that op's recipe, and any other tensor (a
     convolution's output, a parameter) is a *leaf*. Cheap means: no FLOP formula
     (``instrument/flops.py``: not a convolution/matmul), no RNG
     (``nondeterministic_seeded``), no side effects (no ``out=``, no write into anything
     but its own first argument, no BatchNorm with running statistics), one device, plain
     tensors. Leaves are held weakly, except leaves at most a quarter of the output's size
     (the low-resolution input of an upsampling), which the recipe keeps.
  2. When autograd saves such an output, the saved-tensor hook computes what storing the
     recipe instead would keep alive: its leaves that are not saved already (by autograd,
     as a region's input, or as a parameter). If that is at most half the tensor's bytes
     (and rule 3's replay bound holds), the recipe is saved, holding its leaves; the
     tensor itself is freed when forward is done with it, and every leaf is checked to be
     alive, at its recorded version, now.
  3. When backward reads the saved tensor (only then: not when the block's backward
     starts), the recipe replays its ops under ``no_grad`` from the leaves — the same
     aten ops on the same values, so bitwise what was saved. The replay runs the chain
     in forward order (an in-place op after every reader of the value it overwrites) and
     frees each intermediate after its last use; a recipe is saved only if that replay
     holds at most three times the tensor's bytes at once (PyTorch's decomposed deterministic
     trilinear upsampling holds a dozen: it is stored instead). A tensor still alive from
     an earlier unpack is returned again instead of being rebuilt twice.
  4. A leaf modified in place after the recipe was saved would rebuild a different
     tensor: its version counter is checked when unpacking and the step fails with
     :class:`StaleRebuildError` naming the op, instead of computing a wrong gradient.
     (Plans are verified by running them on the meta device, so such a model fails when
     it is planned.)
  5. An op may write into a tensor without bumping its version counter:
     ``native_batch_norm`` updates the running statistics it is given in place, and
     ``InstanceNorm3d(track_running_stats=True)`` passes it a ``repeat`` of its buffers,
     which autograd then saves. A recipe for such a tensor would rebuild the value from
     before the write. So every tensor an op that is not recorded writes into (a mutable
     argument in its schema, BatchNorm's running statistics) loses its recipes; autograd
     saves an op's inputs before the op runs, so a recipe already saved in its place is
     replaced by the tensor itself (``Rebuilt.pin``).
  6. A recipe reads no parameter in backward: a parameter's storage may be gone by then
     (FSDP2 frees the unsharded parameters after forward and gathers a module's again
     only for that module's own backward, while a recipe may be replayed in another's).
     A parameter is always a leaf, even one a cheap op made (FSDP2's unsharded
     parameters are views of the buffer it gathers into). The model's own parameters (as
     ``apply`` found them) stay put and are read as they are; of any other parameter (an
     FSDP2 unit's unsharded one: an affine weight, a bias, small) a recipe holds a copy,
     taken when it is saved, whose bytes count in rule 2's cost; one freed by then (FSDP2
     resharded an earlier unit) leaves the tensor saved itself.
  Cost: the cheap ops run again in backward (memory traffic, no FLOPs: the plan's
  ``recompute_flops`` does not change). ``Plan(rebuild_saved=False)`` turns this off.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from remat3d.errors import StaleRebuildError
from remat3d.runtime.recipe import (
    Leaf,
    Recipe,
    StorageKey,
    is_plain,
    storage_key,
    storage_nbytes,
)

__all__ = ["RebuildRecorder", "Rebuilt", "Recipe", "StaleRebuildError"]

_UNINITIALISED = ("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
                  "empty_permuted")
_MAX_DEPTH = 16  # replays stay short: a longer chain starts from a kept tensor
class Rebuilt:
    """What is saved instead of a tensor: the recipe that rebuilds it (NOTE rule 2)."""

    __slots__ = ("__weakref__", "held", "index", "pinned", "recipe")

    def __init__(self, recipe: Recipe, index: int, leaves: list[Leaf],
                 copied: frozenset[int] = frozenset()) -> None:
        self.recipe = recipe
        self.index = index
        # hold every leaf from now on (rule 2); the tensors themselves, whose version
        # counters rule 4 checks (only read under no_grad), and of the parameters in
        # ``copied`` (by id of their Leaf) a copy (rule 6), checked against its own version
        self.held: dict[int, tuple[torch.Tensor, int]] = {}
        for leaf in leaves:
            t = leaf.get()
            if t is not None and id(leaf) in copied:
                copy = t.detach().clone()
                self.held[id(leaf)] = (copy, copy._version)
            elif t is not None:
                self.held[id(leaf)] = (t, leaf.version)
        self.pinned: torch.Tensor | None = None  # rule 5: the tensor itself, kept

    @property
    def leaves(self) -> list[torch.Tensor]:
        return [t for t, _ in self.held.values()]

    def pin(self, t: torch.Tensor) -> None:
        """Keep ``t`` itself and drop the recipe: it was written after being saved (rule 5)."""
        self.pinned = t
        self.held = {}

    def unpack(self) -> torch.Tensor:
        if self.pinned is not None:
            return self.pinned
        last = self.recipe.last.get(self.index)
        if last is not None:
            value = last[0]()
            if value is not None and value._version == last[1]:
                return value  # still alive from the previous unpack: one copy, not two
        with torch.no_grad(), torch._C.DisableTorchFunction():
            value = tree_flatten(self.recipe.run(self.held))[0][self.index]
        self.recipe.last[self.index] = (weakref.ref(value), value._version)
        return value


_WRITES: dict[Any, tuple[tuple[tuple[int, str], ...], bool]] = {}  # op -> what it writes


def _writes(func: Any) -> tuple[tuple[tuple[int, str], ...], bool]:
    """The positions and names of ``func``'s schema's mutable arguments, and whether it
    is a BatchNorm kernel (read once per op: every op of every step asks)."""
    found = _WRITES.get(func)
    if found is None:
        found = _WRITES[func] = (
            tuple((i, argument.name) for i, argument in enumerate(func._schema.arguments)
                  if argument.alias_info is not None and argument.alias_info.is_write),
            "batch_norm" in func.__name__)
    return found


def _written(func: Any, args: tuple, kwargs: dict, *, but_first: bool = False
             ) -> list[torch.Tensor]:
    """The tensors ``func`` writes into: its schema's mutable arguments (``but_first``: the
    first one aside, an in-place op's own target), and the running statistics BatchNorm
    kernels update although their schema does not say so."""
    mutable, batch_norm = _writes(func)
    found: list[Any] = [args[i] if i < len(args) else kwargs.get(name)
                        for i, name in mutable if not (but_first and i == 0)]
    if batch_norm:
        found += list(args[3:5])
    if not found:
        return []
    return [t for t in tree_flatten(found)[0] if isinstance(t, torch.Tensor)]


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage still holds all of it (FSDP2 resizes an unsharded
    parameter's storage to nothing after forward)."""
    if t.numel() == 0:
        return True
    end = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.untyped_storage().nbytes() >= end * t.element_size()


def _cheap(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    if func._overloadpacket in flop_registry or "out" in kwargs:
        return False
    if torch.Tag.nondeterministic_seeded in func.tags or func.__name__.split(".")[0] in \
            _UNINITIALISED:
        return False
    if _written(func, args, kwargs, but_first=True):
        return False  # a side effect: BatchNorm's running statistics, another argument
    tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
    if not tensors or not all(is_plain(t) for t in tensors):
        return False
    device = tensors[0].device
    return all(t.device == device for t in tensors)


class _Entry:
    """What the recorder knows of one storage: recipes by tensor key, and the recipes
    saved in place of its tensors (rule 5)."""

    __slots__ = ("packed", "recipes", "storage")

    def __init__(self, storage: Any) -> None:
        self.storage = weakref.ref(storage)
        self.recipes: dict[StorageKey, tuple[Recipe, int]] = {}
        self.packed: list[tuple[weakref.ref[Rebuilt], StorageKey]] = []


class RebuildRecorder(TorchDispatchMode):
    """NOTE rule 1: recipes for the outputs of cheap ops, while those outputs live."""

    def __init__(self, kept: Callable[[int], bool], weight: Callable[[int], bool]) -> None:
        super().__init__()
        self._kept = kept  # storage id -> saved already (or a parameter/buffer)
        self._weight = weight  # storage id -> the model's own parameter or buffer (rule 6)
        self._table: dict[int, _Entry] = {}  # by storage id
        self._finalizers: list[weakref.finalize] = []
        self._sequence = 0

    def __exit__(self, *exc: object) -> None:
        # forward is over: saved recipes hold what they need; forget the rest (storages
        # that outlive the step, such as parameters, would otherwise keep the table)
        super().__exit__(*exc)
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()
        self._table.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.is_grad_enabled() and _cheap(func, args, kwargs, out):
            self._record(func, args, kwargs, out)
        else:
            self._forget_written(func, args, kwargs)
        return out

    def _forget_written(self, func: Any, args: tuple, kwargs: dict) -> None:
        """NOTE rule 5: what an op that is not recorded writes into has no recipe, and a
        recipe saved for it already is replaced by the tensor itself."""
        for t in _written(func, args, kwargs):
            entry = self._entry(t.untyped_storage())
            if entry is None:
                continue
            del self._table[id(t.untyped_storage())]
            for ref, key in entry.packed:
                rebuilt = ref()
                if rebuilt is not None:
                    rebuilt.pin(t if storage_key(t, key[0]) == key else
                                t.as_strided(key[1], key[2], key[3]))

    def _entry(self, storage: Any, create: bool = False) -> _Entry | None:
        """The entry of ``storage`` (not of an earlier storage with the same id)."""
        entry = self._table.get(id(storage))
        if entry is not None and entry.storage() is storage:
            return entry
        if not create:
            return None
        key = id(storage)
        entry = self._table[key] = _Entry(storage)
        self._finalizers.append(weakref.finalize(storage, self._table.pop, key, None))
        return entry

    def _lookup(self, t: torch.Tensor, version: int) -> tuple[Recipe, int] | None:
        entry = self._entry(t.untyped_storage())
        return None if entry is None else entry.recipes.get(storage_key(t, version))

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        mutable, _ = _writes(func)
        inplace = bool(mutable) and mutable[0][0] == 0  # it writes its first argument
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        largest = max(storage_nbytes(t) for t in outputs)
        flat, spec = tree_flatten((args, kwargs))
        sources: list[Any] = []
        for i, value in enumerate(flat):
            if not isinstance(value, torch.Tensor):
                sources.append(value)
                continue
            # a parameter is a leaf (rule 6), even one a cheap op made (FSDP2's
            # unsharded parameters are views of the buffer it gathers them into)
            found = (None if isinstance(value, nn.Parameter)
                     else self._lookup(value, value._version))
            if found is not None and found[0].depth >= _MAX_DEPTH:
                found = None  # a long chain of cheap ops (a residual stream): start anew
            if found is not None:
                sources.append(found)
            elif inplace and i == 0:
                return  # an in-place op on a tensor we cannot rebuild
            else:
                sources.append(Leaf(value, keep=4 * storage_nbytes(value) <= largest))
        inputs = {id(t.untyped_storage()) for t in flat if isinstance(t, torch.Tensor)}
        fresh = {id(t.untyped_storage()): t for t in outputs
                 if id(t.untyped_storage()) not in inputs}
        new_bytes = sum(storage_nbytes(t) for t in fresh.values())
        self._sequence += 1
        recipe = Recipe(func, spec, sources, self._sequence, new_bytes)
        for index, t in enumerate(tree_flatten(out)[0]):
            if not isinstance(t, torch.Tensor):
                continue
            # an in-place op's version is bumped after this mode returns
            version = t._version + (1 if inplace and t is args[0] else 0)
            entry = self._entry(t.untyped_storage(), create=True)
            assert entry is not None
            entry.recipes[storage_key(t, version)] = (recipe, index)

    def rebuilt(self, t: torch.Tensor) -> Rebuilt | None:
        """The recipe to save instead of ``t``, if it keeps at most half of ``t``'s bytes
        alive that would not be alive anyway (NOTE rule 2)."""
        if not is_plain(t) or t.numel() * t.element_size() != storage_nbytes(t):
            return None  # (a slice frees nothing while its base lives)
        found = self._lookup(t, t._version)
        if found is None:
            return None
        recipe, index = found
        leaves = recipe.leaves()
        cost, counted, copied = 0, set(), set()
        for leaf in leaves:
            value = leaf.get()
            if value is None or value._version != leaf.version:
                return None
            if isinstance(value, nn.Parameter) and not self._weight(leaf.storage):
                if not _whole(value):
                    return None  # freed since the op read it (FSDP2 resharded it)
                copied.add(id(leaf))
                cost += value.numel() * value.element_size()  # its copy (rule 6)
            elif leaf.storage not in counted and not self._kept(leaf.storage):
                counted.add(leaf.storage)
                cost += leaf.nbytes
        if 2 * cost > storage_nbytes(t) or recipe.replay_peak() > 3 * storage_nbytes(t):
            return None
        rebuilt = Rebuilt(recipe, index, leaves, frozenset(copied))
        # autograd saves an op's inputs before the op runs: one that then writes into
        # this tensor unseen by its version counter (rule 5) must find the recipe
        entry = self._entry(t.untyped_storage())
        assert entry is not None  # _lookup found the recipe there
        entry.packed.append((weakref.ref(rebuilt), storage_key(t, t._version)))
        return rebuilt

"""Recipes: how to compute a cheap op's outputs again from the tensors it read (NOTE
[ Rebuilt saved tensors ] in ``rebuild.py``, rules 1, 3 and 4)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat3d.errors import StaleRebuildError

__all__ = ["Leaf", "Recipe", "StorageKey", "is_plain", "storage_key", "storage_nbytes"]

StorageKey = tuple[int, tuple[int, ...], tuple[int, ...], int, torch.dtype]


def is_plain(t: Any) -> bool:
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def storage_key(t: torch.Tensor, version: int) -> StorageKey:
    return (version, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)


def storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class Leaf:
    """A tensor a recipe starts from, with the version it had when the op read it."""

    __slots__ = ("nbytes", "ref", "storage", "strong", "version")

    def __init__(self, t: torch.Tensor, keep: bool) -> None:
        self.version = t._version
        self.nbytes = storage_nbytes(t)
        self.storage = id(t.untyped_storage())
        # the tensor itself: an alias made here, below autograd, would get its own version
        # counter, and a later in-place write into ``t`` would go unnoticed (rule 4)
        self.strong: torch.Tensor | None = t if keep else None
        self.ref = weakref.ref(t) if not keep else None

    def get(self) -> torch.Tensor | None:
        if self.strong is not None:
            return self.strong
        assert self.ref is not None
        return self.ref()


class Recipe:
    """One cheap op: how to compute its outputs again (NOTE rule 1)."""

    __slots__ = ("__weakref__", "depth", "func", "last", "new_bytes", "order", "parents",
                 "sequence", "sources", "spec")

    def __init__(self, func: Any, spec: Any, sources: list[Any], sequence: int,
                 new_bytes: int) -> None:
        self.func = func
        self.spec = spec  # the pytree of (args, kwargs)
        self.sources = sources  # flat leaves: (Recipe, index) | Leaf | constant
        self.sequence = sequence  # when it ran in forward
        self.new_bytes = new_bytes  # outputs not aliasing an input (views, in-place: 0)
        self.order: list[Recipe] | None = None
        self.last: dict[int, tuple[Any, int]] = {}  # output index -> (weakref, version)
        # the recipes this one reads, once each (sources never change: found once here,
        # not on every replay)
        seen: dict[int, Recipe] = {}
        for source in sources:
            if isinstance(source, tuple) and isinstance(source[0], Recipe):
                seen.setdefault(id(source[0]), source[0])
        self.parents: tuple[Recipe, ...] = tuple(seen.values())
        self.depth: int = 1 + max((p.depth for p in self.parents), default=0)

    def chain(self) -> list[Recipe]:
        """Every recipe this one needs, itself last, in forward order: an in-place op
        then runs after everything that read the value it overwrites, as in forward."""
        if self.order is None:
            found: dict[int, Recipe] = {}
            stack = list(self.parents)
            while stack:
                recipe = stack.pop()
                if id(recipe) not in found:
                    found[id(recipe)] = recipe
                    stack += recipe.parents
            # the ancestors only: a list holding the recipe itself would be a reference
            # cycle, and the tensors its leaves hold would then live until Python's cyclic
            # garbage collector happened to run (a peak that depended on when it did)
            self.order = sorted(found.values(), key=lambda r: r.sequence)
        return [*self.order, self]

    def leaves(self) -> list[Leaf]:
        """Every leaf below this recipe, once each."""
        found: dict[int, Leaf] = {}
        for recipe in self.chain():
            for source in recipe.sources:
                if isinstance(source, Leaf):
                    found.setdefault(id(source), source)
        return list(found.values())

    def replay_peak(self) -> int:
        """Bytes the replay holds at once (rule 3 frees each value after its last use)."""
        uses = _uses(self.chain())
        live = peak = 0
        for recipe in self.chain():
            live += recipe.new_bytes
            peak = max(peak, live)
            for parent in recipe.parents:
                uses[id(parent)] -= 1
                if uses[id(parent)] == 0:
                    live -= parent.new_bytes
        return peak

    def run(self, held: dict[int, tuple[torch.Tensor, int]]) -> Any:
        """This op's outputs, replayed from the leaves ``held`` (by id of their
        :class:`Leaf`: the tensor and the version it must still have), each intermediate
        freed after its last use (NOTE rule 3)."""
        order = self.chain()
        uses = _uses(order)
        values: dict[int, list[Any]] = {}
        out: Any = None
        for recipe in order:
            flat = []
            for source in recipe.sources:
                if isinstance(source, tuple) and isinstance(source[0], Recipe):
                    flat.append(values[id(source[0])][source[1]])
                elif isinstance(source, Leaf):
                    flat.append(leaf_value(held.get(id(source)), recipe.func))
                else:
                    flat.append(source)
            args, kwargs = tree_unflatten(flat, recipe.spec)
            out = recipe.func(*args, **kwargs)
            values[id(recipe)] = tree_flatten(out)[0]
            for parent in recipe.parents:
                uses[id(parent)] -= 1
                if uses[id(parent)] == 0:
                    del values[id(parent)]
        return out


def _uses(order: list[Recipe]) -> dict[int, int]:
    uses = {id(r): 0 for r in order}
    uses[id(order[-1])] = 1  # the result itself
    for recipe in order:
        for parent in recipe.parents:
            uses[id(parent)] += 1
    return uses


def leaf_value(held: tuple[torch.Tensor, int] | None, func: Any) -> torch.Tensor:
    if held is None or held[0]._version != held[1]:
        raise StaleRebuildError(
            f"A tensor that remat3d rebuilds a saved activation from (the input of "
            f"{func}) was modified in place, or freed, before the backward used it. "
            "Remove the in-place op, or apply the plan with Plan(rebuild_saved=False).")
    return held[0]

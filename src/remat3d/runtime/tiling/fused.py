"""Fused tiled regions: a tiled stage whose output is never stored.

NOTE [ Fused tiled regions ]
  A ``Region(..., decision="tile", fuse=True)`` does not compute its output when its module
  is called. It returns a :class:`Deferred`: a tensor with the output's shape, dtype and
  device, no storage, and a recipe (the stage's function, its inputs, its tile size).
  1. A tiled region called with a ``Deferred`` argument folds the recipe into its own run
     (:func:`fold`): its tiles compute the producer's part inside their halos, from the
     producer's inputs. The producer's output and its gradient are never whole tensors.
     Several consumers each recompute it (that is the price; a skip connection read by an
     encoder run and by a decoder run is computed twice forward, and recomputed in both
     backwards).
  2. Anything else that touches a ``Deferred`` (an op, a recompute region, a user's
     ``print``) *materialises* it once: the producer runs tiled, as an unfused tiled region
     would, and every later use reads that tensor. So fusing can only change memory and
     time, never results: a fused tiled run equals the composition of its stages.
  3. Shape, dtype, device and ``requires_grad`` queries answer without materialising (MONAI
     code checks shapes between stages).
  4. A consumer that is itself ``fuse`` returns a ``Deferred`` of the composed run, so a
     chain of fused stages (decoder stage -> head) becomes one run ending where a
     consumer is not fused.
  5. A ``Region(..., host=True)`` returns a ``Deferred`` too, whose run writes its output
     to host memory the first time a tiled region reads it (NOTE [ Host-resident tiled
     outputs ]); tiled readers then take that host tensor as an input and read it slice
     by slice. Anything else materialises a device copy of it (rule 2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from remat3d.runtime.tiling.host import compute_device, to_device

__all__ = ["Deferred", "defer", "fold", "materialize"]

# metadata that a Deferred answers itself (NOTE rule 3)
_GETTERS = ("shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "grad_fn",
            "layout", "grad", "is_cuda", "is_meta")
_METADATA = {getattr(torch.Tensor, name).__get__ for name in _GETTERS} | {
    torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.element_size,
    torch.Tensor.is_floating_point, torch.Tensor.untyped_storage,
}


class Deferred(torch.Tensor):
    """The output of a fused tiled region, not computed yet (NOTE [ Fused tiled regions ])."""

    _recipe: tuple[Callable[..., Any], tuple[torch.Tensor, ...], Any, str]
    _value: torch.Tensor | None
    _host: bool
    _host_value: torch.Tensor | None
    _stash: tuple[str | None, list[int] | None]  # (where, which normalisations)

    @staticmethod
    def __new__(cls, fn: Callable[..., Any], inputs: Sequence[torch.Tensor], tile: Any,
                shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                label: str = "", host: bool = False, stash: str | None = None,
                stash_norms: list[int] | None = None) -> Deferred:
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype,  # type: ignore[attr-defined]
                                                device=device)
        t._recipe = (fn, tuple(inputs), tile, label)
        t._value = None
        t._host = host
        t._host_value = None
        t._stash = (stash, stash_norms)
        return t

    @property
    def label(self) -> str:
        return self._recipe[3]

    def materialize(self) -> torch.Tensor:
        """The tensor itself, computed tiled the first time it is needed (NOTE rule 2)."""
        if self._value is None:
            if self._host:
                self._value = to_device(self.host_value(), self.device)
            else:
                from remat3d.runtime.tiling.tiled import labelled, tile

                fn, inputs, size, label = self._recipe
                with labelled(label):
                    self._value = tile(fn, *inputs, tile=size, device=self.device,
                                       stash=self._stash[0], stash_norms=self._stash[1],
                                       share_grads=True)
        return self._value

    def host_value(self) -> torch.Tensor:
        """A host region's output in host memory, computed tiled the first time (rule 5)."""
        assert self._host
        if self._host_value is None:
            from remat3d.runtime.tiling.tiled import labelled, tile

            fn, inputs, size, label = self._recipe
            with labelled(label):
                self._host_value = tile(fn, *inputs, tile=size, host=True,
                                        device=self.device, stash=self._stash[0],
                                        stash_norms=self._stash[1],
                                        share_grads=True)
        return self._host_value

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        state = "computed" if self._value is not None else \
            "on host" if self._host_value is not None else "pending"
        return (f"Deferred({self.label or 'tiled run'}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, {state})")

    @staticmethod
    def is_metadata(func: Any) -> bool:
        """Whether ``func`` only reads metadata (NOTE rule 3; function modes ask too)."""
        return func in _METADATA

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = materialize((args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        raise RuntimeError(f"remat3d: {func} reached a pending fused tiled output without "
                           "materialising it; please report this (it is a bug).")


def materialize(tree: Any) -> Any:
    """``tree`` with every :class:`Deferred` in it replaced by its value (``tree`` itself
    when it holds none: every region call asks, and pytree's map is not free)."""
    if not _holds_deferred(tree):
        return tree
    return tree_map(lambda a: a.materialize() if isinstance(a, Deferred) else a, tree)


def _holds_deferred(tree: Any) -> bool:
    if isinstance(tree, Deferred):
        return True
    if isinstance(tree, torch.Tensor) or tree is None or isinstance(tree, (int, float, str)):
        return False
    if isinstance(tree, (list, tuple)):
        return any(_holds_deferred(v) for v in tree)
    if isinstance(tree, dict):
        return any(_holds_deferred(v) for v in tree.values())
    return True  # another container (a registered pytree node): let tree_map look


def fold(fn: Callable[..., Any], args: Sequence[Any]
         ) -> tuple[Callable[..., Any], list[Any]]:
    """``fn`` over ``args`` as a function of plain inputs: every pending :class:`Deferred`
    argument is replaced by its recipe (NOTE rule 1), a host one by its host tensor (rule
    5). Inputs shared between recipes (the same tensor read by two stages) appear once; a
    Deferred passed twice is computed once per tile."""
    def plain(a: Any) -> Any:
        if not isinstance(a, Deferred):
            return a
        if a._value is None and a._host:
            return a.host_value()
        return a.materialize()

    if not any(_pending(a) for a in args):
        return fn, [plain(a) for a in args]
    flat: list[Any] = []

    def slot(t: Any) -> int:
        for i, u in enumerate(flat):
            if u is t:
                return i
        flat.append(t)
        return len(flat) - 1

    recipe: list[tuple[Callable[..., Any] | None, list[int]]] = []
    for a in args:
        if _pending(a):
            producer, inputs, _tile, _label = a._recipe
            recipe.append((producer, [slot(t) for t in inputs]))
        else:
            recipe.append((None, [slot(plain(a))]))

    def fused(*xs: Any) -> Any:
        done: dict[tuple[int, tuple[int, ...]], Any] = {}
        values = []
        for producer, idx in recipe:
            if producer is None:
                values.append(xs[idx[0]])
                continue
            key = (id(producer), tuple(idx))
            if key not in done:
                done[key] = producer(*(xs[i] for i in idx))
            values.append(done[key])
        return fn(*values)

    fused.__qualname__ = f"fused({getattr(fn, '__qualname__', type(fn).__name__)})"
    return fused, flat


def _pending(a: Any) -> bool:
    """A Deferred whose recipe a reader folds into its own run (not computed, not host)."""
    return isinstance(a, Deferred) and a._value is None and not a._host


def defer(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], tile: Any,
          label: str = "", *, host: bool = False, device: torch.device | None = None,
          stash: str | None = None, stash_norms: list[int] | None = None) -> Deferred:
    """A :class:`Deferred` for ``fn(*inputs)`` run tiled with ``tile`` on ``device`` (with
    its output in host memory: ``host``; ``stash`` and ``stash_norms`` as
    ``remat3d.tile`` takes them, when it
    runs by itself: folded into a reader's run, the reader's stash applies); its shape and
    dtype come from a trace on fake tensors (no memory, no compute)."""
    from remat3d.instrument.state import recomputing
    from remat3d.runtime.tiling.trace import TilingError, trace

    device = device if device is not None else compute_device(fn, inputs)
    with recomputing():
        tr = trace(fn, inputs, device)
    if tr.returns_tuple:
        what, fix = ("kept in host memory", "host=False") if host else ("fused", "fuse=False")
        raise TilingError(f"Tiled region {label or fn!r} returns several tensors; only a "
                          f"region with one output can be {what}. Set {fix}.")
    return Deferred(fn, inputs, tile, tr.out_shapes[0], tr.out_dtypes[0], device, label,
                    host, stash, stash_norms)

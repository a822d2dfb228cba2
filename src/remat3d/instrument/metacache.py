"""Meta kernels answered by shape: a functional op's outputs on meta depend only on metadata.

NOTE [ Meta kernel cache ]
  A verified plan is a whole training step run on the meta device, and the planner runs
  dozens of them; a tiled region alone runs its ops once per tile and pass. Most of that
  time is torch's meta kernels, many of them Python (``torch._refs`` / ``_prims``: about
  0.4 ms for an elementwise ``add``). On meta there is no data, so an op that neither
  mutates nor aliases its arguments produces outputs whose shapes, strides and dtypes are
  a function of its arguments' metadata and its other arguments. ``MetaKernelCache``
  remembers that function: the first call runs the kernel and records its outputs'
  metadata; a later call with the same key makes fresh outputs with
  ``aten.empty_strided`` and skips the kernel. (FakeTensorMode's dispatch cache is the
  same idea for fake tensors; its bypass rules are the model for these.)
  An op is answered from the cache only when all of these hold, else its kernel runs:
  1. its schema mutates nothing and no return aliases an argument (no views, no
     in-place or out= ops), and it is not tagged random, data-dependent, or of dynamic
     output shape;
  2. the caller is the innermost dispatch mode (nothing below it that must see the op)
     and every tensor argument is a plain strided ``torch.Tensor`` on meta (no fake or
     other subclass tensor, no real tensor whose data could matter);
  3. every other argument is a plain value (number, bool, string, None, dtype, device,
     layout, memory format, or a list/tuple of them): the key is exact, types included;
  4. when recorded, every output is a fresh dense tensor (its storage exactly spans its
     strides from offset 0, shared with no argument and no other output) or None.
  5. In-place ops (``leaky_relu_``, ``add_``, ``copy_``: nnU-Net's activations are
     in place, and on meta each ran torch's Python reference, about 0.7 ms) are answered
     too: their one mutated argument is ``self``, the first, and their one return is it.
     On meta they change nothing but that tensor's version counter, which autograd
     bumps above this mode; so a later call with the same key returns ``self`` and skips
     the kernel. Recorded only when the kernel returned ``self`` itself with its shape,
     strides and offset unchanged; never for ops that may change a tensor's metadata or
     storage (``inplace_view`` tags, ``resize_``, ``set_``) or draw random numbers.
  The cache is bounded (emptied when it reaches ``limit`` entries) and holds no tensors,
  so it keeps no memory alive; it lives for the process (``META_KERNELS``), as meta
  kernels do.
"""

from __future__ import annotations

from typing import Any

import torch

from remat3d.instrument.tensors import tensors_in

__all__ = ["META_KERNELS", "MetaKernelCache"]

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)
_PLAIN_TYPES = frozenset(_PLAIN)  # exactly these (a subclass takes the isinstance path)
_BYPASS_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.data_dependent_output,
                torch.Tag.dynamic_output_shape, torch.Tag.inplace_view)

_EMPTY = torch.ops.aten.empty_strided.default
_META = torch.device("meta")

_Spec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype] | None


class _Unkeyable(Exception):
    pass


# in-place ops that may change their tensor's storage or shape (rule 5)
_RESHAPING = ("set_", "resize_", "resize_as_", "resize_as_sparse_", "_resize_output_")

_FUNCTIONAL, _INPLACE = "functional", "inplace"


def _cacheable_op(func: torch._ops.OpOverload) -> str | None:
    """Which rule lets ``func`` be cached: 1 (functional), 5 (in place), or none."""
    schema = func._schema
    if any(tag in func.tags for tag in _BYPASS_TAGS):
        return None
    if schema.is_mutable:
        return _INPLACE if _inplace_on_self(func) else None
    if any(r.alias_info is not None for r in schema.returns):
        return None
    ok = bool(schema.returns) and all(
        str(r.type) in ("Tensor", "Optional[Tensor]", "List[Tensor]") for r in schema.returns)
    return _FUNCTIONAL if ok else None


def _inplace_on_self(func: torch._ops.OpOverload) -> bool:
    """One mutated argument, the first (``self``), and one return, that argument."""
    schema = func._schema
    if func._schema.name.split("::")[-1] in _RESHAPING or not schema.arguments:
        return False
    first, *rest = schema.arguments
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if written != [first] or first.name != "self" or any(a.alias_info for a in rest):
        return False
    if len(schema.returns) != 1 or str(schema.returns[0].type) != "Tensor":
        return False
    out = schema.returns[0].alias_info
    return out is not None and out.is_write and set(out.before_set) == set(
        first.alias_info.before_set)


def _key_of(value: Any, parts: list[Any]) -> None:
    if type(value) is torch.Tensor:
        if value.device.type != "meta" or value.layout is not torch.strided:
            raise _Unkeyable
        parts.append((value.shape, value.stride(), value.storage_offset(), value.dtype))
    elif isinstance(value, (list, tuple)):
        parts.append((type(value), len(value)))
        for v in value:
            kind = type(v)
            if kind in _PLAIN_TYPES:  # the ints of shapes, mostly: as below, in line
                parts.append((kind, v))
            else:
                _key_of(v, parts)
    elif isinstance(value, _PLAIN):
        parts.append((type(value), value))
    else:  # a subclass tensor, a SymInt, a generator, anything else: not keyed
        raise _Unkeyable


def _dense(t: torch.Tensor) -> bool:
    if t.storage_offset() != 0:
        return False
    span = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() == span * t.element_size()


def _describe(out: Any, inputs: set[int]) -> list[_Spec] | None:
    leaves = list(out) if isinstance(out, (tuple, list)) else [out]
    specs: list[_Spec] = []
    seen = set(inputs)
    for t in leaves:
        if t is None:
            specs.append(None)
            continue
        if type(t) is not torch.Tensor or t.device.type != "meta" or not _dense(t):
            return None
        storage = t.untyped_storage()._cdata
        if storage in seen:
            return None
        seen.add(storage)
        specs.append((tuple(t.shape), tuple(t.stride()), t.dtype))
    return specs


class MetaKernelCache:
    """See NOTE [ Meta kernel cache ]."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self.limit = limit
        self._ops: dict[torch._ops.OpOverload, str | None] = {}
        self._table: dict[tuple[Any, ...], tuple[type | None, list[_Spec]]] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._table)

    def __call__(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)``, from the cache where the NOTE allows."""
        key = self._key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        hit = self._table.get(key)
        if hit is not None:
            self.hits += 1
            kind, specs = hit
            if kind is None:  # in place (rule 5): the tensor it was given
                return args[0]
            # the aten op itself: no torch-function mode (autocast, tiling) sees it
            outs = [None if s is None else _EMPTY(s[0], s[1], dtype=s[2], device=_META)
                    for s in specs]
            return outs[0] if kind is torch.Tensor else kind(outs)
        self.misses += 1
        if self._ops[func] == _INPLACE:
            return self._inplace(func, args, kwargs, key)
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage()._cdata for t in tensors_in((args, kwargs))}
        specs = _describe(out, inputs)
        if specs is not None:
            self._remember(key, torch.Tensor if isinstance(out, torch.Tensor) else type(out),
                           specs)
        return out

    def _remember(self, key: tuple[Any, ...], kind: type | None, specs: list[_Spec]) -> None:
        """Record an answer (``kind`` None: in place, rule 5); bounded by ``limit``."""
        if len(self._table) >= self.limit:
            self._table.clear()
        self._table[key] = (kind, specs)

    def _inplace(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict,
                 key: tuple[Any, ...]) -> Any:
        """Run an in-place kernel; remember it when it returned ``self`` unchanged in
        metadata (rule 5)."""
        self_ = args[0]
        before = (self_.shape, self_.stride(), self_.storage_offset(),
                  self_.untyped_storage()._cdata)
        out = func(*args, **kwargs)
        if out is self_ and before == (self_.shape, self_.stride(), self_.storage_offset(),
                                       self_.untyped_storage()._cdata):
            self._remember(key, None, [])
        return out

    def _key(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict
             ) -> tuple[Any, ...] | None:
        if func in self._ops:
            ok = self._ops[func]
        else:
            ok = self._ops[func] = _cacheable_op(func)
        if ok is None or torch._C._len_torch_dispatch_stack() > 0:
            return None
        if ok == _INPLACE and not args:
            return None
        parts: list[Any] = [func]
        try:
            _key_of(args, parts)
            _key_of(sorted(kwargs.items()), parts)
        except _Unkeyable:
            return None
        return tuple(parts)


META_KERNELS = MetaKernelCache()

"""Which module invocations can run tiled: traced on fake tensors during one meta forward.

The planner (torch-free) needs a yes/no per stage; this answers it on the torch side by
running the model's forward once on the meta device and, when a candidate invocation
starts, tracing that module on its arguments (``trace.trace``: fake tensors, no memory).
An invocation called with keyword arguments, or whose ops are not spatially local
(``TilingError``), is not tileable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat3d.instrument.amp import MetaAutocast, amp_dtype
from remat3d.instrument.state import recomputing
from remat3d.instrument.step import example_input, input_dtype, meta_copy
from remat3d.runtime.tiling.trace import TilingError, trace

__all__ = ["tileable"]


def tileable(model: nn.Module, examples: Sequence[torch.Tensor | Sequence[int]], amp: str | None,
             invocations: Sequence[tuple[str, int]]) -> list[bool]:
    """For each ``(module name, call index)``: can that invocation run tiled?"""
    copy_ = meta_copy(model)
    copy_.train()
    modules = dict(copy_.named_modules())
    wanted = {key: i for i, key in enumerate(invocations)}
    answer = [False] * len(invocations)
    calls: dict[str, int] = {}
    busy = [False]
    handles = []

    def hook(name: str) -> Any:
        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if busy[0]:
                return
            index = calls.get(name, 0)
            calls[name] = index + 1
            slot = wanted.get((name, index))
            if slot is None or kwargs or not args or not all(
                    isinstance(a, torch.Tensor) and a.dim() == 5 for a in args):
                return
            busy[0] = True
            try:
                with recomputing():
                    result = trace(module, list(args))
                answer[slot] = not result.returns_tuple
            except (TilingError, RuntimeError, TypeError, ValueError):
                answer[slot] = False
            finally:
                busy[0] = False

        return pre

    for name in {n for n, _ in invocations}:
        if name in modules:
            handles.append(modules[name].register_forward_pre_hook(hook(name),
                                                                   with_kwargs=True))
    try:
        dtype = input_dtype(copy_)
        inputs = [example_input(x, "meta", dtype).detach() for x in examples]
        dtype = amp_dtype(amp)
        with torch.no_grad(), MetaAutocast(dtype) if dtype else contextlib.nullcontext():
            copy_(*inputs)
    finally:
        for h in handles:
            h.remove()
    return answer

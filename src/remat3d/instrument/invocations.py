"""Which module invocation is running: in forward, and (harder) in backward.

Forward is easy: module pre/post hooks keep a stack. Backward runs autograd nodes, not
modules; we attribute each backward op to the invocation whose forward created the autograd
node being executed.

NOTE [ Attributing backward ops by sequence number ]
  1. Autograd numbers every node it creates from a per-thread counter
     (``torch._C._autograd._get_sequence_nr()`` reads it). An invocation's forward creates
     exactly the nodes numbered ``[counter at pre-hook, counter at post-hook)``.
  2. Ranges of nested invocations nest. Children finish first, so when each invocation
     ends it claims the numbers in its range that no child claimed: every number ends up
     owned by the innermost invocation that created it.
  3. In backward, ``torch._C._current_autograd_node()`` is the node being executed; its
     ``_sequence_nr()`` looks up the owner. Nodes created outside the model (the loss) and
     ``AccumulateGrad`` have no owner and are attributed to ``None``.
  4. A module forward that starts during backward is a recomputation (checkpointing): it
     becomes an invocation of phase ``"recompute"`` and claims its own new numbers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["Invocation", "InvocationRecorder"]


@dataclass
class Invocation:
    """One call of one module (a module called twice is two invocations)."""

    id: int
    name: str  # qualified module name; "" is the model itself
    module_type: str
    call_index: int  # 0 for the first call of this module in this phase, 1 for the second...
    parent: int | None
    depth: int
    phase: str  # "forward" or "recompute"
    seq_start: int = 0
    seq_end: int = 0
    timeline_start: int = 0  # index of the first timeline event inside the invocation
    timeline_end: int = 0  # one past the last
    live_at_entry: int = 0
    output_uids: list[int] = field(default_factory=list)
    output_bytes: int = 0
    param_bytes: int = 0  # the module's own parameters (not its children's)
    output_shape: list[int] | None = None
    output_dtype: str | None = None
    children: list[int] = field(default_factory=list)
    writes_input: bool = False  # wrote in place into a tensor it was called with


class InvocationRecorder:
    """Install hooks on every submodule of a model and record its invocations."""

    def __init__(
        self,
        model: nn.Module,
        phase: Callable[[], str],
        on_enter: Callable[[Invocation], None],
        on_exit: Callable[[Invocation, Any], None],
    ) -> None:
        self.invocations: list[Invocation] = []
        self._phase = phase
        self._on_enter = on_enter
        self._on_exit = on_exit
        self._stack: list[int] = []
        # per open invocation: the tensors it was called with and their versions then
        self._inputs: list[list[tuple[weakref.ref[torch.Tensor], int]]] = []
        self._owner: dict[int, int] = {}  # autograd sequence number -> invocation id
        self._calls: dict[tuple[str, str], int] = {}
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            self._handles.append(
                module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(
                    self._post_hook(), with_kwargs=True, always_call=True
                )
            )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre_hook(self, name: str) -> Callable[..., None]:
        own: list[int] = []  # the module's own parameter bytes, counted at its first call

        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if not own:
                own.append(sum(p.numel() * p.element_size()
                               for p in module.parameters(recurse=False)))
            phase = "recompute" if self._phase() != "forward" else "forward"
            key = (name, phase)
            call_index = self._calls.get(key, 0)
            self._calls[key] = call_index + 1
            parent = self._stack[-1] if self._stack else None
            inv = Invocation(
                id=len(self.invocations),
                name=name,
                module_type=type(module).__name__,
                call_index=call_index,
                parent=parent,
                depth=len(self._stack),
                phase=phase,
                seq_start=torch._C._autograd._get_sequence_nr(),
                param_bytes=own[0],
            )
            if parent is not None:
                self.invocations[parent].children.append(inv.id)
            self.invocations.append(inv)
            self._stack.append(inv.id)
            # held weakly: a measurement must not keep an input alive longer than the step;
            # read below tensor subclasses (a pending fused tiled output would compute)
            with torch._C.DisableTorchFunctionSubclass():
                self._inputs.append([(weakref.ref(t), t._version)
                                     for t in tree_leaves((args, kwargs))
                                     if isinstance(t, torch.Tensor) and not t.is_inference()])
            self._on_enter(inv)

        return hook

    def _post_hook(self) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not self._stack:
                return
            inv = self.invocations[self._stack.pop()]
            with torch._C.DisableTorchFunctionSubclass():
                inv.writes_input = any((t := ref()) is not None and t._version != version
                                       for ref, version in self._inputs.pop())
            inv.seq_end = torch._C._autograd._get_sequence_nr()
            for seq in range(inv.seq_start, inv.seq_end):
                self._owner.setdefault(seq, inv.id)
            self._on_exit(inv, output)

        return hook

    def current(self) -> int | None:
        """The innermost invocation the op being dispatched belongs to."""
        if self._stack:
            return self._stack[-1]
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        return self._owner.get(node._sequence_nr())

    def ancestors(self, inv_id: int | None) -> list[int]:
        """``inv_id`` and every invocation enclosing it, innermost first."""
        chain: list[int] = []
        while inv_id is not None:
            chain.append(inv_id)
            inv_id = self.invocations[inv_id].parent
        return chain

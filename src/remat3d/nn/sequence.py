"""``ReversibleSequence``: reversible blocks whose activations are rebuilt, not kept.

An ordinary chain of residual blocks keeps every block's intermediate tensors for backward,
so its activation memory grows with depth. A :class:`ReversibleSequence` keeps only its
final output: backward walks the blocks in reverse, rebuilds each block's input from its
output, and computes the block's gradients on the way (one extra forward of F and G).

NOTE [ Reversible backward ]
  ``_ReversibleFunction`` is a ``torch.autograd.Function`` whose forward runs every block
  under ``no_grad`` and saves only the output (through ``save_for_backward``, so a
  checkpoint region around the sequence can drop and recompute it too). Its rules:
  1. Parameters get gradients because they are *inputs* of the Function: its backward
     returns their gradients, and autograd accumulates them as for any op. Chosen over
     calling ``backward()`` inside backward: ``torch.autograd.grad(loss, params)`` then
     returns the right values instead of writing ``.grad``, and gradient hooks (DDP) fire
     once per parameter through the ordinary ``AccumulateGrad`` nodes.
  2. Backward re-runs F and G, so it is a recomputation: ``is_recomputing()`` is True, the
     tracker labels those ops "recompute", and every buffer of a block (BatchNorm running
     statistics) is snapshotted before the block's backward and restored after it
     (``BufferGuard``): statistics change once per step, in the forward.
  3. Random draws repeat: each F/G call that drew random numbers in forward had the RNG
     state before it recorded (``RngTape``), and its backward run starts from that state
     (the caller's RNG state is unchanged by backward).
  4. Autocast repeats: its state at forward (CPU, the input's device, our meta-device
     autocast) is re-entered for backward, as ``torch.utils.checkpoint`` does.
  5. Blocks never write into their input (a coupling checks F and G), and the Function's
     output is a new tensor; writing into the *output* in place afterwards is caught by
     autograd's saved-tensor version check.
  6. One pass per block (Gomez et al. 2017, Algorithm 1): G runs once, with grad, on the
     output half y1; its output both rebuilds x2 and gives G's local gradients; then F
     likewise on the rebuilt x2. Inverting without grad first and re-running the block
     for gradients would cost two extra forwards of F and G instead of one.
  7. Exactness: inversion is exact in real arithmetic; in floating point the rebuilt
     input differs from the original by rounding (about 1e-7 relative in fp32 per block),
     so gradients match an ordinary network to a stated tolerance, not bitwise.
     Keep the residual stream in fp32 under autocast (F and G may compute in bf16/fp16):
     a bf16 stream loses about 2^-8 relative per block on inversion.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from remat3d.instrument.state import recomputing
from remat3d.nn.coupling import Coupling, ReversibleBlock, ReversibleError
from remat3d.runtime.guards import BufferGuard, ModuleStack
from remat3d.runtime.replay import AmpState, RngTape

__all__ = ["ReversibleSequence"]


class ReversibleSequence(nn.Module):
    """Reversible blocks in sequence; only the final output is kept for backward.

    Args:
        blocks: :class:`~remat3d.nn.ReversibleBlock` instances (couplings), applied in order.
        reversible: ``False`` runs the same blocks as an ordinary network (autograd keeps
            everything): the reference for gradients and memory.
        preserve_rng_state: replay random draws (dropout) in backward; turn off only when
            F and G draw nothing, to skip the RNG-state comparison per call.

    >>> import torch
    >>> from torch import nn
    >>> from remat3d.nn import AdditiveCoupling, ReversibleSequence
    >>> def half():
    ...     return nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), nn.GroupNorm(1, 2), nn.ReLU())
    >>> seq = ReversibleSequence(*[AdditiveCoupling(half(), half()) for _ in range(4)])
    >>> x = torch.randn(1, 4, 8, 8, 8, requires_grad=True)
    >>> seq(x).sum().backward()
    >>> x.grad.shape
    torch.Size([1, 4, 8, 8, 8])
    """

    def __init__(self, *blocks: ReversibleBlock, reversible: bool = True,
                 preserve_rng_state: bool = True) -> None:
        super().__init__()
        if len(blocks) == 1 and isinstance(blocks[0], (list, tuple)):
            blocks = tuple(blocks[0])
        if not blocks:
            raise ReversibleError("ReversibleSequence needs at least one block, got none.")
        for i, block in enumerate(blocks):
            if not isinstance(block, ReversibleBlock):
                raise ReversibleError(
                    f"Block {i} of ReversibleSequence is a {type(block).__name__}, which "
                    "cannot rebuild its input from its output. Use AdditiveCoupling(F, G) or "
                    "AffineCoupling(F, G) (F, G: any modules), or subclass ReversibleBlock "
                    "and implement forward() and inverse()."
                )
        self.blocks = nn.ModuleList(blocks)
        self.reversible = reversible
        self.preserve_rng_state = preserve_rng_state

    def __len__(self) -> int:
        return len(self.blocks)

    def extra_repr(self) -> str:
        return "" if self.reversible else "reversible=False"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [p for p in self.parameters() if p.requires_grad]
        needs_graph = torch.is_grad_enabled() and (x.requires_grad or bool(params))
        if not self.reversible or not needs_graph:
            return _run_blocks(self.blocks, x, None)
        out: torch.Tensor = _ReversibleFunction.apply(x, self, *params)
        return out

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """The input that produced ``y`` (no RNG replay: for deterministic blocks)."""
        state: State = y
        for block in reversed(self.blocks):
            assert isinstance(block, ReversibleBlock)
            state = block.inverse(_state_for(block, state))
        return _whole(state)


State = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _state_for(block: nn.Module, state: State) -> State:
    """Couplings take pairs of halves (no concatenation between them); others tensors."""
    return _pair(block, state) if isinstance(block, Coupling) else _whole(state)


def _pair(block: Coupling, state: State) -> tuple[torch.Tensor, torch.Tensor]:
    return state if isinstance(state, tuple) else block.split(state)


def _whole(state: State) -> torch.Tensor:
    return torch.cat(state, dim=1) if isinstance(state, tuple) else state


def _run_blocks(blocks: nn.ModuleList, x: torch.Tensor,
                tapes: list[RngTape | None] | None) -> torch.Tensor:
    state: State = x
    for i, block in enumerate(blocks):
        tape = tapes[i] if tapes is not None else None
        state = block(_state_for(block, state)) if tape is None else \
            block(_state_for(block, state), tape)
    return _whole(state)


class _ReversibleFunction(torch.autograd.Function):
    """See NOTE [ Reversible backward ]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seq: ReversibleSequence,  # type: ignore[override]
                *params: nn.Parameter) -> torch.Tensor:
        ctx.seq = seq
        ctx.amp = AmpState.capture(x.device)
        ctx.tapes = [RngTape(x.device) if seq.preserve_rng_state else None for _ in seq.blocks]
        ctx.index = {id(p): i for i, p in enumerate(params)}
        # Detached: views of a tensor that requires grad, made under no_grad, confuse
        # module hooks that look for grad_fn (FlopCounterMode's module tracker).
        x = x.detach()
        y = _run_blocks(seq.blocks, x, ctx.tapes)
        if y is x:  # a block returned its input: give autograd a tensor of our own
            y = x.clone()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (y,) = ctx.saved_tensors
        grads: list[torch.Tensor | None] = [None] * len(ctx.index)
        blocks = list(zip(ctx.seq.blocks, ctx.tapes))
        state: State = y
        dstate: State = dy
        del y, dy
        with recomputing(), ctx.amp.restore():
            for block, tape in reversed(blocks):
                params = [p for p in block.parameters() if id(p) in ctx.index]
                modules = ModuleStack()
                with modules, BufferGuard(modules, root=block):
                    if isinstance(block, Coupling):
                        # hand over the only references, so halves die as soon as they can
                        work = [*_pair(block, state), *_pair(block, dstate)]
                        del state, dstate
                        x1, x2, dx1, dx2, block_grads = block.reverse_pair(work, tape, params)
                        state, dstate = (x1, x2), (dx1, dx2)
                        del x1, x2, dx1, dx2
                    else:
                        state, dstate, block_grads = block.reverse(
                            _whole(state), _whole(dstate), tape, params)
                for p, g in zip(params, block_grads):
                    if g is None:
                        continue
                    i = ctx.index[id(p)]
                    previous = grads[i]
                    grads[i] = g if previous is None else previous + g
        dx = _whole(dstate) if ctx.needs_input_grad[0] else None
        return (dx, None, *grads)


"""Reversible blocks: couplings over a channel split, whose input follows from their output.

A coupling splits its input ``x`` along channels into halves ``x1, x2`` and computes

    y1 = couple(x1, F(x2)),   y2 = couple(x2, G(y1))

for any modules ``F`` and ``G``. ``couple(a, h)`` is invertible in ``a`` for a given ``h``, so
``x2 = uncouple(y2, G(y1))`` and then ``x1 = uncouple(y1, F(x2))``: the input is rebuilt
from the output, whatever F and G are (Gomez et al. 2017, "The Reversible Residual
Network"). :class:`AdditiveCoupling` adds (``couple(a, h) = a + h``);
:class:`AffineCoupling` scales and shifts.

On their own, couplings are ordinary modules (autograd keeps what F and G save). Inside a
:class:`~remat3d.nn.ReversibleSequence` they keep nothing: backward calls
:meth:`ReversibleBlock.reverse` on each block's output.

>>> import torch
>>> from torch import nn
>>> block = AdditiveCoupling(nn.Conv3d(2, 2, 3, padding=1), nn.Conv3d(2, 2, 3, padding=1))
>>> x = torch.randn(1, 4, 8, 8, 8)
>>> with torch.no_grad():
...     err = (block.inverse(block(x)) - x).abs().max().item()
>>> err < 1e-5
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat3d.errors import ReversibleError
from remat3d.instrument.state import module_name
from remat3d.runtime.replay import RngTape
from remat3d.units import format_shape

__all__ = ["AdditiveCoupling", "AffineCoupling", "Coupling", "ReversibleBlock",
           "ReversibleError"]

Grads = list[torch.Tensor | None]
Pair = tuple[torch.Tensor, torch.Tensor]


def _name(module: nn.Module) -> str:
    name = module_name(module)
    kind = type(module).__name__
    return kind if name == kind else f"{name} ({kind})"


def _grad_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class ReversibleBlock(nn.Module):
    """A module whose input can be computed from its output (the base class's contract).

    Subclasses implement :meth:`forward` (with an optional :class:`~remat3d.runtime.replay.RngTape`
    to record random draws in) and :meth:`inverse`. The default :meth:`reverse` inverts the
    output without grad, then runs forward again on the rebuilt input to get gradients (two
    passes); :class:`Coupling` overrides it with a one-pass version.
    """

    # read by runtime/tiling/trace.py: a tile with halos cannot be inverted on its own
    _remat3d_untileable = ("it rebuilds its input from its whole output in backward, and "
                           "its functions must keep their input's size")

    def forward(self, x: Any, tape: RngTape | None = None) -> Any:
        raise NotImplementedError

    def inverse(self, y: Any, tape: RngTape | None = None) -> Any:
        raise NotImplementedError

    def reverse(self, y: torch.Tensor, dy: torch.Tensor, tape: RngTape | None,
                params: Sequence[nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor, Grads]:
        """From output ``y`` and its gradient ``dy``: the input, its gradient, ``params``' grads.

        Called by the sequence's backward with grad mode off; ``params`` are the block's
        parameters that require grad.
        """
        with torch.no_grad():
            x = self.inverse(y, tape)
        with torch.enable_grad(), tape.replaying() if tape else contextlib.nullcontext():
            x.requires_grad_(True)
            y_again = self.forward(_nonleaf(x), tape)
        dx, *grads = torch.autograd.grad(y_again, [x, *params], dy, allow_unused=True)
        return x.detach(), dx, list(grads)


class Coupling(ReversibleBlock):
    """``y1 = couple(x1, F(x2)); y2 = couple(x2, G(y1))`` over a channel split (dim 1).

    Subclasses define :meth:`couple`, :meth:`uncouple` (its inverse in the first argument)
    and :meth:`expected_shape` (what F and G must return for a half of a given shape);
    :meth:`couple_vjp` may be overridden with a closed form.

    A coupling takes and returns either a whole tensor or a pair of halves ``(x1, x2)``:
    a :class:`~remat3d.nn.ReversibleSequence` passes pairs from block to block, so the
    halves are never concatenated in between.
    """

    def __init__(self, F: nn.Module, G: nn.Module) -> None:
        super().__init__()
        if not isinstance(F, nn.Module) or not isinstance(G, nn.Module):
            raise ReversibleError(
                f"{type(self).__name__} takes two nn.Modules F and G, got "
                f"{type(F).__name__} and {type(G).__name__}."
            )
        self.F = F
        self.G = G

    # -- the coupling law ---------------------------------------------------------------
    def couple(self, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def uncouple(self, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def expected_shape(self, half: torch.Size) -> tuple[int, ...]:
        return tuple(half)

    def couple_vjp(self, a: torch.Tensor, h: torch.Tensor,
                   db: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of ``couple(a, h)`` with respect to ``a`` and ``h``, given ``db``."""
        with torch.enable_grad():
            a = a.detach().requires_grad_(True)
            h = h.detach().requires_grad_(True)
            da, dh = torch.autograd.grad(self.couple(a, h), [a, h], db)
        return da, dh

    # -- forward and inverse ------------------------------------------------------------
    def split(self, x: torch.Tensor) -> Pair:
        """The two channel halves of ``x`` (views)."""
        if x.dim() < 2 or x.shape[1] % 2:
            got = f"{x.shape[1]} channels" if x.dim() >= 2 else f"{x.dim()}-D input"
            raise ReversibleError(
                f"{_name(self)} splits its input into two equal channel halves (dim 1), so it "
                f"needs an even channel count; got {got} in a {format_shape(x.shape)} tensor. Give "
                "it an even number of channels (e.g. a 1x1 convolution before it)."
            )
        x1, x2 = x.chunk(2, dim=1)
        return x1, x2

    def _call(self, role: str, half: torch.Tensor, tape: RngTape | None) -> torch.Tensor:
        module = self.F if role == "F" else self.G
        version = half._version
        with tape.record(role) if tape is not None else contextlib.nullcontext():
            h = module(half)
        if half._version != version:
            raise ReversibleError(
                f"{role} of {_name(self)} ({_name(module)}) wrote in place into its input, "
                f"which the coupling still needs (to couple it with the other half, and to "
                "rebuild it in backward). In-place ops are fine on tensors F and G make "
                "themselves (conv -> norm -> LeakyReLU(inplace=True)); make the first op "
                "that touches the input out-of-place (e.g. inplace=False)."
            )
        expected = self.expected_shape(half.shape)
        if not isinstance(h, torch.Tensor) or tuple(h.shape) != expected:
            got = format_shape(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise ReversibleError(
                f"{role} of {_name(self)} ({_name(module)}) must return a {format_shape(expected)} "
                f"tensor for its {format_shape(half.shape)} input half, so that the coupling "
                f"can be inverted; it returned {got}. Keep {role}'s channels and spatial size (no "
                "stride, 'same' padding); change resolution or width outside the coupling."
            )
        return h

    def forward(self, x: torch.Tensor | Pair, tape: RngTape | None = None) -> Any:
        """``x`` a tensor (returns a tensor) or a pair of halves (returns a pair)."""
        x1, x2 = x if isinstance(x, tuple) else self.split(x)
        y1 = self.couple(x1, self._call("F", x2, tape))
        y2 = self.couple(x2, self._call("G", y1, tape))
        return (y1, y2) if isinstance(x, tuple) else torch.cat([y1, y2], dim=1)

    def inverse(self, y: torch.Tensor | Pair, tape: RngTape | None = None) -> Any:
        """The input that produced ``y`` (exact in real arithmetic)."""
        y1, y2 = y if isinstance(y, tuple) else self.split(y)
        with tape.replay("G") if tape is not None else contextlib.nullcontext():
            x2 = self.uncouple(y2, self.G(y1))
        with tape.replay("F") if tape is not None else contextlib.nullcontext():
            x1 = self.uncouple(y1, self.F(x2))
        return (x1, x2) if isinstance(y, tuple) else torch.cat([x1, x2], dim=1)

    # -- backward -----------------------------------------------------------------------
    def reverse(self, y: torch.Tensor, dy: torch.Tensor, tape: RngTape | None,
                params: Sequence[nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor, Grads]:
        x1, x2, dx1, dx2, grads = self.reverse_pair([*self.split(y), *self.split(dy)], tape,
                                                    params)
        return torch.cat([x1, x2], dim=1), torch.cat([dx1, dx2], dim=1), grads

    def reverse_pair(self, work: list[torch.Tensor], tape: RngTape | None,
                     params: Sequence[nn.Parameter],
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Grads]:
        """:meth:`reverse` on halves: ``[y1, y2, dy1, dy2]`` -> ``x1, x2, dx1, dx2, grads``.

        ``work`` is emptied: each half is released as soon as it is no longer needed (the
        sequence hands over its only references), which lowers the backward peak.

        One forward of G and one of F, each with grad, both rebuild the input and give
        the local gradients (Gomez et al. 2017, Algorithm 1); for the additive law
        ``dz1 = dy1 + dG/dy1^T dy2, dx1 = dz1, dx2 = dy2 + dF/dx2^T dz1``.
        """
        y1, y2, dy1, dy2 = work
        work.clear()
        replay = tape.replay if tape is not None else _no_replay
        wanted = {id(p) for p in params}
        g_params = [p for p in _grad_params(self.G) if id(p) in wanted]
        f_params = [p for p in _grad_params(self.F) if id(p) in wanted]
        grads: dict[int, torch.Tensor] = {}

        with torch.enable_grad(), replay("G"):
            z1 = y1.detach().requires_grad_(True)
            g = self.G(_nonleaf(z1))
        with torch.no_grad():
            x2 = self.uncouple(y2, g)
        del y2
        dx2, dg = self.couple_vjp(x2, g, dy2)
        del dy2
        dz1_g, *dg_params = torch.autograd.grad(g, [z1, *g_params], dg, allow_unused=True)
        del g, z1, dg
        dz1 = dy1 if dz1_g is None else dy1 + dz1_g
        del dy1, dz1_g
        _collect(grads, g_params, dg_params)

        with torch.enable_grad(), replay("F"):
            x2.requires_grad_(True)
            f = self.F(_nonleaf(x2))
        with torch.no_grad():
            x1 = self.uncouple(y1, f)
        del y1
        dx1, df = self.couple_vjp(x1, f, dz1)
        del dz1
        dx2_f, *df_params = torch.autograd.grad(f, [x2, *f_params], df, allow_unused=True)
        del f, df
        _collect(grads, f_params, df_params)
        if dx2_f is not None:
            dx2 = dx2 + dx2_f
        return x1, x2.detach(), dx1, dx2, [grads.get(id(p)) for p in params]


def _nonleaf(t: torch.Tensor) -> torch.Tensor:
    # F and G get a view, not the leaf itself: module hooks that watch their inputs' grads
    # (torch's ModuleTracker, used by FlopCounterMode) fail on leaves inside autograd.grad.
    return t.view_as(t)


def _no_replay(key: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _collect(grads: dict[int, torch.Tensor], params: Sequence[nn.Parameter],
             new: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(params, new):
        if g is None:
            continue
        previous = grads.get(id(p))
        grads[id(p)] = g if previous is None else previous + g


class AdditiveCoupling(Coupling):
    """``y1 = x1 + F(x2); y2 = x2 + G(y1)`` (RevNet). F and G keep their input's shape.

    Args:
        F: any module mapping a half (``N x C/2 x ...``) to the same shape; conv-norm-
            activation stacks with BatchNorm, GroupNorm or InstanceNorm, in-place
            activations and dropout are all fine.
        G: the same, for the other half.
    """

    def couple(self, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return a + h

    def uncouple(self, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return b - h

    def couple_vjp(self, a: torch.Tensor, h: torch.Tensor,
                   db: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # d(a + h) passes db to both; cast as autograd would (h may be bf16 under autocast)
        return db.to(a.dtype), db.to(h.dtype)


class AffineCoupling(Coupling):
    """``y1 = x1 * s(F1) + F2`` with ``(F1, F2) = F(x2)`` split along channels; same for G.

    F and G return twice the channels of a half: a raw log-scale and a shift. The scale
    ``s = exp(clamp * tanh(raw / clamp))`` lies in ``[e^-clamp, e^clamp]`` (a soft clamp, as in
    invertible-network practice), so the division in the inverse stays well conditioned.

    Args:
        F: module mapping ``N x C/2 x ...`` to ``N x C x ...`` (log-scale, shift).
        G: the same, for the other half.
        clamp: bound on the log-scale (default 2).

    >>> import torch
    >>> from torch import nn
    >>> block = AffineCoupling(nn.Conv3d(2, 4, 1), nn.Conv3d(2, 4, 1))
    >>> x = torch.randn(2, 4, 4, 4, 4)
    >>> with torch.no_grad():
    ...     ok = torch.allclose(block.inverse(block(x)), x, atol=1e-5)
    >>> ok
    True
    """

    def __init__(self, F: nn.Module, G: nn.Module, *, clamp: float = 2.0) -> None:
        super().__init__(F, G)
        if not clamp > 0:
            raise ReversibleError(f"AffineCoupling's clamp must be positive, not {clamp!r}.")
        self.clamp = float(clamp)

    def _scale_shift(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raw, shift = h.chunk(2, dim=1)
        scale = torch.exp(self.clamp * torch.tanh(raw / self.clamp))
        return scale, shift

    def couple(self, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        scale, shift = self._scale_shift(h)
        return a * scale + shift

    def uncouple(self, b: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        scale, shift = self._scale_shift(h)
        return (b - shift) / scale

    def expected_shape(self, half: torch.Size) -> tuple[int, ...]:
        return (half[0], 2 * half[1], *half[2:])

    def extra_repr(self) -> str:
        return f"clamp={self.clamp}"


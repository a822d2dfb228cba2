"""What a reversible block's backward must replay from its forward: RNG and autocast.

A reversible sequence runs each F and G once in forward and once more in backward, on a
reconstructed input. For that second run to compute what the first computed,

- every random draw (dropout masks) must repeat: :class:`RngTape` keeps the RNG state from
  before each call that consumed randomness, and replays it;
- autocast must be as it was: :class:`AmpState` records it at forward and re-enters it,
  the way ``torch.utils.checkpoint`` does (and our meta-device autocast too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from remat3d.instrument.amp import MetaAutocast, active_meta_autocast

__all__ = ["AmpState", "RngTape"]

_RngState = tuple[torch.Tensor, torch.Tensor | None]


class RngTape:
    """RNG states recorded before calls that drew random numbers, replayed on demand.

    A call that draws nothing (convolutions, norms) leaves the RNG state unchanged, and
    nothing is kept for it: only dropout-like calls cost the 5 KB of a CPU RNG state.

    >>> tape = RngTape(torch.device("cpu"))
    >>> with tape.record("F"):
    ...     a = torch.rand(3)
    >>> with tape.replay("F"):
    ...     b = torch.rand(3)
    >>> torch.equal(a, b)
    True
    >>> with tape.record("G"):   # no draw: nothing kept
    ...     _ = a + 1
    >>> sorted(tape.states)
    ['F']
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device if device.type == "cuda" else None
        self.states: dict[str, _RngState] = {}
        self._replaying = False

    def _get(self) -> _RngState:
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None
        return cpu, cuda

    @staticmethod
    def _same(a: _RngState, b: _RngState) -> bool:
        # Compared as bytes, outside the dispatcher: no op shows up in a tracker or in a
        # recomputation's op-by-op check.
        return all(
            (x is None and y is None)
            or (x is not None and y is not None and x.numpy().tobytes() == y.numpy().tobytes())
            for x, y in zip(a, b)
        )

    @contextlib.contextmanager
    def record(self, key: str) -> Iterator[None]:
        """Run the body; keep the state from before it if the body drew random numbers.

        Inside :meth:`replaying`, replay the recorded state instead.
        """
        if self._replaying:
            with self.replay(key):
                yield
            return
        before = self._get()
        yield
        if not self._same(before, self._get()):
            self.states[key] = before

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Make :meth:`record` replay (a block's forward run again during backward)."""
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    @contextlib.contextmanager
    def replay(self, key: str) -> Iterator[None]:
        """Run the body from the state recorded for ``key``; the caller's state is kept."""
        state = self.states.get(key)
        if state is None:
            yield
            return
        devices = [self.cuda] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(state[0])
            if state[1] is not None and self.cuda is not None:
                torch.cuda.set_rng_state(state[1], self.cuda)
            yield


@dataclass
class AmpState:
    """Autocast as it was when a forward ran; :meth:`restore` re-enters it."""

    device_type: str | None  # the input's device type, when it has its own autocast
    device_kwargs: dict[str, Any] | None
    cpu_kwargs: dict[str, Any]
    meta_dtype: torch.dtype | None

    @classmethod
    def capture(cls, device: torch.device) -> AmpState:
        cache = torch.is_autocast_cache_enabled()
        device_type: str | None = None
        device_kwargs: dict[str, Any] | None = None
        if device.type not in ("cpu", "meta") and torch.amp.is_autocast_available(device.type):
            device_type = device.type
            device_kwargs = {"enabled": torch.is_autocast_enabled(device.type),
                             "dtype": torch.get_autocast_dtype(device.type),
                             "cache_enabled": cache}
        cpu_kwargs = {"enabled": torch.is_autocast_enabled("cpu"),
                      "dtype": torch.get_autocast_dtype("cpu"), "cache_enabled": cache}
        meta = active_meta_autocast()
        return cls(device_type, device_kwargs, cpu_kwargs, None if meta is None else meta.dtype)

    def restore(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.device_type is not None and self.device_kwargs is not None:
            stack.enter_context(torch.autocast(self.device_type, **self.device_kwargs))
        stack.enter_context(torch.autocast("cpu", **self.cpu_kwargs))
        if self.meta_dtype is not None:
            stack.enter_context(MetaAutocast(self.meta_dtype))
        return stack

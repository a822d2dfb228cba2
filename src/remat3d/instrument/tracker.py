"""The live-memory tracker: remat3d's single source of memory truth.

:class:`MemoryTracker` is a ``TorchDispatchMode``: it sees every aten op that runs while it
is active (forward, backward, recomputation; on meta, cpu or cuda tensors) and keeps

- live bytes per device, each storage counted once (see ``ledger.py``);
- a timeline: one event per op with the module invocation and phase it ran in and the
  live bytes before and after it (after = outputs allocated, inputs not yet released: the
  op's own high-water mark);
- the peak, split into parameters, buffers, inputs, gradients, activations saved for
  backward and transients;
- FLOPs per invocation and phase, and (optionally) op wall time;
- the tensors passed between module invocations in forward (the edges of the CostGraph).

Host memory on meta: a meta step has one device, so tensors that stand for host buffers
(tiled runs' host-resident outputs, ``runtime/tiling/host.py``) are booked under ``"cpu"``: those
made under ``placement("host")``, and the results of ops that read only host tensors
(autograd summing two host gradients), unless made under ``placement("device")``.
:attr:`MemoryTracker.host_peak_bytes` is their high-water mark.

NOTE [ Repeats on meta ]
  A tiled run on meta runs the same ops on tiles of the same shapes over and over (a 512³
  volume in 128³ tiles: 64 tiles a pass, 8 shapes by rule 6). On meta an op's effect on the
  tracker is a function of shapes alone, so a tile whose shapes were seen in the same
  pass need not run:
  1. The caller (``runtime/tiling/tiled.py``) names a piece of work by everything its ops
     depend on (each node's region sizes and which volume borders it touches) and
     brackets its first run with :meth:`MemoryTracker.begin_repeat` / ``end_repeat``.
  2. A run that ends with the live bytes it started with (device and host) is a
     :class:`Repeat`: its FLOPs per invocation and phase, its high-water mark above its
     start and the op and modules there. One that allocated or freed for good (a first
     tile making an accumulator) is not; the next tile of that shape is recorded
     instead.
  3. :meth:`MemoryTracker.replay` books a repeat again only where the live bytes now are
     at or below where it started, on the device and the host: its high-water mark then
     stays at or below the recorded one, which the peak already holds, so peaks and their
     breakdown cannot change. Its FLOPs are added as if it ran, and its timeline is one
     event, its high-water mark (what a window's peak and a later recording read of it:
     a replayed tile's thousand events cost more than all else a replay does).
  4. Only trackers made with ``replays=True`` (``measure()`` on meta: what plans are
     verified with) replay; ``profile()`` does not (a replayed tile makes no invocation
     records or edges). The caller still runs every tile whose side effects matter (the
     last tile of the pass that writes a tiled run's outputs: the buffers it updates).
  5. Across measurements (:func:`shared_repeats`, what ``remat3d.plan`` verifies its
     candidates under: dozens of steps whose tiled runs are mostly the same): a repeat is
     kept under a key its caller gives (everything the piece's ops depend on, the run and
     the pass included) and *booked* wherever that key comes again, in this step or a
     later one, at whatever the live bytes are (:meth:`MemoryTracker.book`): its
     high-water mark above its start is added to the live bytes now, on the device and
     the host, and raises the peak where it passes it, with the module the recorded run
     was in at its high-water named as the peak's. So the peak, host peak and FLOPs are
     the ones running it would give; the peak's breakdown counts that high-water as
     transient, its timeline is one event (its high-water mark), and that event and its
     FLOPs are attributed to the invocation running when it is booked.
  6. A tile at the far end of an axis (its output touches that axis's far border, not
     its near one) is keyed as its mirror image on that axis: every region's border
     flags swapped there (``runtime/tiling/tiled.py``, ``_shape``), the parts of rebuilt
     inputs it computes alike. Its ops are the mirror's, on tensors of the same shapes
     (a padding on the other side, a halo cropped from the other end), so it allocates,
     frees and counts what the mirror does: the near and far edges of a 4-tile axis are
     one shape, not two (a 512³ volume in 128³ tiles: 8 shapes a pass, not 27). The
     first tile of a pass still runs: it makes the pass's accumulators, which its
     mirror, recorded after them, does not.
  7. A run whose ops treat the three axes alike (every window parameter the same on
     each axis, every node cubic: ``tiled._isotropic``) and whose tile is cubic keys a
     tile by the order of its axes that sorts first, the same order for every region
     (the regions of the rebuilt inputs it computes in parts too, where their runs' ops
     are alike on every axis: ``TileSource.isotropic``): a tile and one with its axes
     swapped run the same ops on tensors of the same sizes (permuted extents), so they
     allocate, free and count alike. Where a stride-2 convolution makes the far edge no
     mirror of the near one (3 kinds of position an axis, 27 shapes a pass), 10 shapes
     are recorded, not 27. A tile with a region that spans a whole axis keeps its own
     order (which axis is whole decides whether a view is contiguous, so whether an op
     copies it).
  8. A pass's key names what its tiles do with stashes (ops skipped or read from one,
     the stashes read and written, host or device: ``tiled._stashing_key``), not which
     stashes the run has: the passes before a run's first stash, and its final backward
     pass (which reads none), are the same ops whatever is stashed, and a plan that
     stashes one more normalisation re-records only the passes that change (the
     stashes are made and freed between passes, outside any tile's record).
  9. Within a pass, every tile after the first (which makes the accumulators) and before
     the last that runs ends where it started, so each starts where the one before it
     did. A pass whose such tiles all left a repeat (run, replayed or booked) at one live
     level keeps them under its key as a :class:`RepeatSeries`
     (``tiled._Repeats.to_run``); a later pass with that key, in this step or another
     within ``shared_repeats()``, books the series at once (:meth:`MemoryTracker.
     book_series`): one lookup and one timeline event, at its highest high-water mark
     (the first tile's that reaches it), its FLOPs summed. Booked one by one they would
     raise the peak to the same mark, named after the same tile, with the same host
     peak, FLOPs and window peaks. Where that might pass a limit of ``stop_above()``
     they are booked one by one, so a bounded measurement stops where it did. ResEnc-L
     at 512³ bf16 books some 31,700 tiles in each verification of its 12 GiB plan; one
     lookup a pass instead of one a tile took a fully booked verification from 2.8 to
     1.9 s.
  10. Within ``shared_repeats()`` a tiled run's geometry (where its tiles lie, what each
     node computes for each, each tile's key: ``tiled._Geometry``), a function of its
     trace and tile alone, is kept under its digest (:func:`shared_value`) and not
     worked out again for the next candidate with that run (ResEnc-L at 512³: some
     0.3 s of each verification).
  Equal peaks, FLOPs, window peaks and the timeline's high-water marks with and
  without replay are tested on tiled plans
  (``tests/tiling/test_repeats.py``), and equal peaks, peak modules, host peaks, FLOPs
  and window peaks with and without booking across measurements, series included.

What it cannot see: scratch memory a kernel allocates and frees inside one op (cuDNN/oneDNN
workspaces, im2col buffers). That is a property of the kernel library, not of the model or
the plan; ``reference.py`` measures it separately on CPU.

>>> import torch
>>> with MemoryTracker("meta") as tracker:
...     x = torch.empty(1024, device="meta")   # 4 KiB
...     y = x.view(32, 32)                     # a view: no new memory
...     z = x * 2                              # 4 KiB more
>>> tracker.peak_bytes
8192
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

from remat3d.instrument.flops import op_flops
from remat3d.instrument.invocations import Invocation, InvocationRecorder
from remat3d.instrument.ledger import StorageLedger, StorageRecord
from remat3d.instrument.metacache import META_KERNELS
from remat3d.instrument.state import current_placement, is_recomputing
from remat3d.instrument.tensors import tensors_in

__all__ = ["HOST", "PEAK_CATEGORIES", "EdgeRecord", "LimitExceeded", "MemoryTracker",
           "PeakTensor", "Repeat", "RepeatSeries", "TimelineEvent",
           "active_tracker", "replaying_tracker", "shared_repeat", "shared_repeats",
           "shared_series", "shared_value", "stop_above"]

T = TypeVar("T")

HOST = "cpu"  # where host-resident tensors of a meta step are booked

PEAK_CATEGORIES = ("parameters", "buffers", "inputs", "outputs", "gradients", "optimizer",
                   "saved", "transient")
_CATEGORY_OF = {
    "param": "parameters",
    "buffer": "buffers",
    "input": "inputs",
    "output": "outputs",  # the model's output, held through backward (step.py's NOTE)
    "grad": "gradients",
    "optimizer": "optimizer",  # optimizer state registered by a training loop
    "saved": "saved",
    "activation": "transient",
}


@dataclass(frozen=True)
class PeakTensor:
    """One storage live at the peak: its bytes, its :data:`PEAK_CATEGORIES` category,
    the module whose invocation made it (innermost; "" the model's own forward; None:
    outside every module, before the step, or no model recorded) and the phase it was
    made in ("forward", "backward", "recompute", "setup")."""

    nbytes: int
    category: str
    made_by: str | None
    phase: str


@dataclass(slots=True)  # millions of them in a verified 512³ step
class TimelineEvent:
    """One op: where it ran and the live bytes (on the tracked device) around it."""

    op: str
    node: int | None
    phase: str  # "forward", "backward" or "recompute"
    live_before: int
    live_after: int


@dataclass
class EdgeRecord:
    """A tensor made by one invocation (or the model input, ``src=-1``) read by another."""

    src: int
    dst: int
    bytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Repeat:
    """What one run of a repeatable piece of a meta step did (NOTE [ Repeats on meta ]):
    the live bytes it started and ended at, its FLOPs, and its high-water mark."""

    live: int
    host: int
    flops: list[tuple[tuple[int | None, str], int]]  # ((node, phase), flops) per op
    # rules 3 and 5: its high-water mark above ``live`` on the device and above ``host`` on the
    # host, the op there (name, phase) and the module invocations running, innermost
    # first; its FLOPs per phase
    high: int = 0
    host_high: int = 0
    high_event: tuple[str, str] = ("", "forward")
    at: tuple[str, ...] = ()
    phase_flops: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class RepeatSeries:
    """Repeats booked one after another at the same live bytes (NOTE [ Repeats on meta ]
    rule 9): each in order, and all of them as one (its high-water mark the highest, at
    the first piece that reaches it; its FLOPs the sum)."""

    pieces: tuple[Repeat, ...]
    joined: Repeat
    flops: int  # all their FLOPs

    @staticmethod
    def of(pieces: list[Repeat]) -> RepeatSeries:
        top = max(range(len(pieces)), key=lambda i: (pieces[i].high, -i))
        phases: dict[str, int] = {}
        for piece in pieces:
            for phase, flops in piece.phase_flops:
                phases[phase] = phases.get(phase, 0) + flops
        first = pieces[top]
        joined = Repeat(first.live, first.host, [], first.high,
                        max(piece.host_high for piece in pieces), first.high_event,
                        first.at, tuple(phases.items()))
        return RepeatSeries(tuple(pieces), joined, sum(phases.values()))


@dataclass
class _Recording:
    """A repeatable piece being recorded: where it started, what it did so far."""

    live: int
    host: int
    first: int  # its first timeline event
    flops: list[tuple[tuple[int | None, str], int]] = field(default_factory=list)
    host_top: int = 0  # the most host bytes live while it ran


# NOTE [ Repeats on meta ] rule 5: repeats by their callers' keys, while shared_repeats()
# (a context variable: each thread, and each asyncio task, plans with its own)
_SHARED: contextvars.ContextVar[dict[Hashable, Any] | None] = \
    contextvars.ContextVar("remat3d_shared_repeats", default=None)
_SHARED_LIMIT = 1 << 14  # repeats kept at most (emptied when reached, like the meta cache)


@contextlib.contextmanager
def shared_repeats() -> Iterator[None]:
    """Keep repeats across the measurements made inside (NOTE [ Repeats on meta ] rule 5);
    nested uses share the outermost's. Nothing is kept once it exits; another thread
    measures with its own (or none)."""
    if _SHARED.get() is not None:
        yield
        return
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _kept(key: Hashable, make: Callable[[], Any] | None) -> Any:
    """What :func:`shared_repeats` keeps under ``key``, after keeping ``make()`` there if
    given and none is (the scope emptied when full, like the meta cache); None outside
    it."""
    shared = _SHARED.get()
    if shared is None:
        return None
    kept = shared.get(key)
    if kept is None and make is not None:
        if len(shared) >= _SHARED_LIMIT:
            shared.clear()
        kept = shared[key] = make()
    return kept


def shared_repeat(key: Hashable, repeat: Repeat | None = None) -> Repeat | None:
    """The repeat kept under ``key`` (rule 5), after keeping ``repeat`` there if given and
    none is; None outside :func:`shared_repeats`."""
    # what booking reads: not its ops' FLOPs one by one
    kept = _kept(key, None if repeat is None else lambda: replace(repeat, flops=[]))
    assert kept is None or isinstance(kept, Repeat)
    return kept


def shared_series(key: Hashable, series: RepeatSeries | None = None) -> RepeatSeries | None:
    """The series kept under ``key`` (rule 9), after keeping ``series`` there if given and
    none is; None outside :func:`shared_repeats`."""
    kept = _kept(key, None if series is None else lambda: series)
    assert kept is None or isinstance(kept, RepeatSeries)
    return kept


def shared_value(key: Callable[[], Hashable], make: Callable[[], T]) -> T:
    """Inside :func:`shared_repeats`, the value kept under ``key()``, made by ``make()``
    where none is (rule 10: a tiled run's geometry); outside it, ``make()`` (``key`` is
    not called)."""
    if _SHARED.get() is None:
        return make()
    return _kept(key(), make)  # type: ignore[no-any-return]


# NOTE [ Bounded measurements ]
#   A search that only asks whether a candidate beats the plan it has (it fits the budget
#   and costs fewer FLOPs) need not measure a losing candidate to its end: the peak and the
#   FLOPs only grow as a step runs. Trackers made inside ``stop_above()`` raise
#   ``LimitExceeded`` the moment the live bytes on their device pass ``peak_bytes`` or
#   their FLOPs pass ``flops``; what they measured up to then are lower bounds of the
#   whole step's. Every context the step entered unwinds as for any other exception (the
#   repeats it was recording are dropped, NOTE [ Repeats on meta ]).
_LIMITS: contextvars.ContextVar[tuple[int | None, int | None]] = contextvars.ContextVar(
    "remat3d_tracker_limits", default=(None, None))


class LimitExceeded(Exception):
    """A tracker made inside :func:`stop_above` passed a limit: ``peak_bytes`` (the live
    bytes then, or the peak so far) and ``flops`` are lower bounds of the step's, and
    ``module`` is the innermost module running then (None: outside every module)."""

    def __init__(self, what: str, peak_bytes: int, flops: int, module: str | None) -> None:
        super().__init__(f"{what} limit passed in {module or 'the step'}")
        self.what, self.peak_bytes, self.flops, self.module = what, peak_bytes, flops, module


@contextlib.contextmanager
def stop_above(peak_bytes: int | None = None, flops: int | None = None) -> Iterator[None]:
    """Trackers made inside stop their step once its live bytes pass ``peak_bytes`` or its
    FLOPs pass ``flops`` (NOTE [ Bounded measurements ]); None: no limit."""
    token = _LIMITS.set((peak_bytes, flops))
    try:
        yield
    finally:
        _LIMITS.reset(token)


def active_tracker() -> MemoryTracker | None:
    """The innermost active tracker, if any."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, MemoryTracker):
            return mode
    return None


def replaying_tracker() -> MemoryTracker | None:
    """The innermost active tracker, if it replays repeats (``replays=True``)."""
    tracker = active_tracker()
    return tracker if tracker is not None and tracker.replays else None


def normalize_device(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


class MemoryTracker(TorchDispatchMode):
    """Track live tensor memory on one device through forward and backward.

    Args:
        device: the device whose memory is reported (``"meta"``, ``"cpu"``, ``"cuda"``).
        model: if given, every submodule invocation is recorded (forward and recompute) and
            ops, FLOPs, timeline events and edges are attributed to invocations.
        time_ops: record each op's wall time (synchronising CUDA around it).

    The step runner sets :attr:`phase` to ``"backward"`` before calling ``backward()`` and
    calls :meth:`mark_forward_end` in between; both are optional for ad-hoc use.
    """

    def __init__(
        self,
        device: str | torch.device = "meta",
        model: nn.Module | None = None,
        *,
        time_ops: bool = False,
        replays: bool = False,
    ) -> None:
        super().__init__()
        # NOTE [ Repeats on meta ]: only on meta, and only when what is read afterwards
        # is peaks, FLOPs and the timeline (measure(), not profile(): a skipped repeat
        # makes no invocation records or edges)
        self.replays = replays and normalize_device(device) == "meta"
        self._recordings: list[_Recording] = []
        self.device = normalize_device(device)
        self.ledger = StorageLedger()
        self.timeline: list[TimelineEvent] = []
        self.phase = "forward"
        self.peak_bytes = 0
        self.host_peak_bytes = 0  # host memory a meta/cuda step held at most
        self.peak_event: int | None = None  # None: the peak is the starting state
        # a peak raised by a booked repeat (rule 5): its high-water (transient, not in the
        # ledger's records) and the modules its recorded run was in
        self._peak_extra = 0
        self._peak_at: tuple[str, ...] | None = None
        self.flops: dict[str, int] = {"forward": 0, "backward": 0, "recompute": 0}
        self._flops_total = 0
        self._limit_bytes, self._limit_flops = _LIMITS.get()  # NOTE [ Bounded measurements ]
        self.node_flops: dict[tuple[int | None, str], int] = {}
        self.node_seconds: dict[tuple[int | None, str], float] = {}
        self.edges: dict[tuple[int, int], EdgeRecord] = {}
        self.saved_records: list[StorageRecord] | None = None
        self.forward_end_event = 0
        self._peak_records: list[StorageRecord] = []
        # (name, part, first timeline event, one past the last, live bytes at the start)
        # of each stretch of work named with window()
        self._windows: list[tuple[str, str, int, int, int]] = []
        self._window_flops: dict[str, int] = {}
        self._time_ops = time_ops
        self._sync = self.device.startswith("cuda")
        self._meta = self.device == "meta"
        self.invocations: InvocationRecorder | None = None
        if model is not None:
            self.invocations = InvocationRecorder(
                model, phase=lambda: self.phase, on_enter=self._enter, on_exit=self._exit
            )

    # -- state ------------------------------------------------------------------------
    def live(self) -> int:
        """Live bytes on the tracked device now."""
        return self.ledger.live_bytes.get(self.device, 0)

    def levels(self) -> tuple[int, int]:
        """Live bytes now on the tracked device and in host memory (where a repeat starts
        and must end, NOTE [ Repeats on meta ] rule 2)."""
        return self.live(), self.ledger.live_bytes.get(HOST, 0)

    def register(self, tensors: Any, category: str) -> None:
        """Count tensors that exist before tracking starts (weights, buffers, inputs)."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self.ledger.add(t, category, None, "setup")
        self._update_peak(None)

    def register_model(self, model: nn.Module) -> None:
        self.register(list(model.parameters()), "param")
        self.register(list(model.buffers()), "buffer")
        self.register([p.grad for p in model.parameters() if p.grad is not None], "grad")

    def mark_forward_end(self, output: Any = None) -> None:
        """Everything alive now that forward made is what the autograd graph keeps, but
        the model's ``output``: the caller holds it through backward whether or not the
        loss saved it, so no plan can free it (labelled ``"output"``)."""
        for t in tree_leaves(output):
            record = self.ledger.lookup(t) if isinstance(t, torch.Tensor) else None
            if record is not None and record.category == "activation":
                record.category = "output"
        self.saved_records = [
            r for r in self.ledger.records.values()
            if r.device == self.device and r.category == "activation"
        ]
        for record in self.saved_records:
            record.category = "saved"
        self.forward_end_event = len(self.timeline)

    def mark_gradients(self, tensors: Any) -> None:
        """Label the storages of final ``.grad`` tensors as gradients (for the breakdown)."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor) and t.grad is not None:
                record = self.ledger.lookup(t.grad)
                if record is not None:
                    record.category = "grad"

    @property
    def saved_bytes(self) -> int:
        return sum(r.nbytes for r in self.saved_records or [])

    def peak_breakdown(self) -> dict[str, int]:
        """Bytes live at the peak, by category (sums to :attr:`peak_bytes`)."""
        split = dict.fromkeys(PEAK_CATEGORIES, 0)
        for record in self._peak_records:
            split[_CATEGORY_OF[record.category]] += record.nbytes
        split["transient"] += self._peak_extra
        return split

    def peak_tensors(self, limit: int = 12) -> tuple[PeakTensor, ...]:
        """The ``limit`` largest storages live at the peak, largest first (where a
        booked repeat raised the peak, NOTE [ Repeats on meta ] rule 5, its high-water is
        not a storage: the breakdown's transient bytes hold it)."""
        largest = sorted(self._peak_records, key=lambda r: (-r.nbytes, r.uid))[:limit]
        return tuple(PeakTensor(
            r.nbytes, _CATEGORY_OF[r.category],
            self._names(r.producer)[0] if r.producer is not None and self.invocations
            is not None else None, r.phase) for r in largest)

    def peak_modules(self) -> tuple[str, ...]:
        """The module invocations running at the peak, innermost first (qualified names;
        empty: the peak is outside every module, or no model is recorded)."""
        if self._peak_at is not None:
            return self._peak_at
        if self.peak_event is None or self.invocations is None:
            return ()
        return self._names(self.timeline[self.peak_event].node)

    def peak_phase(self) -> str | None:
        """When the peak was reached: "forward", or "backward" (recomputations in backward
        included); None: the peak is the starting state."""
        if self.peak_event is None:
            return None
        return "forward" if self.timeline[self.peak_event].phase == "forward" else "backward"

    def _names(self, node: int | None) -> tuple[str, ...]:
        """The invocation ``node`` and those around it, innermost first."""
        names = []
        records = self.invocations.invocations if self.invocations is not None else []
        while node is not None:
            names.append(records[node].name)
            node = records[node].parent
        return tuple(names)

    def module_now(self) -> str | None:
        """The qualified name of the innermost module running now (None: outside every
        module, or no model is recorded)."""
        node = self.invocations.current() if self.invocations is not None else None
        return None if node is None else self._names(node)[0]

    @contextlib.contextmanager
    def window(self, name: str, part: str) -> Iterator[None]:
        """Name a stretch of work, ``part`` of ``name``: :meth:`window_peaks` reports the
        most live bytes while it ran (a tiled run's passes, which no module invocation
        covers whole: its tiles' backward runs outside every module)."""
        start, live = len(self.timeline), self.live()
        flops = self._flops_total
        try:
            yield
        finally:
            self._windows.append((name, part, start, len(self.timeline), live))
            self._window_flops[name] = self._window_flops.get(name, 0) + \
                self._flops_total - flops

    def window_flops(self) -> dict[str, int]:
        """Per name given to :meth:`window`, the FLOPs booked while its stretches ran."""
        return dict(self._window_flops)

    def window_peaks(self) -> dict[str, dict[str, int]]:
        """Per name and part given to :meth:`window`, the most live bytes on the device
        while its stretches ran (each op's live bytes before and after it; a booked
        repeat's high-water mark)."""
        out: dict[str, dict[str, int]] = {}
        for name, part, start, end, live in self._windows:
            top = max((max(e.live_before, e.live_after) for e in self.timeline[start:end]),
                      default=live)
            parts = out.setdefault(name, {})
            parts[part] = max(parts.get(part, 0), live, top)
        return out

    # -- repeats (NOTE [ Repeats on meta ]) -------------------------------------------
    def begin_repeat(self) -> _Recording:
        """Start recording a piece of work that may repeat (hand the result to
        :meth:`end_repeat`)."""
        live, host = self.levels()
        recording = _Recording(live, host, len(self.timeline), host_top=host)
        self._recordings.append(recording)
        return recording

    def end_repeat(self, start: _Recording) -> Repeat | None:
        """What the piece begun at ``start`` did, or None where it cannot be replayed: it
        left memory allocated or freed (the next run would start elsewhere)."""
        self._recordings.remove(start)
        live, host = start.live, start.host
        if self.levels() != (live, host):
            return None
        high, top = 0, None
        for i in range(start.first, len(self.timeline)):
            after = self.timeline[i].live_after - live
            if after > high:
                high, top = after, i
        phases: dict[str, int] = {}
        for (_, phase), flops in start.flops:
            phases[phase] = phases.get(phase, 0) + flops
        event = None if top is None else self.timeline[top]
        return Repeat(live, host, start.flops, high, start.host_top - host,
                      ("", "forward") if event is None else (event.op, event.phase),
                      () if event is None else self._names(event.node),
                      tuple(phases.items()))

    def replay(self, repeat: Repeat) -> bool:
        """Book ``repeat`` again without running it, where that is exact: live bytes now
        at or below where it started, on the device and the host, so it cannot raise a
        peak; its FLOPs are added, and one timeline event at its high-water mark (rule 3).
        False: run it."""
        live, host = self.levels()
        if live > repeat.live or host > repeat.host:
            return False
        for key, flops in repeat.flops:
            self._add_flops(key, flops)
        self._high_water_event(repeat, live)
        return True

    def book(self, repeat: Repeat) -> None:
        """Book ``repeat``, recorded in this step or another, without running it, at the
        live bytes now (rule 5): its high-water mark on top of them raises the peak where
        it passes it; its FLOPs are added and its timeline is one event, that high-water
        mark, attributed to the invocation running now."""
        live, host = self.levels()
        node = self._high_water_event(repeat, live)
        for phase, flops in repeat.phase_flops:
            self._add_flops((node, phase), flops)
        if self.device != HOST:
            self.host_peak_bytes = max(self.host_peak_bytes, host + repeat.host_high)
        for recording in self._recordings:
            recording.host_top = max(recording.host_top, host + repeat.host_high)
        if live + repeat.high > self.peak_bytes:
            self.peak_bytes = live + repeat.high
            self.peak_event = len(self.timeline) - 1
            self._peak_records = [
                r for r in self.ledger.records.values() if r.device == self.device
            ]
            self._peak_extra, self._peak_at = repeat.high, repeat.at
            self._check_limits()

    def book_series(self, series: RepeatSeries) -> None:
        """Book each of ``series`` in turn (rule 9): as one where no limit of
        :func:`stop_above` can be passed on the way (the same peak, host peak, FLOPs and
        peak modules; one timeline event, its high-water mark), else one by one (the
        limit passed where booking them one by one passes it)."""
        live = self.live()
        if (self._limit_bytes is not None and live + series.joined.high > self._limit_bytes) \
                or (self._limit_flops is not None
                    and self._flops_total + series.flops > self._limit_flops):
            for piece in series.pieces:
                self.book(piece)
        else:
            self.book(series.joined)

    def _high_water_event(self, repeat: Repeat, live: int) -> int | None:
        """A booked or replayed repeat's one timeline event, its high-water mark above
        ``live``, in the invocation running now (returned)."""
        node = self.invocations.current() if self.invocations is not None else None
        op, phase = repeat.high_event
        self.timeline.append(TimelineEvent(op, node, phase, live, live + repeat.high))
        return node

    def add_flops(self, phase: str, flops: int) -> None:
        """Book ``flops`` of work not run here but standing for what was (identical tiles
        measured once on fake tensors: ``runtime/tiled_graph.py`` NOTE rule 5)."""
        if flops:
            self._add_flops((None, phase), flops)

    def _add_flops(self, key: tuple[int | None, str], flops: int) -> None:
        self.flops[key[1]] += flops
        self._flops_total += flops
        if self._limit_flops is not None and self._flops_total > self._limit_flops:
            self._stop("FLOP")
        self.node_flops[key] = self.node_flops.get(key, 0) + flops
        for recording in self._recordings:
            recording.flops.append((key, flops))

    # -- hooks ------------------------------------------------------------------------
    def _enter(self, inv: Invocation) -> None:
        inv.timeline_start = len(self.timeline)
        inv.live_at_entry = self.live()

    def _exit(self, inv: Invocation, output: Any) -> None:
        inv.timeline_end = len(self.timeline)
        seen: set[int] = set()
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor):
                if inv.output_shape is None:
                    inv.output_shape = list(t.shape)
                    inv.output_dtype = str(t.dtype).replace("torch.", "")
                record = self.ledger.lookup(t)
                if record is not None and record.uid not in seen:
                    seen.add(record.uid)
                    inv.output_uids.append(record.uid)
                    inv.output_bytes += record.nbytes

    def _update_peak(self, event: int | None) -> None:
        if self.device != HOST:
            self.host_peak_bytes = max(self.host_peak_bytes,
                                       self.ledger.live_bytes.get(HOST, 0))
        if self._recordings:
            host = self.ledger.live_bytes.get(HOST, 0)
            for recording in self._recordings:
                recording.host_top = max(recording.host_top, host)
        live = self.live()
        if live > self.peak_bytes:
            self.peak_bytes = live
            self.peak_event = event
            self._peak_records = [
                r for r in self.ledger.records.values() if r.device == self.device
            ]
            self._peak_extra, self._peak_at = 0, None
            self._check_limits()

    def _check_limits(self) -> None:
        """NOTE [ Bounded measurements ]: called where the peak rises."""
        if self._limit_bytes is not None and self.peak_bytes > self._limit_bytes:
            self._stop("memory")

    def _stop(self, what: str) -> None:
        node = self.invocations.current() if self.invocations is not None else None
        names = self._names(node)
        raise LimitExceeded(what, self.peak_bytes, self._flops_total,
                            names[0] if names else None)

    def _op_phase(self) -> str:
        if self.phase == "forward":
            return "forward"
        # inside a module called during backward, or in a recomputation whose own ops run
        # outside any submodule (a region's forward body: attention's matmuls)
        if (self.invocations is not None and self.invocations._stack) or is_recomputing():
            return "recompute"
        return self.phase

    # -- dispatch ---------------------------------------------------------------------
    def __enter__(self) -> MemoryTracker:
        self._update_peak(None)
        super().__enter__()
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        node = self.invocations.current() if self.invocations is not None else None
        phase = self._op_phase()
        before = self.live()
        if self._time_ops:
            if self._sync:
                torch.cuda.synchronize()
            start = time.perf_counter()
        # on meta, repeated functional ops skip their kernels (NOTE [ Meta kernel cache ])
        out = META_KERNELS(func, args, kwargs) if self._meta else func(*args, **kwargs)
        if self._time_ops:
            if self._sync:
                torch.cuda.synchronize()
            key = (node, phase)
            self.node_seconds[key] = self.node_seconds.get(key, 0.0) + time.perf_counter() - start

        where = self._host_or_none(args, kwargs)
        for t in tensors_in(out):
            if self.ledger.add(t, "activation", node, phase, device=where) is None:
                self.ledger.refresh(t)
        if func._schema.is_mutable:  # in-place / out= ops may have resized an argument
            for t in tensors_in((args, kwargs)):
                self.ledger.refresh(t)

        flops = op_flops(func, args, kwargs, out)
        if flops:
            self._add_flops((node, phase), flops)

        if phase == "forward" and node is not None:
            self._record_edges(node, args, kwargs)

        self.timeline.append(
            TimelineEvent(str(func.__name__), node, phase, before, self.live())
        )
        self._update_peak(len(self.timeline) - 1)
        return out

    def _host_or_none(self, args: tuple, kwargs: dict) -> str | None:
        """``HOST`` when an op's new tensors are host memory on a meta step (module NOTE)."""
        if self.device != "meta":
            return None
        where = current_placement()
        if where is not None:
            return HOST if where == "host" else None
        if not self.ledger.live_bytes.get(HOST):  # no host tensor alive: the usual case
            return None
        records = [self.ledger.lookup(t) for t in tensors_in((args, kwargs))]
        if records and all(r is not None and r.device == HOST for r in records):
            return HOST
        return None

    def _record_edges(self, node: int, args: tuple, kwargs: dict) -> None:
        for t in tensors_in((args, kwargs)):
            record = self.ledger.lookup(t)
            if record is None or record.category not in ("activation", "input"):
                continue
            src = -1 if record.category == "input" else record.producer
            if src is None or src == node or (record.uid, node) in self.edges:
                continue
            self.edges[(record.uid, node)] = EdgeRecord(
                src=src,
                dst=node,
                bytes=record.nbytes,
                dtype=str(t.dtype).replace("torch.", ""),
                shape=tuple(t.shape),
            )

    def close(self) -> None:
        """Remove module hooks and detach from storages (call when done)."""
        if self.invocations is not None:
            self.invocations.remove()
        self.ledger.close()

"""``remat3d.tile``: run a spatially local stage tile by tile, forward and backward.

NOTE [ Tiled backward ]
  ``_TiledFunction`` keeps only the run's inputs. Its rules:
  1. Forward, without grad: one statistics pass per normalisation with batch statistics
     (in execution order; each pass runs every tile up to that normalisation, using the
     statistics of the earlier ones, and stops), then one pass that writes each tile's
     output into the output tensor.
  2. Backward is linear in the output gradient, so it is the sum over output tiles of the
     backward of that tile's output alone. Each tile recomputes its forward (exactly, with
     whole-tensor statistics) from halo-extended input slices, with grad, and back-
     propagates its own output gradient: parameter gradients are summed over tiles (in
     float64, cast back once), input gradients added into the input-gradient tensor at
     each tile's input region.
  3. A normalisation's backward needs two sums over the whole tensor (of the gradient of
     its normalised output, and of that gradient times the normalised output). By rule 2
     they are sums over tiles too: one extra backward pass per normalisation, from the
     last to the first, gathers them before the pass that needs them.
  4. Buffers change once per step: every tile run restores the buffers of the modules it
     called, except the last tile of the last forward pass (so counters such as
     ``num_batches_tracked`` advance once); running statistics are updated once, from the
     whole-tensor statistics, with the momentum the module asked for.
  5. Parameters are inputs of the Function, so autograd accumulates their gradients
     (``torch.autograd.grad`` works, gradient hooks fire once). Backward is a
     recomputation: ``is_recomputing()`` is True and autocast is as it was in forward.
  6. ``is_recomputing()`` is False only in the forward pass that writes the output (the
     trace on fake tensors and the statistics passes are extra runs too). Hooks of
     modules inside the run fire once per tile in that pass.
  Cost: with k normalisations, forward runs k + 1 partial passes, backward k + 1
  recomputations and k partial backwards; halos add the overlap (``docs/tiling.md``).
  NOTE [ Stashed passes ] takes most of the repeated passes away, for memory.

NOTE [ Stashed passes ]
  ``stash="device"`` or ``"host"``: a pass need not start from the run's inputs when the
  input of an earlier normalisation is kept whole (its *stash*), on the device or in host
  memory (NOTE [ Host-resident tiled outputs ] for how host tensors are read).
  1. Forward: the statistics pass of normalisation j writes each tile's owned part of its
     input into stash j. Later passes read it: the op that produced that input returns
     the tile's slice of the stash (halo included: the stash is whole when read), and the
     ops only it needed are skipped (they return uninitialised tensors of the right shape;
     nothing reads them). A stash is freed after the last pass that reads it; none
     outlives the forward. So each op runs about once forward instead of once per pass.
  2. Backward: the sums pass of the last normalisation runs every tile from the inputs and
     writes the stashes of the earlier normalisations; the sums pass of normalisation j
     then starts from stash j (a leaf with grad: the pass differentiates from there to its
     outputs, all its sums need). The final pass recomputes from the inputs (it needs the
     parameters' and inputs' gradients), with no stash alive.
  3. Only a normalisation input that an op of the run produces alone (not a run input, not
     written in place, not one of several results) is stashed; the others are recomputed
     as without stashes. Values are those the owning tile computed: every position has one
     value in every pass (without stashes each tile recomputes its halo itself; the two
     agree up to rounding order, as tiles always do).
  4. ``stash_norms``: only those normalisations (by their order in the run) are stashed;
     the passes that would read another's start from the nearest stash before it, or
     from the run's inputs. A run whose stashes do not all fit the memory left keeps the
     one that saves the most (the planner: NOTE [ Tiling layouts ] rule 10).
  Cost: a stage of two convolutions and two normalisations runs 2 convolutions forward
  instead of 5, and 10 convolution-equivalents backward instead of 11; the price is the
  stashes' memory while its passes run.

NOTE [ Shared input gradients ]
  A tiled output read by several tiled runs (a U-Net's full-resolution skip, read by the
  encoder's next run and by the decoder's top run) gets one gradient per reader from
  autograd: each reader's backward makes a whole input gradient, and autograd adds them
  before the producer's backward. At 512³ that is a second 8 GiB tensor beside the first
  while the later reader's tiles run. With ``share_grads=True`` (what plans do):
  1. The run's outputs carry a :class:`GradSlot` (an attribute of the tensor object).
     A tiled run reading such a tensor adds its tiles' input gradients into the slot's
     tensor (made by the first reader to need it) and hands autograd no gradient for it;
     so the readers share one whole gradient.
  2. The producer's backward takes the slot's tensor as its output's gradient, plus
     what autograd brings from readers that are not tiled runs (or read a copy: a view,
     a hook's wrapper carries no slot). Autograd runs the producer only after every
     reader of its outputs (their edges, not their gradients, order it), so the slot is
     complete when taken; a reader whose backward never runs added nothing.
  3. A slot keeps one tensor per backward (per autograd graph task, as autograd keeps
     its gradients): what a backward that failed midway left is never added to another
     backward's (it goes with the graph), a second backward with ``retain_graph`` starts
     from nothing, and a ``torch.autograd.grad`` nested inside a backward gathers its
     own.
  4. What this changes: the rounding order of the readers' sums (within the tiled
     tolerance), and what autograd itself sees of the output's gradient: a tensor hook or
     ``retain_grad`` on the output, or ``torch.autograd.grad`` with respect to it, sees
     only the non-tiled readers' part. Plans' tiled outputs are a module's internals,
     hence plans share; ``remat3d.tile`` does not unless asked.

NOTE [ Rebuilt tiled outputs ]
  ``rebuild=True`` (a plan's ``Region(rebuild=True)``): the tiled readers of a run's
  outputs do not keep them for their backwards. A U-Net's skip is read by the encoder's
  next run at once and by the decoder late, and both backwards come at the far ends of
  the decoder's backward: stored, the skip is whole all that time.
  1. The outputs carry a :class:`Rebuild` (an attribute of the tensor object): the run
     and, once its forward ran, its autograd context (its saved inputs, which the run
     keeps for its own backward anyway; autograd runs that after every reader's).
  2. A tiled run reading such an output does not save it for its backward. So the
     output is freed when the forward is done with it.
  3. Each reader's backward runs the producing run's forward again: its output pass
     alone, under ``recomputing()``, from those saved inputs, with the normalisation
     statistics its forward gathered (kept by the run until its own backward, a few
     numbers per channel: no statistics pass again), every tile restoring the buffers it
     changed, the running statistics not updated again, and without stashes (they would
     be whole beside the rest of the backward; the run's own forward and backward keep
     theirs). The reader holds the outputs while it runs: they are whole only inside
     each reader's backward, not between two readers' (the skip's two readers are far
     apart). The output pass is deterministic and its statistics are the forward's: the
     rebuilt outputs are bitwise the forward's. ``retain_graph`` changes nothing.
  4. A reader that is not a tiled run (a recompute region, an op) keeps the output as it
     keeps any tensor: correct, and nothing saved while it does.
  5. A rebuilt run whose own inputs are rebuilt outputs (a decoder stage's input is the
     skip of its level) rebuilds them for its rebuild. What one backward's inputs need
     is rebuilt once: a reader of the full-resolution skip and of a decoder stage built
     from the skip below (rebuilt from the full-resolution one) rebuilds that skip once
     for both; the outputs made for the inputs alone go when the inputs are gathered.
  6. ``hand_inputs=True``: a rebuilt run whose inputs are rebuilt outputs, and whose own
     backward follows its last reader's (an encoder stage's, after the next encoder
     stage's), keeps the inputs the last reader's rebuild made for its own backward
     instead of rebuilding them there again: one rebuild fewer, the inputs whole across
     that reader's backward. Whether that fits is the planner's to measure (NOTE
     [ Tiling layouts ] rule 11); a reader's backward that never runs leaves them with
     the run's autograd context.
  7. A reader made with ``rebuild_in_tiles=True`` does not make the rebuilt outputs it
     reads whole in its backward: each of its tiles, in each of its backward passes,
     computes the part of them it reads (its halo included) from their runs' inputs,
     with the statistics their forwards gathered (:class:`TileSource`), and their runs'
     own rebuilt inputs likewise (the skip's run reads the stem's rebuilt output). So
     the output is whole in no backward of such a reader (its gradient, gathered by its
     readers, still is). The price: the producing run's ops once per pass of the
     reader's backward (k + 1 with k normalisations) plus the halo overlap, where a
     whole rebuild makes them once; and the values are the forward's up to rounding
     order (a tile computes them over another region), as tiles always are, not
     bitwise. A run of several outputs is rebuilt whole all the same. Such a reader's
     own rebuilds (it is a rebuilt run whose readers rebuild it whole) compute its
     rebuilt inputs so too: an encoder stage rebuilt whole for its reader's backward
     reads the stem's output in parts, never whole beside its own.
  Cost: one output pass of the producing run per tiled reader (and per rebuild that
  needs it, rule 5), about one forward of its stage; the price in memory is the output
  inside each reader's backward only.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from remat3d.halo import Region, needed_regions, owned_region, tile_grid, union
from remat3d.instrument.state import is_recomputing, recomputing
from remat3d.instrument.tracker import (
    Repeat,
    RepeatSeries,
    active_tracker,
    replaying_tracker,
    shared_repeat,
    shared_series,
    shared_value,
)
from remat3d.runtime.guards import BufferGuard, ModuleStack
from remat3d.runtime.replay import AmpState
from remat3d.runtime.tiling.execute import (
    REGION,
    REPLACE,
    SKIP,
    Stashing,
    Stats,
    StopPass,
    TileMode,
    crop,
    region_of,
    whole_region,
)
from remat3d.runtime.tiling.host import (
    add_into_host,
    compute_device,
    host_empty,
    host_zeros_like,
    is_host,
    mark_host,
    to_device,
)
from remat3d.runtime.tiling.trace import TilingError, Trace, trace

__all__ = ["GradSlot", "TileSize", "TiledRun", "labelled", "tile"]

TileSize = int | Sequence[int]
REBUILT = "_remat3d_rebuilt"  # (Rebuild, output index) on a rebuilt run's outputs
STASHES = ("device", "host")  # where NOTE [ Stashed passes ] may keep normalisation inputs


GRAD_SLOT = "_remat3d_grad_slot"  # the attribute a shared-gradient output carries


class GradSlot:
    """The gradient of one tiled output, gathered by its tiled readers (NOTE [ Shared
    input gradients ]), one per autograd graph task (rule 3)."""

    __slots__ = ("grads",)

    def __init__(self) -> None:
        self.grads: dict[int, torch.Tensor] = {}

    def target(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tensor this backward's readers add into, made by the first (rule 3)."""
        task = torch._C._current_graph_task_id()
        grad = self.grads.get(task)
        if grad is None:
            grad = self.grads[task] = make()
        return grad

    def take(self) -> torch.Tensor | None:
        """What this backward's readers gathered, no longer kept (rule 3)."""
        return self.grads.pop(torch._C._current_graph_task_id(), None)


def grad_slot(t: Any) -> GradSlot | None:
    return getattr(t, GRAD_SLOT, None) if isinstance(t, torch.Tensor) else None


def _tile_size(tile: TileSize) -> tuple[int, int, int]:
    size = (int(tile),) * 3 if isinstance(tile, int) else tuple(int(t) for t in tile)
    if len(size) != 3 or any(t < 1 for t in size):
        raise TilingError(f"A tile size is one positive int or three (D, H, W); got {tile!r}.")
    return size  # type: ignore[return-value]


class TiledRun:
    """A traced run and its per-tile plans: what every tile computes at every node.

    Tiles cover the first output's volume; every other output (a skip connection leaving
    the run at another resolution, say) is split by the same boundaries, scaled.

    The run computes on ``device``; inputs in host memory (NOTE [ Host-resident tiled
    outputs ]) are read slice by slice, and ``host_outputs`` puts the outputs there.
    """

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[torch.Tensor],
                 tile: TileSize, *, device: torch.device | None = None,
                 host_outputs: bool = False, stash: str | None = None,
                 stash_norms: Sequence[int] | None = None) -> None:
        if stash is not None and stash not in STASHES:
            raise TilingError(f"stash must be one of {', '.join(STASHES)} or None; got "
                              f"{stash!r}.")
        if stash_norms is not None and stash is None:
            raise TilingError("stash_norms chooses which normalisations' inputs a stash "
                              "keeps; give stash='device' or 'host' too.")
        self.fn = fn
        self.stash = stash
        self.stash_norms = None if stash_norms is None else tuple(sorted(set(stash_norms)))
        self.device = device if device is not None else compute_device(fn, inputs)
        self.host_inputs = [is_host(x, self.device) for x in inputs]
        self.host_outputs = host_outputs
        # on a tracked step, the run's passes are booked under its plan region's label,
        # else the module running it (MemoryTracker.window: the planner reads what each
        # run held, Plan.verified_tiled_peaks)
        tracker = active_tracker()
        self.name = _LABEL.get() or (tracker.module_now() if tracker is not None else None)
        with recomputing():
            self.trace: Trace = trace(fn, inputs, self.device)
        self.tile = _tile_size(tile)
        self._digest: str | None = None
        # where the tiles lie and what each computes: a function of the trace and the
        # tile, kept across a search's candidates (NOTE [ Repeats on meta ] rule 10)
        geometry = shared_value(lambda: ("geometry", self.digest()),
                                lambda: _Geometry.of(self.trace, self.tile))
        self.tiles = geometry.tiles
        self.plans = geometry.plans
        self.owned = geometry.owned
        self.out_owned = geometry.out_owned  # per tile: the part of each output it writes
        self.flips = geometry.flips
        self.shapes = geometry.shapes
        self.isotropic, self.cubic, self.keys = geometry.isotropic, geometry.cubic, geometry.keys
        tr = self.trace
        self.stats = [Stats(tr.ops[i].norm) for i in tr.norms]  # type: ignore[arg-type]
        self.sourced_keys: dict[tuple, tuple] = {}  # with rebuilt inputs' keys: reduced
        self.stash_nodes = self._stash_nodes() if stash else {}
        self.rebuild_in_tiles = False  # NOTE [ Rebuilt tiled outputs ] rule 7
        self._region_plans: dict[Region, dict[int, Region]] = {}

    def digest(self) -> str:
        """Everything a tile's work depends on besides its shapes and the pass (NOTE
        [ Repeats on meta ] rule 5): the traced ops, sizes and dtypes, the parameters'
        shapes, the tile and where inputs and outputs live. Not the stashes: what a pass
        does with them is the pass's (``_stashing_key``, rule 8)."""
        if self._digest is None:
            tr = self.trace
            text = repr((
                self.tile, self.host_outputs, self.host_inputs,
                self.device.type,
                tr.ops, tr.inputs, tr.outputs, sorted(tr.sizes.items()), tr.out_shapes,
                tr.out_dtypes, tr.norms, sorted(tr.leading.items()),
                sorted(tr.dtypes.items()), tr.returns_tuple,
                [(tuple(p.shape), p.dtype, p.requires_grad) for p in tr.params]))
            self._digest = hashlib.sha1(text.encode()).hexdigest()
        return self._digest

    # -- stashes (NOTE [ Stashed passes ]) ---------------------------------------------
    def _stash_nodes(self) -> dict[int, int]:
        """Normalisation ordinal -> the node of its input, where it may be stashed (rule 3)
        and is asked to be (``stash_norms``; a normalisation the run does not have is an
        error)."""
        tr = self.trace
        if self.stash_norms is not None and any(j >= len(tr.norms) for j in self.stash_norms):
            raise TilingError(f"stash_norms {list(self.stash_norms)} names normalisations "
                              f"the run does not have: it has {len(tr.norms)} (0 to "
                              f"{len(tr.norms) - 1}, in the order they run).")
        producer = {op.spatial.output: op for op in tr.ops}
        nodes = {}
        for j, i in enumerate(tr.norms):
            node = tr.ops[i].spatial.inputs[0]
            op = producer.get(node)
            if op is not None and not op.inplace and op.single and (
                    self.stash_norms is None or j in self.stash_norms):
                nodes[j] = node
        return nodes

    def _actions(self, last: int, available: set[int]) -> dict[int, str]:
        """What a pass running the ops up to ``last`` skips or reads from a stash, given
        the stashed nodes ``available`` (rule 1): walking back from what the pass needs."""
        ops = self.trace.ops
        full = last == len(ops) - 1
        needed = set(self.trace.outputs) if full else set(ops[last].spatial.inputs)
        actions: dict[int, str] = {}
        for i in range(last - (0 if full else 1), -1, -1):
            op = ops[i]
            out = op.spatial.output
            if out not in needed and op.single:
                actions[i] = SKIP
            elif out in available:
                actions[i] = REPLACE
            else:
                needed.update(op.spatial.inputs)
        return actions

    def _new_stash(self, j: int) -> torch.Tensor:
        node = self.stash_nodes[j]
        shape = (*self.trace.leading[node], *self.trace.sizes[node])
        dtype = self.trace.dtypes[node]
        if self.stash == "host":
            return host_empty(shape, dtype, self.device)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _schedule(self, passes: list[tuple[int, set[int], list[int]]]
                  ) -> list[tuple[dict[int, str], list[int], list[int]]]:
        """Per pass (last op, stashed nodes it may read, stashes it writes): its actions,
        the stashes it writes, and the nodes whose stashes are freed after it (a run
        without stashes skips nothing: no walk of its ops)."""
        if not self.stash:
            return [({}, [], []) for _ in passes]
        acts = [self._actions(last, available) for last, available, _ in passes]
        last_read: dict[int, int] = {}
        for p, actions in enumerate(acts):
            for i, what in actions.items():
                if what == REPLACE:
                    last_read[self.trace.ops[i].spatial.output] = p
        # a stash no later pass reads is not written at all
        written = {self.stash_nodes[j]: p for p, (_, _, writes) in enumerate(passes)
                   for j in writes if self.stash_nodes[j] in last_read}
        out = []
        for p, (actions, (_, _, writes)) in enumerate(zip(acts, passes)):
            kept = [j for j in writes if written.get(self.stash_nodes[j]) == p]
            free = [node for node, w in written.items() if last_read[node] == p]
            out.append((actions, kept, free))
        return out

    def _passes(self, schedule: list[tuple[dict[int, str], list[int], list[int]]]
                ) -> Iterator[Stashing | None]:
        """Each pass's :class:`Stashing` in order, stashes allocated when first written and
        freed after their last reader (None: no stashes)."""
        if not self.stash:
            for _ in schedule:
                yield None
            return
        whole: dict[int, torch.Tensor] = {}
        try:
            for actions, writes, free in schedule:
                write = {j: self._new_stash(j) for j in writes}
                yield Stashing(actions, dict(whole), write)
                whole.update({self.stash_nodes[j]: t for j, t in write.items()})
                del write
                for node in free:
                    whole.pop(node, None)
        finally:
            whole.clear()

    # -- one tile ---------------------------------------------------------------------
    def run_tile(self, k: int, inputs: Sequence[torch.Tensor], *, stop_at: int | None = None,
                 capture: int | None = None, grad_inputs: Sequence[bool] | None = None,
                 stashing: Stashing | None = None
                 ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor], TileMode]:
        plan = self.plans[k]
        local = []
        for i, (x, node) in enumerate(zip(inputs, self.trace.inputs)):
            region = plan.get(node, ((0, 1),) * 3)  # an input this tile does not read
            xt = self._input_part(i, x, region)
            if grad_inputs is not None:
                xt = xt.detach().requires_grad_(grad_inputs[i])
            setattr(xt, REGION, region)
            local.append(xt)
        mode = TileMode(self.trace, plan, self.stats, self.owned[k], stop_at, capture,
                        stashing, self.device)
        try:
            with mode:
                y = self.fn(*local)
        except StopPass:
            return None, local, mode
        ys = list(y) if isinstance(y, (tuple, list)) else [y]
        if len(ys) != len(self.trace.outputs) or any(
                not isinstance(t, torch.Tensor) or getattr(t, REGION, None) is None for t in ys):
            raise TilingError("A tile of the run returned something else than its trace did "
                              "(tensors computed from its inputs).")
        return [crop(t, region_of(t), want) for t, want in zip(ys, self.out_owned[k])], \
            local, mode

    def _input_part(self, i: int, x: torch.Tensor | TileSource, region: Region
                    ) -> torch.Tensor:
        """Input ``i`` over ``region``: a slice of it, on the run's device, or computed
        where it is a :class:`TileSource` (NOTE [ Rebuilt tiled outputs ] rule 7)."""
        if isinstance(x, TileSource):
            return x.part(region)
        xt = crop(x, whole_region(x), region)
        return to_device(xt, self.device) if self.host_inputs[i] else xt

    def region_plan(self, want: Region) -> dict[int, Region]:
        """What each node computes for the run's one output over ``want`` (kept: a
        reader's tiles ask for the same regions in each of its passes)."""
        plan = self._region_plans.get(want)
        if plan is None:
            tr = self.trace
            plan = self._region_plans[want] = needed_regions(tr.spatial_ops, tr.sizes,
                                                             {tr.outputs[0]: want})
        return plan

    def part_of_output(self, inputs: Sequence[torch.Tensor | TileSource], want: Region
                       ) -> torch.Tensor:
        """The run's one output over ``want``, computed from ``inputs`` with the
        statistics its forward gathered (NOTE [ Rebuilt tiled outputs ] rule 7): the
        ops compute what ``want`` needs of them, no more. Call it without grad."""
        tr = self.trace
        plan = self.region_plan(want)
        local = []
        for i, (x, node) in enumerate(zip(inputs, tr.inputs)):
            xt = self._input_part(i, x, plan.get(node, ((0, 1),) * 3))
            setattr(xt, REGION, plan.get(node, ((0, 1),) * 3))
            local.append(xt)
        nowhere = ((0, 0),) * 3  # no normalisation sums are gathered here
        with TileMode(tr, plan, self.stats, dict.fromkeys(range(len(self.stats)), nowhere),
                      device=self.device):
            y = self.fn(*local)
        y = y[0] if isinstance(y, (tuple, list)) else y
        if not isinstance(y, torch.Tensor) or getattr(y, REGION, None) is None:
            raise TilingError("A tile of the run returned something else than its trace did "
                              "(tensors computed from its inputs).")
        return crop(y, region_of(y), want)

    def _window(self, part: str) -> contextlib.AbstractContextManager[None]:
        """Books this part of the run (its forward passes, its backward's sums passes, its
        final backward pass) under the run's name on a tracked step."""
        tracker = active_tracker() if self.name is not None else None
        return contextlib.nullcontext() if tracker is None else \
            tracker.window(self.name, part)

    # -- forward (NOTE rule 1) ----------------------------------------------------------
    def forward(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with self._window("forward"):
            return self._forward(inputs)

    def rebuild(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The outputs again, as :meth:`forward` made them (NOTE [ Rebuilt tiled outputs
        ] rule 3): its output pass alone, with the statistics the forward gathered and
        without stashes, every tile restoring the buffers it changed, the running
        statistics not updated a second time."""
        if any(stats.rstd is None for stats in self.stats):
            raise AssertionError("a tiled run was rebuilt before its forward ran")
        with self._window("rebuild"):
            return self._forward(inputs, rebuilding=True)

    def _forward(self, inputs: Sequence[torch.Tensor],
                 rebuilding: bool = False) -> list[torch.Tensor]:
        tr = self.trace
        n = len(self.stats)
        last = len(tr.ops) - 1
        passes: Iterator[Stashing | None]
        if rebuilding:  # the forward's statistics: its output pass alone, no stash
            first, passes = n, iter([None])
        else:
            for stats in self.stats:
                stats.reset()
            first = 0
            stashed = list(self.stash_nodes)  # normalisations whose inputs may be stashed
            passes = self._passes(self._schedule(  # NOTE [ Stashed passes ] rule 1
                [(tr.norms[j], {self.stash_nodes[i] for i in stashed if i < j},
                  [j] if j in self.stash_nodes else []) for j in range(n)]
                + [(last, {self.stash_nodes[i] for i in stashed}, [])]))
        outs: list[torch.Tensor] = []
        with torch.no_grad():
            for j, stashing in enumerate(passes, start=first):
                if j == n:
                    outs = [host_empty(shape, dtype, self.device) if self.host_outputs
                            else torch.empty(shape, dtype=dtype, device=self.device)
                            for shape, dtype in zip(tr.out_shapes, tr.out_dtypes)]
                repeats = _Repeats(self, ("forward", j, _layout(inputs)), inputs,
                                   last_runs=j == n and not rebuilding, stashing=stashing)
                for k in repeats.to_run():
                    with repeats.recording(k):
                        if j == n:
                            self._output_tile(k, inputs, outs, stashing, rebuilding)
                            continue
                        with _restoring_buffers(), recomputing():
                            self.run_tile(k, inputs, stop_at=j, stashing=stashing)
                if j < n:
                    self.stats[j].finish()
                del stashing
            if not rebuilding:
                self._update_running()
        return outs

    def _output_tile(self, k: int, inputs: Sequence[torch.Tensor],
                     outs: list[torch.Tensor], stashing: Stashing | None,
                     rebuilding: bool = False) -> None:
        """Tile ``k``'s part of the outputs, written into ``outs`` (NOTE rule 1); buffers
        restored but after the last tile (after every tile when ``rebuilding``). Its own
        tensors are gone when it returns."""
        last = k == len(self.tiles) - 1 and not rebuilding
        with contextlib.nullcontext() if last else _restoring_buffers():
            ys, _, _ = self.run_tile(k, inputs, stashing=stashing)
        assert ys is not None
        for out, y, region in zip(outs, ys, self.out_owned[k]):
            crop(out, whole_region(out), region).copy_(y)

    def _update_running(self) -> None:
        for stats in self.stats:
            if stats.running is None or stats.mean is None:
                continue
            running_mean, running_var, momentum = stats.running
            m = 0.1 if momentum is None else float(momentum)
            mean = stats.mean.flatten(1)    # (N|1, G)
            var = stats.unbiased_var().flatten(1)
            mean, var = mean.mean(0), var.mean(0)  # instance norm: averaged over the batch
            running_mean.mul_(1 - m).add_(mean.to(running_mean.dtype), alpha=m)
            running_var.mul_(1 - m).add_(var.to(running_var.dtype), alpha=m)
            stats.running = None

    # -- backward (NOTE rules 2 and 3) --------------------------------------------------
    def _seeded(self, k: int, ys: list[torch.Tensor], dys: Sequence[torch.Tensor | None]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This tile's outputs that have a gradient, and their gradients' matching parts."""
        def part(dy: torch.Tensor, region: Region) -> torch.Tensor:
            dy = crop(dy, whole_region(dy), region)
            return to_device(dy, self.device) if self.host_outputs else dy

        pairs = [(y, part(dy, region))
                 for y, dy, region in zip(ys, dys, self.out_owned[k])
                 if dy is not None and y.requires_grad and y.numel()]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def backward(self, inputs: Sequence[torch.Tensor], dys: Sequence[torch.Tensor | None],
                 needs: Sequence[bool], slots: Sequence[GradSlot | None] = ()
                 ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """The inputs' and parameters' gradients; an input with a slot (``slots``, NOTE
        [ Shared input gradients ]) has its gradient added into the slot, and None here."""
        params = [p for p in self.trace.params if p.requires_grad]
        n = len(self.stats)
        last = len(self.trace.ops) - 1
        order = list(reversed(range(n)))
        given = (tuple(needs), _layout(inputs), _layout(dys))  # (repeats' keys)
        schedule = self._schedule(  # NOTE [ Stashed passes ] rule 2
            [(last, set(), [i for i in self.stash_nodes if i < n - 1])]
            + [(last, {self.stash_nodes[i] for i in self.stash_nodes if i <= j}, [])
               for j in order[1:]])
        with self._window("sums"):
            for j, stashing in zip(order, self._passes(schedule)):
                stats = self.stats[j]
                sum_g: torch.Tensor | None = None
                sum_gx: torch.Tensor | None = None
                repeats = _Repeats(self, ("sums", j, *given), inputs, stashing=stashing)
                for k in repeats.to_run():
                    with repeats.recording(k):
                        sums = self._norm_sums_tile(k, j, inputs, dys, needs, stashing)
                        if sums is not None:
                            sum_g = sums[0] if sum_g is None else sum_g + sums[0]
                            sum_gx = sums[1] if sum_gx is None else sum_gx + sums[1]
                        del sums  # a tile leaves nothing alive but what it adds to
                del stashing
                if sum_g is None or sum_gx is None:
                    zero = torch.zeros((), dtype=torch.float64, device=self.device)
                    stats.sums = (zero, zero)
                else:
                    stats.sums = (sum_g, sum_gx)
        slots = list(slots) or [None] * len(inputs)

        def zeros(x: torch.Tensor | TileSource, host: bool) -> torch.Tensor:
            if isinstance(x, TileSource):
                return x.zeros()
            return host_zeros_like(x, self.device) if host else torch.zeros_like(x)

        dx: list[torch.Tensor | None] = [
            None if not need else zeros(x, host) if slot is None
            else slot.target(lambda x=x, host=host: zeros(x, host))  # type: ignore[misc]
            for x, need, host, slot in zip(inputs, needs, self.host_inputs, slots)]
        dparams: list[torch.Tensor | None] = [None] * len(params)
        repeats = _Repeats(self, ("final", *given), inputs)
        with self._window("final"):
            for k in repeats.to_run():
                with repeats.recording(k):
                    self._backward_tile(k, inputs, dys, needs, params, dx, dparams)
        dx = [None if slot is not None else g for g, slot in zip(dx, slots)]
        return dx, [None if g is None else g.to(p.dtype) for g, p in zip(dparams, params)]

    def _norm_sums_tile(self, k: int, j: int, inputs: Sequence[torch.Tensor],
                        dys: Sequence[torch.Tensor | None], needs: Sequence[bool],
                        stashing: Stashing | None
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Tile ``k``'s share of normalisation ``j``'s two backward sums (NOTE rule 3);
        None where the tile adds nothing. Its own tensors are gone when it returns."""
        ys, _, mode = self.run_tile(k, inputs, capture=j, grad_inputs=needs,
                                    stashing=stashing)
        xhat = mode.captured
        if ys is None or xhat is None or not xhat.requires_grad:
            return None
        outs, seeds = self._seeded(k, ys, dys)
        if not outs:
            return None
        (g,) = torch.autograd.grad(outs, xhat, seeds, allow_unused=True)
        if g is None:
            return None
        dims = self.stats[j].dims()
        return (g.sum(dims, keepdim=True).double(),
                (g * xhat.detach()).sum(dims, keepdim=True).double())

    def _backward_tile(self, k: int, inputs: Sequence[torch.Tensor],
                       dys: Sequence[torch.Tensor | None], needs: Sequence[bool],
                       params: list[torch.Tensor], dx: list[torch.Tensor | None],
                       dparams: list[torch.Tensor | None]) -> None:
        """Tile ``k``'s share of the input and parameter gradients, added into ``dx`` and
        ``dparams`` (NOTE rule 2); its own tensors are gone when it returns."""
        ys, local, _ = self.run_tile(k, inputs, grad_inputs=needs)
        assert ys is not None
        outs, seeds = self._seeded(k, ys, dys)
        wrt = [x for x, need in zip(local, needs) if need] + params
        if not outs or not wrt:
            return
        grads = torch.autograd.grad(outs, wrt, seeds, allow_unused=True)
        it = iter(grads)
        for i, need in enumerate(needs):
            if need:
                g = next(it)
                target = dx[i]
                if g is not None and target is not None:
                    part = crop(target, whole_region(target), region_of(local[i]))
                    if self.host_inputs[i]:
                        add_into_host(part, g)
                    else:
                        part.add_(g)
        for i, g in enumerate(it):
            if g is not None:  # summed over tiles in float64: no rounding added
                previous = dparams[i]
                dparams[i] = g.double() if previous is None else previous.add_(g)


def _layout(tensors: Sequence[torch.Tensor | TileSource | None]) -> tuple:
    """Shapes, strides and dtypes (what views of them do depends on)."""
    return tuple(None if t is None else t.layout() if isinstance(t, TileSource)
                 else (tuple(t.shape), t.stride(), t.dtype) for t in tensors)


@dataclass(frozen=True)
class _Geometry:
    """Where a run's tiles lie and what each computes (NOTE rule 1), and how a tile is
    keyed on meta (NOTE [ Repeats on meta ] rules 1, 6 and 7): a function of the run's
    trace and tile alone. Read only."""

    tiles: list[Region]
    plans: list[dict[int, Region]]     # per tile: what each node computes
    owned: list[dict[int, Region]]     # per tile: each normalisation's input it owns
    out_owned: list[list[Region]]      # per tile: the part of each output it writes
    flips: list[tuple[bool, ...]]      # per tile: the axes it is seen mirrored on
    shapes: list[tuple]                # per tile: what its ops depend on but where it lies
    isotropic: bool
    cubic: bool
    keys: list[tuple]                  # per tile: its shapes in their least axis order

    @staticmethod
    def of(tr: Trace, tile: tuple[int, int, int]) -> _Geometry:
        out_size = tr.sizes[tr.outputs[0]]
        tiles: list[Region] = tile_grid(out_size, tile)
        plans: list[dict[int, Region]] = []
        owned_: list[dict[int, Region]] = []
        out_owned: list[list[Region]] = []
        for t in tiles:
            owned = {j: owned_region(t, out_size, tr.sizes[tr.ops[i].spatial.inputs[0]])
                     for j, i in enumerate(tr.norms)}
            outs = [owned_region(t, out_size, tr.sizes[node]) for node in tr.outputs]
            targets: dict[int, Region] = {}
            for node, region in zip(tr.outputs, outs):
                targets[node] = region
            for j, i in enumerate(tr.norms):  # the owned part of every norm is computed
                node = tr.ops[i].spatial.output
                targets[node] = union(targets.get(node), owned[j])
            plans.append(needed_regions(tr.spatial_ops, tr.sizes, targets))
            owned_.append(owned)
            out_owned.append(outs)
        used = set().union(*(plan.keys() for plan in plans))
        for op in tr.ops:
            if op.spatial.output not in used:
                raise TilingError(
                    f"The result of {op.name} in module '{op.module}' is not used by the "
                    "run's outputs; a tiled run must be one computation ending in the "
                    "tensors it returns.")
        # what a tile's ops depend on, but where it lies (NOTE [ Repeats on meta ] rule
        # 1), a tile at the far end of an axis seen as its mirror image (rule 6)
        flips = [tuple(hi == n and lo != 0 for (lo, hi), n in zip(t, out_size))
                 for t in tiles]
        shapes = [
            (tuple((node, _shape(region, tr.sizes[node], flip))
                   for node, region in sorted(plan.items())),
             tuple(_shape(r, tr.sizes[tr.ops[i].spatial.inputs[0]], flip)
                   for r, i in zip(owned.values(), tr.norms)),
             tuple(_shape(r, tr.sizes[node], flip) for r, node in zip(outs, tr.outputs)))
            for plan, owned, outs, flip in zip(plans, owned_, out_owned, flips)]
        # rule 7: where the ops and the tile treat the axes alike, a tile keyed as the
        # axis order that names it least
        isotropic = _isotropic(tr)
        cubic = isotropic and len(set(tile)) == 1
        least = {key: _least_axis_order(key) if cubic else key
                 for key in set(shapes)}  # (a few kinds of tile, many tiles)
        return _Geometry(tiles, plans, owned_, out_owned, flips, shapes, isotropic, cubic,
                         [least[key] for key in shapes])


def _shape(region: Region, size: Sequence[int], flip: Sequence[bool] = (False,) * 3
           ) -> tuple[tuple[int, bool, bool], ...]:
    """A region as a tile's ops see it: its extent, and whether it touches each border
    (the near one first; on a ``flip`` axis, the far one: its mirror image's view)."""
    return tuple((hi - lo, hi == n, lo == 0) if f else (hi - lo, lo == 0, hi == n)
                 for (lo, hi), n, f in zip(region, size, flip))


_AXIS_ORDERS = tuple(itertools.permutations(range(3)))


def _isotropic(tr: Trace) -> bool:
    """Whether a run's ops treat the three axes alike (NOTE [ Repeats on meta ] rule 7):
    every window parameter the same on each axis, every node cubic."""
    if any(len(set(size)) != 1 for size in tr.sizes.values()):
        return False
    return all(len(set(values)) == 1
               for op in tr.spatial_ops
               for values in (op.kernel, op.stride, op.padding, op.dilation, op.scale))


def _least_axis_order(key: tuple, sourced: bool = False) -> tuple:
    """A tile's key (``TiledRun.shapes``; ``sourced``: with its rebuilt inputs' keys,
    ``TileSource.key``) with its axes reordered alike in every region, the order that
    sorts first (rule 7); in the order it has where a region spans a whole axis (its
    views' layout, so a copy an op makes, could depend on which axis that is)."""
    regions: list[tuple] = []  # every region's shape, gathered in the first order

    def nodes(entries: Iterable[tuple[Any, tuple]], order: tuple[int, ...]) -> tuple:
        out = tuple((node, tuple(shape[a] for a in order)) for node, shape in entries)
        if order == _AXIS_ORDERS[0]:
            regions.extend(shape for _, shape in out)
        return out

    def run_key(k: tuple, order: tuple[int, ...]) -> tuple:
        entries, owned, outs = k
        return (nodes(entries, order), nodes(enumerate(owned), order),
                nodes(enumerate(outs), order))

    def source_key(k: tuple, order: tuple[int, ...]) -> tuple:
        entries, inner = k
        return nodes(entries, order), tuple(source_key(x, order) for x in inner)

    def ordered(order: tuple[int, ...]) -> tuple:
        if not sourced:
            return run_key(key, order)
        return run_key(key[0], order), tuple(source_key(x, order) for x in key[1])

    same = ordered(_AXIS_ORDERS[0])  # (0, 1, 2)
    if any(near and far for shape in regions for _, near, far in shape):
        return same
    return min(same, *(ordered(order) for order in _AXIS_ORDERS[1:]))


def _stashing_key(run: TiledRun, stashing: Stashing | None) -> tuple | None:
    """What a pass's tiles do with stashes (NOTE [ Repeats on meta ] rule 8): the ops
    they skip or read from one, the stashes they read and write, and where stashes
    live; None where they do nothing with one, as in a run without stashes."""
    if stashing is None or not (stashing.actions or stashing.read or stashing.write):
        return None
    return (tuple(sorted(stashing.actions.items())), tuple(sorted(stashing.read)),
            tuple(sorted(stashing.write)), run.stash)


class _Repeats:
    """One pass's tiles on a replaying tracker (NOTE [ Repeats on meta ] in
    ``instrument/tracker.py``): a tile whose shapes a tile of the pass already had is
    booked from that one's record, not run; within ``shared_repeats()`` (rule 5), so is
    one whose run, pass and shapes an earlier pass or step recorded (a tile at an axis's
    far end keyed as its mirror image, rule 6; its axes reordered, rule 7). Elsewhere
    every tile runs, and so do the first tile of each pass (it makes the accumulators)
    and the last tile of the pass that writes the outputs (``last_runs``: it keeps the
    buffers it updates; every other pass restores them). ``tag`` names the pass (which
    one, and what its tiles depend on besides their shapes and what ``stashing`` has
    them do, rule 8)."""

    def __init__(self, run: TiledRun, tag: tuple,
                 inputs: Sequence[torch.Tensor | TileSource] = (),
                 last_runs: bool = False, stashing: Stashing | None = None) -> None:
        self.run = run
        self.last_runs = last_runs
        # inputs computed by each tile (NOTE [ Rebuilt tiled outputs ] rule 7): their
        # parts' shapes are the tile's too
        self.sources = [(x, node) for x, node in zip(inputs, run.trace.inputs)
                        if isinstance(x, TileSource)]
        self.cubic = run.cubic and all(x.isotropic for x, _ in self.sources)  # rule 7
        self.tracker = replaying_tracker() if run.device.type == "meta" else None
        self.seen: dict[Any, Repeat] = {}
        self.tag = None if self.tracker is None else (
            run.digest(), tag, _stashing_key(run, stashing), torch.is_grad_enabled(),
            is_recomputing(), self.tracker.phase, repr(AmpState.capture(run.device)))

    def to_run(self) -> Iterator[int]:
        """The pass's tiles to run, in order (each inside :meth:`recording`); the others
        are booked. The tiles between the first and the last that runs start where the
        one before them did (each ends where it started, or none is booked), so where
        ``shared_repeats()`` holds their series from an earlier pass with this key, they
        are booked at once (rule 9); a pass whose middle tiles all left a repeat, at the
        same live bytes, keeps its series for the next."""
        n = len(self.run.tiles)
        if self.tracker is None or n < 3:
            for k in range(n):
                if self.booked(k) is None:
                    yield k
            return
        tracker = self.tracker
        middle = range(1, n - 1 if self.last_runs else n)
        key = (self.tag, "series", self.last_runs,
               tuple(self.shapes(k) for k in middle) if self.sources else None)
        yield 0
        series = shared_series(key)
        if series is not None:
            tracker.book_series(series)
        else:
            pieces: list[Repeat] | None = []
            start = tracker.levels()
            for k in middle:
                if pieces is not None and tracker.levels() != start:
                    pieces = None
                repeat = self.booked(k)
                if repeat is None:
                    yield k  # run: its record, if it left one (else the next tile
                    repeat = self.seen.get(self.shapes(k))  # starts elsewhere: checked)
                if pieces is not None:
                    if repeat is None:
                        pieces = None
                    else:
                        pieces.append(repeat)
            if pieces and tracker.levels() == start:
                shared_series(key, RepeatSeries.of(pieces))
        if self.last_runs:
            yield n - 1

    def booked(self, k: int) -> Repeat | None:
        """Book tile ``k`` where a record of its shapes allows (rules 3 and 5): the record
        booked, or None (run it)."""
        # the first tile runs: it makes the pass's accumulators (statistics, sums,
        # gradients), which a booked mirror of it (rule 6) would not
        if self.tracker is None or k == 0 or \
                (self.last_runs and k == len(self.run.tiles) - 1):
            return None
        shapes = self.shapes(k)
        repeat = self.seen.get(shapes)
        if repeat is not None and self.tracker.replay(repeat):
            return repeat
        repeat = shared_repeat((self.tag, shapes))
        if repeat is not None:
            self.tracker.book(repeat)
        return repeat

    def shapes(self, k: int) -> tuple:
        if not self.sources:
            return self.run.keys[k]
        plan, flip = self.run.plans[k], self.run.flips[k]
        key = (self.run.shapes[k],
               tuple(x.key(plan.get(node, ((0, 1),) * 3), flip) for x, node in self.sources))
        if not self.cubic:
            return key
        least = self.run.sourced_keys.get(key)
        if least is None:
            least = self.run.sourced_keys[key] = _least_axis_order(key, sourced=True)
        return least

    @contextlib.contextmanager
    def recording(self, k: int) -> Iterator[None]:
        tracker = self.tracker
        key = None if tracker is None else self.shapes(k)
        if tracker is None or key in self.seen:
            yield
            return
        start = tracker.begin_repeat()
        try:
            yield
        except BaseException:
            tracker.end_repeat(start)
            raise
        repeat = tracker.end_repeat(start)
        if repeat is not None:
            self.seen[key] = repeat
            shared_repeat((self.tag, key), repeat)


@contextlib.contextmanager
def _restoring_buffers() -> Iterator[None]:
    modules = ModuleStack()
    with modules, BufferGuard(modules):
        yield


_LABEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("remat3d_run_label",
                                                                   default=None)


@contextlib.contextmanager
def labelled(label: str) -> Iterator[None]:
    """The tiled runs made inside are booked under ``label`` on a tracked step (a plan
    region's: ``runtime/apply.py``, ``fused.py``)."""
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)


class _TiledFunction(torch.autograd.Function):
    """See NOTE [ Tiled backward ]."""

    @staticmethod
    def forward(ctx: Any, run: TiledRun, n_inputs: int,  # type: ignore[override]
                slots: tuple[GradSlot, ...] | None, source: Rebuild | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = tensors[:n_inputs]
        ctx.run = run
        ctx.n_inputs = n_inputs
        ctx.amp = AmpState.capture(run.device)
        ctx.set_materialize_grads(False)  # an output without gradient costs nothing
        # inputs a rebuilt run made are not saved (NOTE [ Rebuilt tiled outputs ] rule 2)
        ctx.rebuilt = {i: made for i, x in enumerate(inputs)
                       if (made := getattr(x, REBUILT, None)) is not None}
        for producer, _ in ctx.rebuilt.values():
            producer.readers += 1
        ctx.save_for_backward(*[None if i in ctx.rebuilt else x for i, x in enumerate(inputs)])
        ctx.slots = slots  # this run's outputs' (NOTE [ Shared input gradients ] rule 2)
        ctx.read = [grad_slot(x) for x in inputs]  # its inputs' (rule 1)
        if source is not None:  # this run's outputs are rebuilt (rule 1)
            source.ctx = ctx
        return tuple(run.forward([x.detach() for x in inputs]))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *dys: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        run: TiledRun = ctx.run
        inputs = _saved_inputs(ctx, own=True, in_tiles=run.rebuild_in_tiles)
        needs = list(ctx.needs_input_grad[4:4 + ctx.n_inputs])
        if ctx.slots is not None:
            dys = tuple(_gathered(dy, slot.take()) for dy, slot in zip(dys, ctx.slots))
        if all(dy is None for dy in dys):
            return (None,) * len(ctx.needs_input_grad)
        with torch.enable_grad(), recomputing(), ctx.amp.restore(), _restoring_buffers():
            dx, dparams = run.backward(inputs, dys, needs, ctx.read)
        return (None, None, None, None, *dx, *dparams)


def _saved_inputs(ctx: Any, made: dict[Any, tuple[Any, ...]] | None = None,
                  own: bool = False, in_tiles: bool = False) -> list[Any]:
    """A tiled run's inputs in backward: those saved, and those rebuilt (NOTE [ Rebuilt
    tiled outputs ] rules 3, 5, 6 and 7; ``made``: the outputs rebuilt so far for this
    backward, by run, None for a reader's own backward; ``own``: the run's own backward,
    which takes the inputs its last reader's rebuild handed it; ``in_tiles``: rebuilt
    ones as :class:`TileSource` where they can be)."""
    handed = ctx.__dict__.pop("handed_inputs", None) if own else None
    if handed is not None:
        return handed
    reader = made is None
    made = {} if made is None else made
    inputs = list(ctx.saved_tensors)
    for i, (source, k) in ctx.rebuilt.items():
        inputs[i] = source.make(k, made, reader, in_tiles)
    return inputs


class Rebuild:
    """Where a rebuilt run's outputs come from again (NOTE [ Rebuilt tiled outputs ])."""

    def __init__(self, run: TiledRun, hand_inputs: bool = False) -> None:
        self.run = run
        self.ctx: Any = None  # the run's autograd context: its saved inputs (rule 3)
        self.hand_inputs = hand_inputs  # rule 6
        self.readers = 0      # the tiled runs that read an output without saving it
        self.taken = 0        # readers' backwards that took one, this backward

    def make(self, k: int, made: dict[Any, tuple[Any, ...]], reader: bool = False,
             in_tiles: bool = False) -> torch.Tensor | TileSource:
        """Output ``k``, the run's forward made again, or taken from ``made`` where a
        rebuild for the same backward made it already (rule 5); the caller holds it.
        ``reader``: for a reader's own backward (not for another rebuild); ``in_tiles``:
        for a reader that computes it tile by tile (rule 7)."""
        if self.ctx is None:
            raise RuntimeError("A rebuilt tiled output was read before its run's forward "
                               "finished.")
        last = False
        if reader:
            self.taken += 1
            last = self.taken >= self.readers
            if last:
                self.taken = 0
        if in_tiles and len(self.run.trace.outputs) == 1:  # rule 7: never whole
            key = ("tiles", id(self))
            if key not in made:
                made[key] = (TileSource(self, _saved_inputs(self.ctx, made, in_tiles=True)),)
            return made[key][0]  # type: ignore[no-any-return]
        outs = made.get(id(self))
        if outs is None:  # its own rebuilt inputs as its backward takes them (rule 7)
            inputs = _saved_inputs(self.ctx, made, in_tiles=self.run.rebuild_in_tiles)
            with torch.no_grad(), recomputing(), self.ctx.amp.restore(), \
                    _restoring_buffers():
                outs = made[id(self)] = tuple(self.run.rebuild([x.detach()
                                                                for x in inputs]))
            if last and self.hand_inputs and self.ctx.rebuilt:  # rule 6
                self.ctx.handed_inputs = inputs
            del inputs
        return outs[k]


class TileSource:
    """A rebuilt output that its reader's backward computes tile by tile, never whole
    (NOTE [ Rebuilt tiled outputs ] rule 7): what a tiled run's tiles read of an input in
    place of a slice of it."""

    def __init__(self, source: Rebuild, inputs: list[Any]) -> None:
        run = source.run
        self.source = source
        self.inputs = inputs  # the producing run's (tensors, or TileSources themselves)
        self.shape = torch.Size(run.trace.out_shapes[0])
        self.dtype = run.trace.out_dtypes[0]
        self.device = run.device
        self._keys: dict[tuple[Region, tuple[bool, ...]], tuple] = {}  # (want, flip) -> key

    def detach(self) -> TileSource:
        return self

    @property
    def isotropic(self) -> bool:
        """Whether the ops computing a part treat the axes alike (NOTE [ Repeats on meta ]
        rule 7): its run's and its own rebuilt inputs'."""
        return self.source.run.isotropic and all(
            x.isotropic for x in self.inputs if isinstance(x, TileSource))

    def part(self, want: Region) -> torch.Tensor:
        """The output over ``want`` (computed without grad)."""
        with torch.no_grad(), recomputing(), self.source.ctx.amp.restore(), \
                _restoring_buffers():
            return self.source.run.part_of_output(self.inputs, want)

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def layout(self) -> tuple:
        """What a part depends on besides its region (NOTE [ Repeats on meta ] rule 5)."""
        return ("tiles", self.source.run.digest(), _layout(self.inputs))

    def key(self, want: Region, flip: tuple[bool, ...]) -> tuple:
        """The shapes of everything a part over ``want`` computes (a tile's repeat key;
        ``flip``: the axes its reader's tile is seen mirrored on)."""
        key = self._keys.get((want, flip))
        if key is not None:  # a reader's tiles ask again in each of its passes
            return key
        run = self.source.run
        tr = run.trace
        plan = run.region_plan(want)
        key = self._keys[want, flip] = (
            tuple((node, _shape(region, tr.sizes[node], flip))
                  for node, region in sorted(plan.items())),
            tuple(x.key(plan.get(node, ((0, 1),) * 3), flip)
                  for x, node in zip(self.inputs, tr.inputs) if isinstance(x, TileSource)))
        return key


def _gathered(dy: torch.Tensor | None, shared: torch.Tensor | None) -> torch.Tensor | None:
    """An output's gradient: autograd's part and the tiled readers' shared part (rule 2)."""
    if shared is None or dy is None:
        return dy if shared is None else shared
    return shared.add_(dy if dy.device == shared.device else dy.to(shared.device))


def tile(fn: Callable[..., Any], *inputs: torch.Tensor, tile: TileSize = 64,
         host: bool = False, device: torch.device | str | None = None,
         stash: str | None = None, stash_norms: Sequence[int] | None = None,
         share_grads: bool = False, rebuild: bool = False,
         hand_inputs: bool = False, rebuild_in_tiles: bool = False) -> Any:
    """``fn(*inputs)``, computed tile by tile over the output's spatial volume, exactly.

    ``fn`` (a module or function of 5-D tensors ``(N, C, D, H, W)``) must be spatially
    local: convolutions (any kernel, stride, padding, dilation, groups), transposed
    convolutions, max/avg pooling, nearest/trilinear upsampling by integer factors,
    pointwise ops, concatenation over channels, residual additions, and Instance/Group/
    BatchNorm (whole-volume statistics, gathered over tiles). ``tile`` is the output tile
    edge (one int, or D, H, W); it need not divide the volume. ``fn`` may return a tuple
    of tensors (e.g. a skip connection and a downsampled map): tiles are laid on the
    first one's volume and the others are split by the same, scaled boundaries.

    Forward keeps only ``inputs``; backward recomputes tile by tile (NOTE [ Tiled
    backward ]). Outputs and gradients equal ``fn(*inputs)``'s up to rounding order.

    ``host=True`` returns the outputs in host memory (pinned CPU memory on CUDA): pass
    them to other ``tile`` calls, which read them slice by slice and keep their gradients
    on the host too, so the device never holds them (NOTE [ Host-resident tiled
    outputs ]). Anything else needs them on the device: ``y.to(device)``. ``device``:
    where the run computes (default: its first device-resident input's device, else its
    first parameter's). ``stash="device"`` or ``"host"`` keeps each normalisation's input
    whole while the passes that read it run, so that later passes start from it instead
    of recomputing from the inputs (NOTE [ Stashed passes ]): fewer FLOPs, more memory;
    ``stash_norms``: only those normalisations' inputs, by their order in the run.
    ``share_grads=True``: the tiled runs that read the outputs add their input gradients
    into one tensor per output instead of one each (NOTE [ Shared input gradients ]);
    then a tensor hook on an output, or ``torch.autograd.grad`` with respect to it, sees
    only the gradient of its readers that are not tiled runs. ``rebuild=True``: the tiled
    runs that read the outputs do not keep them for their backward; each of those
    backwards runs this run's forward again (NOTE [ Rebuilt tiled outputs ]): the outputs
    are whole only inside those backwards, at one forward more per reader;
    ``hand_inputs=True``: the last of those rebuilds hands the inputs it rebuilt to this
    run's own backward (rule 6). ``rebuild_in_tiles=True``: this run's backward (and each
    rebuild of it) computes each tile's part of the rebuilt outputs it reads, never the
    whole of them (rule 7): less memory, more compute.

    >>> import torch, remat3d
    >>> block = torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3, padding=1),
    ...                             torch.nn.InstanceNorm3d(4), torch.nn.ReLU())
    >>> x = torch.randn(1, 1, 12, 12, 12)
    >>> y = remat3d.tile(block, x, tile=5)
    >>> torch.allclose(y, block(x), atol=1e-5)
    True
    """
    if rebuild and host:
        raise TilingError("A tiled run's outputs are kept in host memory or rebuilt, not "
                          "both: give host=True or rebuild=True.")
    if hand_inputs and not rebuild:
        raise TilingError("hand_inputs=True hands a rebuilt run's rebuilt inputs to its "
                          "own backward; give rebuild=True too.")
    run = TiledRun(fn, inputs, tile, host_outputs=host, stash=stash, stash_norms=stash_norms,
                   device=None if device is None else torch.device(device))
    run.rebuild_in_tiles = rebuild_in_tiles
    params = [p for p in run.trace.params if p.requires_grad]
    needs_graph = torch.is_grad_enabled() and (any(x.requires_grad for x in inputs)
                                               or bool(params))
    if not needs_graph:
        with torch.no_grad():
            outs = tuple(run.forward(list(inputs)))
    else:
        slots = tuple(GradSlot() for _ in run.trace.outputs) if share_grads else None
        source = Rebuild(run, hand_inputs) if rebuild else None
        outs = _TiledFunction.apply(run, len(inputs), slots, source, *inputs, *params)
        for out, slot in zip(outs, slots or ()):
            setattr(out, GRAD_SLOT, slot)
        for k, out in enumerate(outs if source is not None else ()):
            setattr(out, REBUILT, (source, k))
    if host:
        for out in outs:
            mark_host(out)
    return outs if run.trace.returns_tuple else outs[0]

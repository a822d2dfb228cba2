"""Executing a graph plan: the step traced by AOTAutograd (``capture/joint.py``), split so
that the forward saves what the plan keeps and the backward recomputes the rest.

NOTE [ Running a graph plan ]
  1. The partition function tags each node the plan recomputes ``MUST_RECOMPUTE`` (the
     tag ``torch.utils.checkpoint``'s selective policies put on a joint graph) and hands
     the graph to torch's ``default_partition``: the backward graph gets copies of the
     recomputed ops, placed where backward first needs them; everything else the backward
     reads is saved. A node the plan recomputes *twice* then gets a second copy for its
     late readers (``recompute_twice``: the placement is ``planner/liveness.py``'s
     ``late_copies``, the function the planner simulates with). Nothing is decided here
     that ``planner/liveness.py`` does not model. A BatchNorm in training recomputed in
     backward runs without its running statistics (``recompute_without_running_stats``):
     its output reads none, and they were updated in place after the forward.
     The backward's recomputed ops run inside ``is_recomputing()`` (``mark_recomputation``),
     as a region's do: the tracker books their FLOPs as recomputation.
  2. The graphs run op by op, the same aten kernels as eager, so gradients and buffers are
     those of ordinary training (on CPU in fp32 with deterministic algorithms, bitwise).
  3. The model object, its parameters, buffers and ``state_dict`` stay as they are: only
     the instance's ``forward`` is replaced, and :func:`remove_graph_plan` deletes it.
  4. A graph is for one input signature (shapes, dtypes, train/eval, grad mode): another
     one raises :class:`PlanError` asking for a new plan, never runs a stale graph. A
     call without grad (inference, validation under ``torch.no_grad``) keeps nothing for
     a backward: it runs the model's own forward, any shape, as the unplanned model runs
     it (under the caller's autocast, if any; the plan's own autocast rules are for its
     training step), as module plans' regions do.
  5. A plan made for ``amp`` runs its training step's forward under CUDA autocast's
     rules wherever it runs (``capture/joint.py``, NOTE rule 6; a call without grad is
     rule 4's): a caller's ``torch.autocast`` of the same
     dtype changes nothing, one of another dtype, or autocast around a plan made for full
     precision, is refused by name; the graph traced must be the graph planned
     (``graph_digest``), or the step raises instead of running another graph's plan.
  6. :func:`measure_graph_plan` measures a plan's step under the tracker on fake tensors
     (``capture/joint.py``'s ``fake_step``): traced on a first, untracked call, measured on
     the second, the output held through backward as everywhere else. A loss function's
     own targets (a meta or real label it closes over) are fakes of the step's device in
     the ops it runs (``_LossTargets``), counted from the step's start.
  7. The first call traces the step on fake copies of the parameters, buffers and inputs,
     outside every dispatch mode, before it runs on the real ones: a tracker around a
     training step (the trainer measures each shape's first steps) sees the step, not the
     trace, and tracing allocates nothing.
  8. A plan made for compilation (``Plan.graph_backend == "inductor"``) has its two graphs
     compiled by inductor when the step is traced (``runtime/inductor.py``, NOTE [ Graph
     plans compiled by inductor ]); nothing else above changes. Compiled already, its
     step is left out of dynamo's trace when the user compiles the model too
     (``torch.compiler.disable``): the model's forward is the plan's step, so dynamo has
     nothing of its own to compile, and tracing the step again would let torch's
     partitioner choose what is saved instead of the plan. A call without grad (rule 4:
     validation, inference) runs the model's own forward under ``torch.compile`` (the
     plan says the model runs compiled; it is compiled once per shape, as a compiled
     model's is). A step inductor cannot compile runs op by op instead, with one warning
     (the memory verified is that run's).
  9. A plan with a ``GraphTiling`` (``Plan.graph_tiling``) has both graphs rewritten after
     the partition: their finest grids' ops run in tiled regions (``runtime/tiled_graph.py``,
     NOTE [ Running tiled regions ]); the normalisations the backward recomputes read the
     statistics the forward saved. Everything above holds for the rewritten graphs.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from remat3d.capture.joint import (
    aot_step,
    batch_norm_in_training,
    fake_like,
    fake_step,
    graph_digest,
    swapped_weights,
    tracing_errors,
)
from remat3d.errors import CaptureError, PlanError, Remat3dError, quoted
from remat3d.instrument.amp import ambient_autocast, amp_dtype, amp_name
from remat3d.planner.liveness import late_copies
from remat3d.planspec import GRAPH_BACKENDS, GraphTiling
from remat3d.runtime.inductor import (
    InductorFailure,
    compiler_for,
    inductor_lowering,
    inductor_settings,
)
from remat3d.runtime.tiled_graph import save_norm_statistics, tile_graph

__all__ = ["GraphStep", "apply_graph_plan", "graph_plan_of", "mark_recomputation",
           "measure_applied_graph_plan", "measure_graph_plan", "remove_graph_plan",
           "tagged_partition"]

_ATTR = "_remat3d_graph_plan"


def tagged_partition(recompute: Iterable[str], digest: str | None = None,
                     twice: Iterable[str] = (), tiling: GraphTiling | None = None) -> Any:
    """A partition function recomputing the nodes named ``recompute``, those of ``twice`` a
    second time for their late readers (NOTE rule 1), of a joint graph whose
    :func:`graph_digest` is ``digest`` (None: not checked); with ``tiling``, the ops of
    both graphs on its finest grids run in tiled regions (``runtime/tiled_graph.py``)."""
    from torch._functorch.partitioners import default_partition
    from torch.utils.checkpoint import CheckpointPolicy

    names = set(recompute)
    again = set(twice)

    def partition(joint: fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int,
                  **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        found = {n.name for n in joint.graph.nodes}
        missing = sorted(names - found)
        if missing or (digest is not None and graph_digest(joint) != digest):
            raise PlanError(
                "This step's graph is not the one the graph plan was made for (it "
                + (f"recomputes nodes the graph does not have: {', '.join(missing[:5])}"
                   f"{', ...' if len(missing) > 5 else ''}" if missing else
                   "differs in its ops") +
                "): the plan was made for another model, input shape or precision. "
                "Plan this step again."
            )
        for node in joint.graph.nodes:
            if node.name in names:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                node.meta["ac_graph_id"] = 0
        forward, backward = default_partition(joint, joint_inputs,
                                              num_fwd_outputs=num_fwd_outputs, **kwargs)
        if recompute_without_running_stats(backward):
            _drop_unread_saved(forward, backward, num_fwd_outputs)
        copies = recompute_twice(backward, again) if again else []
        if tiling is not None:
            save_norm_statistics(forward, backward, num_fwd_outputs)
            per = dict(tiling.stashes)
            tile_graph(forward, tiling.tile, levels=tiling.levels, stash=tiling.stash,
                       copy=tiling.copy, label="forward", stashes=per)
            tile_graph(backward, tiling.tile, names | {c.name for c in copies},
                       levels=tiling.levels, stash=tiling.stash, copy=tiling.copy,
                       label="backward", stashes=per)
        mark_recomputation(backward, names, copies)
        return forward, backward

    return partition


def recompute_without_running_stats(backward: fx.GraphModule) -> bool:
    """A BatchNorm the backward recomputes runs without its running statistics (NOTE
    rule 1): in training its output, mean and inverse std read none of them, the same
    kernel computes them bitwise alike, and the statistics the forward updated in place
    are then not read after the update (autograd's version check refused it). Whether
    any was rewritten (the statistics are then saved for nothing: ``_drop_unread_saved``)."""
    changed = False
    for node in list(backward.graph.nodes):
        if node.op != "call_function" or not batch_norm_in_training(node) or \
                any(u.target is not operator.getitem or u.args[1] > 2 for u in node.users):
            continue
        x, weight, bias, _, _, training, momentum, eps = node.args
        with backward.graph.inserting_before(node):
            plain = backward.graph.call_function(
                torch.ops.aten._native_batch_norm_legit.no_stats,
                (x, weight, bias, training, momentum, eps))
        plain.meta = dict(node.meta)
        if isinstance(plain.meta.get("val"), (tuple, list)):  # three outputs, not five
            plain.meta["val"] = tuple(plain.meta["val"][:3])
        node.replace_all_uses_with(plain)
        name = node.name
        backward.graph.erase_node(node)
        # the old name kept (a plan names nodes: recomputed twice, say); the namespace
        # has it reserved, so no later node takes it
        plain.name = name
        backward.graph._graph_namespace._rename_object(plain, name)
        changed = True
    if changed:
        backward.graph.lint()
        backward.recompile()
    return changed


def _drop_unread_saved(forward: fx.GraphModule, backward: fx.GraphModule,
                       num_fwd_outputs: int) -> None:
    """Saved tensors the backward no longer reads, left out of both graphs: the forward
    returns its outputs, then what it saves, in the order of the backward's first inputs
    (``default_partition``'s convention, which AOTAutograd reads back from the graphs)."""
    saved = [n for n in backward.graph.nodes
             if n.op == "placeholder" and not n.name.startswith("tangents")]
    (output,) = [n for n in forward.graph.nodes if n.op == "output"]
    results = list(output.args[0])
    unread = [k for k, node in enumerate(saved) if not node.users]
    for k in reversed(unread):
        backward.graph.erase_node(saved[k])
        del results[num_fwd_outputs + k]
    output.args = (tuple(results),)
    for module in (forward, backward):
        module.graph.eliminate_dead_code()
        module.graph.lint()
        module.recompile()


def recompute_twice(backward: fx.GraphModule, twice: set[str]) -> list[fx.Node]:
    """Give the late readers of each recomputed node of ``twice`` a second recomputation
    of it, as ``planner/liveness.py``'s :func:`late_copies` places it (NOTE rule 1).
    Returns the copies made."""
    graph = backward.graph
    ops = [n for n in graph.nodes if n.op == "call_function"]
    steps = late_copies([(n.name, [a.name for a in n.all_input_nodes]) for n in ops],
                        {n.name for n in ops} & twice)
    env: dict[str, fx.Node] = {n.name: n for n in graph.nodes}
    pending: list[tuple[str, str, list[str]]] = []
    copies: list[fx.Node] = []
    for name, source, inputs in steps:
        if name != source:
            pending.append((name, source, inputs))
            continue
        node = env[name]
        for copy, original, copy_inputs in pending:  # just before their first reader
            renamed = dict(zip((a.name for a in env[original].all_input_nodes), copy_inputs))
            with graph.inserting_before(node):
                env[copy] = graph.node_copy(env[original],
                                            lambda a, r=renamed: env[r.get(a.name, a.name)])
                copies.append(env[copy])
        pending.clear()
        for old, new in zip([a.name for a in node.all_input_nodes], inputs):
            if old != new:
                node.replace_input_with(env[old], env[new])
    graph.lint()
    backward.recompile()
    return copies


def mark_recomputation(backward: fx.GraphModule, recompute: set[str],
                       copies: Iterable[fx.Node] = ()) -> None:
    """Run the backward's recomputed ops (those named ``recompute``, and ``copies``) inside
    :func:`remat3d.is_recomputing`, as a region's recomputation runs (NOTE rule 1): the
    tracker books their FLOPs as recomputation, and code that asks sees the truth."""
    marked = [n for n in backward.graph.nodes if n.name in recompute] + list(copies)
    for node in marked:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            node.target = _recomputed(node.target)
    backward.recompile()


def _recomputed(op: Any) -> Any:
    """``op`` run as a recomputation (exception-safe: the depth is restored however it
    ends)."""
    from remat3d.instrument.state import recomputing

    def run(*args: Any, **kwargs: Any) -> Any:
        with recomputing():
            return op(*args, **kwargs)

    run.__name__ = f"recomputed_{op.__name__.replace('.', '_')}"
    run.__qualname__ = run.__name__
    return run


def _signature(args: tuple, model: nn.Module) -> tuple:
    tensors = tuple((tuple(a.shape), a.dtype, a.device.type, a.requires_grad)
                    if isinstance(a, torch.Tensor) else type(a) for a in args)
    return tensors, model.training, torch.is_grad_enabled()


class _GraphPlan:
    def __init__(self, model: nn.Module, recompute: Iterable[str],
                 input_shapes: list[list[int]] | None, amp: str | None,
                 digest: str | None, twice: Iterable[str], backend: str,
                 settings: dict[str, Any] | None = None,
                 tiling: GraphTiling | None = None) -> None:
        self.recompute = sorted(set(recompute))
        self.tiling = tiling
        self.settings = settings or {}  # inductor's config (runtime/inductor.py rule 5)
        self.twice = sorted(set(twice))
        self.amp = amp_dtype(amp)
        self.backend = backend
        self.digest = digest
        self.model = model
        self.step = self._step()
        self._inference: Any = None  # rule 8: calls without grad, compiled by torch
        self.input_shapes = input_shapes
        self.signature: tuple | None = None

    def _step(self) -> Any:
        return aot_step(self.model, tagged_partition(self.recompute, self.digest, self.twice,
                                                     self.tiling),
                        self.amp, compiler_for(self.backend, self.settings))

    def _trace_or_run_eagerly(self, args: tuple) -> None:
        """Trace (rule 7); a step inductor fails to compile runs its graphs op by op
        instead, as verified, with one warning naming why (rule 8)."""
        try:
            self._trace(args)
        except InductorFailure as exc:
            warnings.warn(
                f"Inductor could not compile the graph plan's step of "
                f"{type(self.model).__name__} ({quoted(exc) or 'no message'}); its "
                "graphs run op by op instead, as "
                "the plan was verified (the same memory, eager's speed).",
                RuntimeWarning, stacklevel=3)
            self.backend = "eager"
            self.step = self._step()
            self._trace(args)

    def _trace(self, args: tuple) -> None:
        """Trace the step on fake copies of the parameters, buffers and inputs, outside
        every dispatch mode (NOTE rule 7): the real call then runs the traced graphs."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import _disable_current_modes

        mode = FakeTensorMode()

        def fake(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            made = mode.from_tensor(t)
            if made.is_leaf and made.requires_grad != t.requires_grad:
                made.requires_grad_(t.requires_grad)
            return made

        named = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        with _disable_current_modes(), inductor_lowering(self.backend), \
                swapped_weights(self.model, {k: fake(t) for k, t in named.items()}):
            self.step(*[fake(a) for a in args])

    def _check_autocast(self) -> None:
        for device, dtype in ambient_autocast():
            if self.amp is None:
                raise PlanError(
                    f"This graph plan was made for full precision (amp=None), but the step "
                    f"runs under torch.autocast({device!r}, dtype={dtype}). Plan it with "
                    f"amp={amp_name(dtype)!r}, or run it outside autocast.")
            if dtype != self.amp:
                raise PlanError(
                    f"This graph plan was made for autocast to {self.amp} and runs it "
                    f"itself, but the step runs under torch.autocast({device!r}, "
                    f"dtype={dtype}). Plan it for that dtype, or leave autocast to the plan.")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # NOTE rule 4: nothing saved, nothing to plan
            if self.backend == "inductor":  # rule 8: compiled, as the plan's steps are
                if self._inference is None:
                    self._inference = torch.compile(type(self.model).forward,
                                                    options=self.settings)
                return self._inference(self.model, *args, **kwargs)
            return type(self.model).forward(self.model, *args, **kwargs)
        if kwargs:
            raise PlanError("A graph plan runs a forward with positional inputs only; pass "
                            f"{', '.join(kwargs)} positionally or use a module plan.")
        self._check_autocast()
        signature = _signature(args, self.model)
        if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args):
            raise PlanError(
                "A graph plan does not run on the meta device (traced from meta tensors, "
                "some ops lose their backward: capture/joint.py). remat3d.plan measured it "
                "already (Plan.verified_peak_bytes, on fake tensors); run it on real ones.")
        if self.signature is None:
            shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
            if self.input_shapes is not None and shapes != self.input_shapes:
                raise PlanError(
                    f"This graph plan was made for inputs of shape {self.input_shapes}; the "
                    f"model got {shapes}. A graph is for one input shape: plan this one."
                )
            with tracing_errors(self.model):
                self._trace_or_run_eagerly(args)
                self.signature = signature  # traced: later calls run the graphs
                return self.step(*args)
        if signature != self.signature:
            raise PlanError(
                f"This graph plan was made for inputs {self.signature[0]} (training="
                f"{self.signature[1]}, grad={self.signature[2]}); the model got {signature[0]}"
                f" (training={signature[1]}, grad={signature[2]}). A graph is for one input "
                "signature: plan this one, or remove the plan (remat3d.remove)."
            )
        return self.step(*args)


def apply_graph_plan(model: nn.Module, recompute: Iterable[str],
                     input_shapes: list[list[int]] | None = None, amp: str | None = None,
                     digest: str | None = None, twice: Iterable[str] = (),
                     backend: str = "eager",
                     compile_options: Mapping[str, Any] | None = None,
                     tiling: GraphTiling | None = None) -> nn.Module:
    """Run ``model``'s steps as graphs that recompute the nodes ``recompute`` names
    (NOTE rules 1-3), a set closed as ``planner.liveness.closed_recompute`` closes it (what
    the planner gives), for inputs of ``input_shapes`` (None: the first call's), the
    forward under ``amp``'s autocast rules (rule 5), in a graph whose ``graph_digest`` is
    ``digest`` (None: not checked); those of ``twice`` (a subset of ``recompute``) are
    recomputed a second time for their late readers. ``backend``: the graphs run op by
    op (``"eager"``) or compiled by inductor (``"inductor"``, ``runtime/inductor.py``;
    rule 8), with ``compile_options`` (``mode``, ``options``, as ``torch.compile`` takes
    them; inductor only: ``runtime/inductor.py`` NOTE rule 5). ``tiling``: the finest
    grids' ops run in tiled regions (``runtime/tiled_graph.py``).
    Returns the same model object."""
    if graph_plan_of(model) is not None:
        raise PlanError(f"{type(model).__name__} already runs a graph plan; "
                        "remove it first (remat3d.runtime.graph_run.remove_graph_plan).")
    if backend not in GRAPH_BACKENDS:
        raise PlanError(f"A graph plan runs its graphs with one of {GRAPH_BACKENDS}, not "
                        f"{backend!r}.")
    if compile_options and backend != "inductor":
        raise PlanError("compile_options are for a plan whose graphs inductor compiles "
                        "(made with compiled=True); this plan runs its graphs op by op.")
    settings = inductor_settings(compile_options) if backend == "inductor" else None
    plan = _GraphPlan(model, recompute, input_shapes, amp, digest, twice, backend, settings,
                      tiling)
    # compiled by remat3d already, an inductor plan is left out of dynamo's trace of a
    # torch.compile around the model (rule 8)
    model.forward = (plan if backend == "eager"  # type: ignore[method-assign]
                     else torch.compiler.disable(plan))
    setattr(model, _ATTR, plan)
    return model


def graph_plan_of(model: nn.Module) -> list[str] | None:
    """The nodes the applied graph plan recomputes (None: no graph plan applied)."""
    plan = model.__dict__.get(_ATTR)
    return None if plan is None else list(plan.recompute)


def remove_graph_plan(model: nn.Module) -> nn.Module:
    """Back to the model's own forward."""
    if model.__dict__.pop(_ATTR, None) is not None:
        model.__dict__.pop("forward", None)
    return model


@dataclass
class GraphStep:
    """One step of a graph plan as the tracker measured it."""

    peak_bytes: int
    saved_bytes: int  # what the forward left alive for the backward (the output not)
    flops: dict[str, int]  # per phase: forward, backward, recompute
    breakdown: dict[str, int]  # the peak's bytes by kind (tracker.peak_breakdown)
    amp: torch.dtype | None = None  # the precision the plan's forward ran in
    # per tiled region's label (runtime/tiled_graph.py NOTE rule 7): its peak and FLOPs
    regions: dict[str, tuple[int, int]] = field(default_factory=dict)


def measure_graph_plan(model: nn.Module, inputs: tuple, recompute: Iterable[str],
                       device: str | None = None, amp: str | None = None,
                       twice: Iterable[str] = (), loss_fn: Any = None,
                       tiling: GraphTiling | None = None) -> GraphStep:
    """One step of ``model`` running the graph plan (``recompute``, ``twice``, ``tiling``) under
    ``amp``, measured by the tracker on fake tensors (NOTE rule 6); ``loss_fn`` (default:
    remat3d's) gets the fake output."""
    from remat3d.instrument.step import default_loss
    from remat3d.instrument.tracker import MemoryTracker

    loss = loss_fn or default_loss
    fake_model, fake_inputs = fake_step(model, inputs, device)
    targets = _LossTargets(loss, fake_inputs[0])
    apply_graph_plan(fake_model, recompute, amp=amp, twice=twice, tiling=tiling)
    # traced here, untracked; the graphs enter the fake mode themselves (not entered
    # here: AOTAutograd deep-copies the backward graph on its first run, and a lifted
    # constant, a torch.tensor(2.0) in forward, is a real tensor it cannot copy under it)
    output = fake_model(*fake_inputs)
    with targets.allowing_real():
        try:
            with targets:
                value = loss(output)
        except Remat3dError:
            raise
        except Exception as exc:  # the caller plans the modules instead (CaptureError)
            raise CaptureError(
                f"The loss function could not run on the graph plan's step on fake tensors: "
                f"{type(exc).__name__}: {quoted(exc) or 'no message'} Graph plans run the "
                "loss on fake tensors of the model's device; keep its targets as tensors it "
                "holds (a closure, a functools.partial) or on the meta device."
            ) from exc
        value.backward()
    del output, value
    for p in fake_model.parameters():
        p.grad = None
    tracker = MemoryTracker(fake_inputs[0].device)
    try:
        tracker.register_model(fake_model)
        tracker.register(list(fake_inputs), "input")
        # the loss's own targets, alive through the step as in module plans' steps
        tracker.register(targets.fakes, "input")
        # the fake mode entered beneath the tracker, which must see every op first
        with fake_inputs[0].fake_mode, tracker:
            output = fake_model(*fake_inputs)
            tracker.mark_forward_end(output)
            tracker.phase = "backward"
            with targets.allowing_real():
                with targets:  # outside the fake mode (``_LossTargets``); the tracker sees it
                    value = loss(output)
                value.backward()
            del output, value
    finally:
        tracker.close()
    regions = {name: (parts.get("region", 0), tracker.window_flops().get(name, 0))
               for name, parts in tracker.window_peaks().items()}
    return GraphStep(tracker.peak_bytes, tracker.saved_bytes, dict(tracker.flops),
                     tracker.peak_breakdown(), amp_dtype(amp), regions)


class _LossTargets(TorchFunctionMode):
    """The tensors a loss function holds (its targets: ``instrument/step.held_tensors``)
    replaced, in the ops the loss runs, by fake tensors of the measured step's device
    (NOTE rule 6), and so is any other meta tensor its ops read (a label held as a
    global or an attribute). A planning loss holds a meta label (the trainer's, module
    plans are verified on meta) or a real one; the graph plan's step runs on fake tensors of the
    model's device, where either would be refused by the fake mode or mixed devices. The
    values do not matter for memory; the fakes are registered with the tracker from the
    step's start, as module plans' steps count the targets.

    The loss runs outside the fake mode, as module plans' losses run on meta: what it
    makes from nothing is real (a MONAI loss reads ``torch.arange(...).tolist()``, which a
    fake tensor cannot answer), and a real tensor it mixes with the fake output is made
    fake by the mode (``allow_non_fake_inputs``, for the loss and the backward only: the
    loss's backward reads what it saved)."""

    def __init__(self, loss: Any, like: torch.Tensor) -> None:
        from remat3d.instrument.step import held_tensors

        super().__init__()
        mode = like.fake_mode  # type: ignore[attr-defined]
        self._mode = mode
        self._stack = contextlib.ExitStack()
        self._device = like.device
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for t in held_tensors(loss):
            if not isinstance(t, FakeTensor):
                self._held[id(t)] = (t, self._fake(t))
        self._counted = len(self._held)

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        fake = fake_like(self._mode, t, self._device)
        return fake.requires_grad_(t.requires_grad) if fake.is_leaf else fake

    @property
    def fakes(self) -> list[torch.Tensor]:
        """The fakes of the tensors the loss holds (counted from the step's start)."""
        return [fake for _, fake in list(self._held.values())[:self._counted]]

    @contextlib.contextmanager
    def allowing_real(self) -> Iterator[None]:
        """Real tensors mixed with fake ones made fake (the loss's, in its backward too)."""
        allowed = self._mode.allow_non_fake_inputs
        self._mode.allow_non_fake_inputs = True
        try:
            yield
        finally:
            self._mode.allow_non_fake_inputs = allowed

    def __enter__(self) -> _LossTargets:
        self._stack.enter_context(unset_fake_temporarily())
        try:
            super().__enter__()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._stack.close()

    def _swap(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
            pair = self._held.get(id(x))
            if pair is not None and pair[0] is x:
                return pair[1]
            if x.device.type == "meta":  # a target held otherwise (a global, an attribute):
                # a fake of the step's device too, made when first read (the original is
                # kept with it, so its id is not reused); not counted from the start,
                # as module plans' steps do not find it either
                self._held[id(x)] = (x, self._fake(x))
                return self._held[id(x)][1]
        return x

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        args, kwargs = tree_map(self._swap, (args, kwargs or {}))
        return func(*args, **kwargs)


def measure_applied_graph_plan(model: nn.Module, inputs: tuple, amp: str | None = None,
                               loss_fn: Any = None) -> GraphStep:
    """One step of ``model`` with the graph plan applied to it, measured on fake tensors
    (what ``remat3d.measure(..., device="meta")`` does for it: the graphs do not run on
    meta). ``amp`` must be the plan's own, or None."""
    plan = model.__dict__.get(_ATTR)
    if plan is None:
        raise PlanError(f"{type(model).__name__} runs no graph plan.")
    if amp is not None and amp_dtype(amp) != plan.amp:
        raise PlanError(
            f"This graph plan was made for amp="
            f"{None if plan.amp is None else amp_name(plan.amp)!r} and runs it itself; "
            f"measured with amp={amp!r}. Measure it with the plan's amp, or plan again.")
    forward = model.__dict__.pop("forward")
    del model.__dict__[_ATTR]
    try:  # the model's own forward traced, the plan's choices applied to a fake copy
        return measure_graph_plan(model, inputs, plan.recompute, twice=plan.twice,
                                  amp=None if plan.amp is None else amp_name(plan.amp),
                                  loss_fn=loss_fn)
    finally:
        model.__dict__["forward"] = forward
        model.__dict__[_ATTR] = plan

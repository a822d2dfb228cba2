"""The model's forward and backward as one aten graph, traced by AOTAutograd.

NOTE [ Tracing the joint graph ]
  1. ``functorch.compile.aot_function`` (over the model's parameters, buffers and inputs,
     ``aot_step``) traces the model's forward with ``make_fx`` and
     autograd's formulas into one functional graph of aten ops, forward then backward
     (the *joint graph*), and hands it to a partition function, which splits it into the
     forward graph and the backward graph and decides what the forward saves for the
     backward: the place torch's own min-cut partitioner sits. remat3d's partition
     function (``runtime/graph_run.py``) decides by the plan.
  2. Tracing runs the model's Python ``forward`` as written, so the ops a parent's own
     code runs (a ``torch.cat`` of a skip, an ``F.interpolate``, a residual ``+``) are
     nodes like any other: the module tree does not bound what a plan can reach. No
     dynamo: nothing is cached process-wide, there are no graph breaks; Python control
     flow is taken as it goes for this input shape (a plan is for one shape anyway).
  3. Tracing runs on fake tensors of the model's device (``cpu`` for a meta model): no
     memory is allocated, so a 512³ step is traced on any machine, and each op takes the
     device's own path. The graphs run inside their ``FakeTensorMode`` (``run`` enters
     it unless it is active): a tensor a graph makes from nothing (``arange`` of an
     upsampling's indices, SwinUNETR's attention mask) is fake too.
     (Not meta tensors: traced from meta inputs, ``aten::prelu``'s backward went
     missing from the joint graph, autograd only warning that "an autograd kernel was
     not registered", so a PReLU network lost most of its gradients.)
  4. What cannot be traced (control flow on a tensor's values, ``.item()``, an op with no
     meta kernel) raises :class:`CaptureError` naming the cause; module plans need no
     graph.
  5. The graphs run op by op, the same aten kernels as eager, boxed (``run_eagerly``):
     each tensor, inputs included, is freed after its last use.
  6. Mixed precision is part of the graph. A step for ``amp`` traces its forward under
     CUDA autocast's rules (``instrument/amp.py``'s ``MetaAutocast`` on every device, the
     rules remat3d measures every plan with), and its backward without autocast (eager's
     ``loss.backward()`` outside the ``autocast`` block): the casts are nodes like any
     other, which the planner may recompute. The caller's own ``torch.autocast`` is off
     while the graph is traced and run (its casts are in the graph already), so a plan
     means the same step on every device.
  7. :func:`graph_digest` fingerprints a joint graph (its nodes, their ops and arguments):
     a plan names nodes, and names alone could match a different graph (another precision
     shifts every ``_to_copy``); the digest tells the step it runs in is the one planned.
  8. Before the partition, copies that functionalization adds and eager never makes (an
     in-place activation's backward: ``copy``, ``clone`` of a tensor into the same
     layout) are elided (``_elide_copies``): their readers read the source, the same
     bits, and the graph holds two fewer full-resolution tensors per such activation.
  9. Upsampling is traced as eager runs it (``_eager_upsampling``): the Python
     decompositions of ``upsample_*`` that tracing would use are set aside while it
     traces, so ``upsample_trilinear3d`` and its backward are the eager kernels (bitwise).
  10. :func:`capture` names, on each node, the module whose forward ran it (its qualified
     name; "" the model's own forward: a parent's ``torch.cat``), for reports: forward
     hooks on the traced copy set torch's FX annotation (``torch.fx.traceback.annotate``,
     which the tracer copies into each node's ``meta["custom"]``; a backward node gets
     its forward node's), innermost module last; the hooks go with the copy, and an
     annotation left open by a forward that raised is closed. The graph is the same
     without them (its digest too).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from remat3d.errors import CaptureError, Remat3dError, quoted
from remat3d.instrument.amp import MetaAutocast, ambient_autocast
from remat3d.instrument.flops import op_flops
from remat3d.opgraph import OpGraph, OpNode

__all__ = [
    "Captured",
    "PartitionFn",
    "aot_step",
    "capture",
    "fake_like",
    "fake_step",
    "graph_digest",
    "op_graph",
    "run_eagerly",
    "swapped_weights",
]

# (joint graph, its example inputs, number of forward outputs) -> (forward, backward)
PartitionFn = Callable[[fx.GraphModule, Any, int], tuple[fx.GraphModule, fx.GraphModule]]


@dataclass
class Captured:
    """A traced step: the plain-data graph and the joint FX graph it was read from."""

    graph: OpGraph
    joint: fx.GraphModule
    digest: str  # graph_digest(joint)
    joint_inputs: Any = None  # the joint graph's example inputs (fake), as partitioners get
    num_fwd_outputs: int = 0


def run_eagerly(gm: fx.GraphModule, example_inputs: Any) -> Callable:
    """``gm`` run op by op, taking its inputs as one list it empties (torch's boxed calling
    convention): each input is freed after its last use, not held to the graph's end."""
    from torch.fx.graph import _BoxedCodeGen  # what torch's own aot_eager backend uses

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    forward = gm.forward

    def run(args: list) -> Any:
        mode = _fake_mode_to_enter(args)
        if mode is None:
            return forward(args)
        with mode:  # NOTE rule 3: what the graph makes from nothing is fake too
            return forward(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


@contextlib.contextmanager
def _without_ambient_autocast() -> Iterator[None]:
    """The caller's ``torch.autocast`` off (NOTE rule 6)."""
    with contextlib.ExitStack() as stack:
        for device, _ in ambient_autocast():
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _forward_precision(amp: torch.dtype | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if amp is None else MetaAutocast(amp, any_device=True)


def _fake_mode_to_enter(args: list) -> Any:
    """The fake mode of ``args``' fake tensors, unless it is active already (the caller's,
    beneath a tracker that must see every op)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    mode = next((a.fake_mode for a in args if isinstance(a, FakeTensor)), None)
    if mode is None or any(m is mode for m in _get_current_dispatch_mode_stack()):
        return None
    return mode


def aot_step(model: nn.Module, partition: PartitionFn,
             amp: torch.dtype | None = None,
             compiler: Callable[[fx.GraphModule, Any], Callable] | None = None,
             ) -> Callable[..., Any]:
    """A callable running ``model``'s class ``forward`` (under ``amp``'s autocast rules),
    traced by AOTAutograd on its first call, split by ``partition``, its graphs run
    eagerly (NOTE rules 1, 5 and 6) or made runnable by ``compiler`` (a graph and its
    example inputs -> a boxed callable; ``runtime/inductor.py``). It reads the model's
    parameters and buffers at every call, so they stay the model's own."""
    from functorch.compile import aot_function

    def functional(params: dict[str, Any], buffers: dict[str, Any], *args: Any) -> Any:
        with _own_forward(model), swapped_weights(model, {**params, **buffers}), \
                _forward_precision(amp):
            return model(*args)

    def partition_fn(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                     **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        _unread_running_stats(joint)
        _elide_copies(joint)
        return partition(joint, joint_inputs, num_fwd_outputs, **kwargs)

    compiled: Callable[..., Any] | None = None

    def run(*args: Any) -> Any:
        nonlocal compiled
        params = dict(model.named_parameters())  # each tensor once; tied names follow
        buffers = dict(model.named_buffers())
        with _without_ambient_autocast():
            if compiled is None:
                compiled = aot_function(functional, fw_compiler=compiler or run_eagerly,
                                        bw_compiler=compiler or run_eagerly,
                                        partition_fn=partition_fn,
                                        num_params_buffers=len(params) + len(buffers))
                # traced on this first call: the backward as eager's, outside autocast,
                # the upsampling eager's kernels
                with torch._functorch.config.patch(backward_pass_autocast="off"), \
                        _eager_upsampling():
                    return compiled(params, buffers, *args)
            return compiled(params, buffers, *args)

    return run


@contextlib.contextmanager
def _eager_upsampling() -> Iterator[None]:
    """While tracing, upsampling runs eager's kernels (NOTE rule 9): the Python
    decompositions torch registers for ``upsample_*`` (used under the tracer's Python
    dispatcher, never in eager) compute trilinear weights in another order, so a traced
    SegResNet's outputs differed from eager's in the last bits. Restored on exit."""
    from torch._C import DispatchKey

    removed = []
    for name in dir(torch.ops.aten):
        if not name.lstrip("_").startswith("upsample_"):
            continue
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            kernel = op.py_kernels.pop(DispatchKey.CompositeImplicitAutograd, None)
            if kernel is not None:
                removed.append((op, kernel))
                op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in removed:
            op.py_kernels[DispatchKey.CompositeImplicitAutograd] = kernel
            op._dispatch_cache.clear()


def graph_digest(joint: fx.GraphModule) -> str:
    """A fingerprint of ``joint``'s nodes, their ops and arguments (NOTE rule 7)."""
    from torch.utils._pytree import tree_map

    digest = hashlib.sha256()
    for node in joint.graph.nodes:
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: n.name)
        # where a tensor is made is not what the step computes: a plan traced on CPU
        # fakes runs on a GPU
        args = tree_map(lambda a: "device" if isinstance(a, torch.device) else a, args)
        digest.update(f"{node.name}|{node.op}|{node.target}|{args}\n".encode())
    return digest.hexdigest()[:16]


def _unread_running_stats(joint: fx.GraphModule) -> None:
    """BatchNorm's backward in training reads no running statistics, yet its aten op takes
    them; as saved inputs of the backward they would be checked against their version
    after the forward's buffer update bumped it ("modified by an inplace operation").
    Passed as ``None`` (what the op accepts), the backward does not read them at all."""
    for node in joint.graph.nodes:
        if node.target is torch.ops.aten.native_batch_norm_backward.default and \
                node.args[7] is True:
            node.args = (*node.args[:3], None, None, *node.args[5:])
    joint.graph.eliminate_dead_code()
    joint.recompile()


def _same_layout(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
        (a.shape, a.stride(), a.dtype, a.device, a.storage_offset()) == \
        (b.shape, b.stride(), b.dtype, b.device, b.storage_offset())


def _returned(node: fx.Node) -> bool:
    """Whether the graph returns ``node`` or a view of it (two gradients must not share a
    storage: an optimizer updating one in place would change the other)."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if user.op == "output":
                return True
            if user.target is operator.getitem or _is_view(user.target):
                stack.append(user)
    return False


def _elide_copies(joint: fx.GraphModule) -> None:
    """Functionalizing an in-place op on a view (an in-place LeakyReLU's backward) leaves
    copies in the joint graph: ``copy(new_empty_strided(x), x)``, ``clone(x)``,
    ``copy(view, y)``, each a fresh tensor the size of ``x`` that eager autograd never
    makes (two extra full-resolution tensors per in-place activation at once, on the
    backward's peak). In a functional graph a copy whose result has its source's layout
    is its source's value: its readers read the source instead, bitwise the same, and
    the dead buffers go. A copy the graph returns, itself or through views, stays (an
    output must not alias)."""
    aten = torch.ops.aten
    changed = False
    for node in list(joint.graph.nodes):
        if node.target is aten.copy.default and len(node.args) >= 2:
            source = node.args[1]
        elif node.target is aten.clone.default:  # any memory format: the layouts decide
            source = node.args[0]
        else:
            continue
        if not isinstance(source, fx.Node) or _returned(node) \
                or not _same_layout(_val(node), _val(source)):
            continue
        node.replace_all_uses_with(source)
        changed = True
    if changed:
        joint.graph.eliminate_dead_code()
        joint.recompile()


@contextlib.contextmanager
def swapped_weights(model: nn.Module, tensors: dict[str, Any]) -> Iterator[None]:
    """``model``'s parameters and buffers replaced by ``tensors`` (the tracer's, by the
    names ``named_parameters``/``named_buffers`` give, each tensor once) and restored
    after. Swapped where they are held, once per module object and attribute: a module
    reachable under two names (DynUNet's skip layers) is one object, which
    ``torch.func.functional_call`` swapped twice and restored wrongly (the tracer's
    tensors stayed in the model); a weight tied to another module is swapped there too."""
    owned = itertools.chain(model.named_parameters(), model.named_buffers())
    by_tensor = {id(t): tensors[name] for name, t in owned if name in tensors}
    slots = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for attr, old in table.items():
                if old is not None and id(old) in by_tensor:
                    slots.append((table, attr, old, by_tensor[id(old)]))
    try:
        for table, attr, _, new in slots:
            table[attr] = new
        yield
    finally:
        for table, attr, old, _ in slots:
            table[attr] = old


@contextlib.contextmanager
def _own_forward(model: nn.Module) -> Iterator[None]:
    """While tracing, ``model`` runs its class's forward: a graph plan replaces the
    instance's ``forward`` with itself, which must not be traced (nor re-entered)."""
    replaced = model.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if replaced is not None:
            model.__dict__["forward"] = replaced


_GRAPH_PLAN_ADVICE = (" Graph plans need a forward that AOTAutograd can trace (no control "
                      "flow on tensor values, no .item()); module plans (remat3d.plan "
                      "without graph=True) work without one.")


@contextlib.contextmanager
def tracing_errors(model: nn.Module, advice: str = _GRAPH_PLAN_ADVICE) -> Iterator[None]:
    """Turn what tracing raises into one :class:`CaptureError` (NOTE rule 4), ending with
    ``advice``."""
    try:
        yield
    except Remat3dError:
        raise
    except Exception as exc:  # any tracing failure is reported the same way
        raise CaptureError(
            f"{type(model).__name__}'s step could not be traced as one graph: "
            f"{type(exc).__name__}: {quoted(exc) or 'no message'}{advice}"
        ) from exc


def fake_like(mode: Any, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor of ``mode`` with ``t``'s shape, dtype and strides, on ``device``."""
    meta = torch.empty_like(t, device="meta")
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)


def fake_step(model: nn.Module, inputs: tuple, device: str | None = None,
              ) -> tuple[nn.Module, tuple]:
    """A structural copy of ``model`` and ``inputs`` (tensors or shapes) made of fake
    tensors on ``device`` (default: the model's, ``cpu`` for a meta model): nothing is
    allocated, and ops take the device's own paths (NOTE rule 3)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat3d.instrument.step import input_dtype, model_device

    if device is None:
        found = model_device(model)
        device = "cpu" if found is None or found.type == "meta" else str(found)
    mode = FakeTensorMode()
    target = torch.device(device)

    def fake(t: torch.Tensor) -> torch.Tensor:
        return fake_like(mode, t, target)

    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(fake(p), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = fake(b)
    copied = copy.deepcopy(model, memo)
    dtype = input_dtype(model)
    fakes = tuple(
        fake(x) if isinstance(x, torch.Tensor)
        else fake(torch.empty(tuple(x), device="meta", dtype=dtype)) for x in inputs)
    return copied, fakes


def capture(model: nn.Module, *inputs: Any, device: str | None = None,
            amp: torch.dtype | None = None) -> Captured:
    """Trace one step of ``model`` on ``inputs`` (tensors or shapes), its forward under
    ``amp``'s autocast rules (NOTE rule 6), and return its joint graph. Runs on fake
    tensors (:func:`fake_step`): nothing is allocated, the model is not changed."""
    from torch._functorch.partitioners import default_partition

    fake_model, fake_inputs = fake_step(model, inputs, device)
    seen: dict[str, Any] = {}

    def record(joint: fx.GraphModule, joint_inputs: Any, num_fwd_outputs: int,
               **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        seen["joint"], seen["outputs"], seen["inputs"] = joint, num_fwd_outputs, joint_inputs
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                 **kwargs)

    params = list(fake_model.parameters())
    buffers = list(fake_model.buffers())
    versions = [b._version for b in buffers]
    with tracing_errors(model), _module_names(fake_model):
        aot_step(fake_model, record, amp)(*fake_inputs)
    if "joint" not in seen:
        raise CaptureError(f"{type(model).__name__}'s forward made no output that needs a "
                           "gradient, so there is no backward to trace.")
    # the step updated these buffers in place (BatchNorm's statistics); the primals are
    # the parameters, then the buffers, then the inputs (aot_step's order)
    mutated = {f"primals_{len(params) + i + 1}" for i, (b, v) in
               enumerate(zip(buffers, versions)) if b._version != v}
    graph = op_graph(seen["joint"], seen["outputs"], type(model).__name__,
                     [list(x.shape) for x in fake_inputs], mutated)
    return Captured(graph, seen["joint"], graph_digest(seen["joint"]), seen["inputs"],
                    seen["outputs"])


_MODULE_KEY = "remat3d_module"  # NOTE rule 10: the key of the module's name on a node


@contextlib.contextmanager
def _module_names(model: nn.Module) -> Iterator[None]:
    """While ``model`` (a traced copy) runs, each node traced carries the name of the
    module whose forward ran it (NOTE rule 10)."""
    from torch.fx.traceback import annotate

    opened: list[contextlib.AbstractContextManager[None]] = []

    def entering(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            annotation = annotate({_MODULE_KEY: name})
            annotation.__enter__()
            opened.append(annotation)
        return hook

    def leaving(module: nn.Module, args: Any, output: Any) -> None:
        if opened:
            opened.pop().__exit__(None, None, None)

    handles = []
    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(entering(name)))
            handles.append(module.register_forward_hook(leaving, always_call=True))
        yield
    finally:
        while opened:  # a forward that raised (its hook ran anyway: always_call)
            opened.pop().__exit__(None, None, None)
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------- to plain data


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _nbytes(value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    return value.untyped_storage().nbytes()


def _is_view(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def _recomputable(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return torch.Tag.nondeterministic_seeded not in target.tags and \
        not target._schema.is_mutable


def batch_norm_in_training(node: fx.Node) -> bool:
    return node.target is torch.ops.aten._native_batch_norm_legit_functional.default and \
        node.args[5] is True


def op_graph(joint: fx.GraphModule, num_fwd_outputs: int, model: str,
             input_shapes: list[list[int]], mutated: set[str] | frozenset = frozenset(),
             ) -> OpGraph:
    """The joint FX graph as an :class:`OpGraph` (``opgraph.py``'s conventions).

    ``mutated`` names the inputs the step updates in place after its forward (BatchNorm's
    running statistics): an op reading one cannot be recomputed in backward, which would
    read the updated value (autograd's version check refuses it); except BatchNorm in
    training itself, whose normalized output reads none of them (recomputed without
    them: ``runtime/graph_run.py``, ``recompute_without_running_stats``)."""
    nodes: list[OpNode] = []
    base: dict[str, str] = {}
    picked: dict[str, set[int]] = {}
    for node in joint.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            picked.setdefault(node.args[0].name, set()).add(node.args[1])
    for node in joint.graph.nodes:
        if node.op == "output":
            continue
        inputs = [a.name for a in node.all_input_nodes]
        value = _val(node)
        if node.op == "placeholder":
            phase = "tangent" if node.name.startswith("tangents") else "input"
            nodes.append(OpNode(node.name, phase, phase, [], _nbytes(value)))
            continue
        phase = "backward" if node.meta.get("partitioner_tag") == "is_backward" \
            else "forward"
        op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        reads_updated = mutated.intersection(inputs) and not batch_norm_in_training(node)
        entry = OpNode(node.name, op, phase, inputs,
                       recomputable=_recomputable(node.target) and not reads_updated,
                       module=(node.meta.get("custom") or {}).get(_MODULE_KEY))
        if node.target is operator.getitem:
            entry.bytes = _nbytes(value)
        elif isinstance(value, (tuple, list)):  # a multi-output op: its getitems own them
            taken = picked.get(node.name, set())
            entry.transient_bytes = sum(_nbytes(v) for i, v in enumerate(value)
                                        if i not in taken)
        elif _is_view(node.target) and inputs:
            root = node.all_input_nodes[0].name
            base[node.name] = base.get(root, root)
            entry.base = base[node.name]
        else:
            entry.bytes = _nbytes(value)
        if isinstance(node.target, torch._ops.OpOverload):
            args = fx.node.map_arg(node.args, _val)
            kwargs = fx.node.map_arg(node.kwargs, _val)
            entry.flops = op_flops(node.target, args, kwargs, value)
        nodes.append(entry)
    (out,) = [n for n in joint.graph.nodes if n.op == "output"]
    results = [a for a in tree_leaves(out.args) if isinstance(a, fx.Node)]
    return OpGraph(model, input_shapes, nodes,
                   outputs=[a.name for a in results[:num_fwd_outputs]],
                   gradients=[a.name for a in results[num_fwd_outputs:]])

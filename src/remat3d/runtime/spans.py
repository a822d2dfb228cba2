"""Spans: runs of a parent module's own ``forward`` that module plans can name as regions.

NOTE [ Spans of a parent's forward ]
  1. Why: a module region is a module invocation, so whatever a parent's ``forward`` does
     itself between its children's calls is out of every region's reach. nnU-Net v2's
     ``UNetDecoder.forward`` concatenates each skip itself (transposed conv, ``torch.cat``,
     stage): the concatenation is glue the module planner keeps, and no tiled region can
     span the decoder's full-resolution stage. A *span* is such a run made one unit: it
     is profiled, checkpointed, offloaded and tiled like a module (MONAI's ``UnetUpBlock``
     is the same run written as a module).
  2. Found without running anything: the parent's forward is traced by ``torch.fx`` with
     every child a leaf (``_shallow_graph``). Each own tensor op of the parent (any
     ``call_function``/``call_method`` that is not plumbing such as ``getitem``,
     ``getattr``, ``size``) seeds a span; the span takes in the child calls whose only
     reader is in it (its producers, through own ops, not through other child calls:
     spans stay one child deep on each side) and the one child call that reads its
     result, when that is its only reader (the consumer); shape plumbing that only the
     span reads comes in too, so its inputs stay tensors. Spans that share a node merge.
  3. A span has one output, its last node in the traced order, and runs where that node
     was: a span one of whose other nodes is read outside it is dropped, and so is one
     with a child call or own op of the parent between its nodes (it would run in
     another order), one with no child call, or one that is the parent's whole forward
     (the parent is then the unit already).
     A parent whose forward cannot be traced (control flow on tensor values), or that
     has an instance ``forward`` of its own, gets no spans: its plan is what it was.
  4. Installed: the parent gets an instance ``forward`` (:class:`SpannedForward`) that
     runs its traced graph with each span as one call of a :class:`Span` module, named
     ``<parent>.@<k>``. On the planner's meta copies the spans are registered children
     (profile hooks and probes find them by name); on the user's model (``apply``) they
     are not: ``state_dict()``, ``named_modules()`` and parameters stay as they were, and
     ``remove`` deletes the instance ``forward``.
  5. Plain data in the plan (``Plan.spans``: parent name -> the node names of each span);
     ``apply`` traces the parent again (torch.fx names nodes deterministically) and
     refuses a plan whose span names a node the forward does not have.
  6. Exact: the graph runs the same Python-level calls as the forward it was traced from
     (the children's own ``__call__``, hooks included), in the same order.
  7. A trace holds the branches its forward took on the parent's settings then (nnU-Net's
     ``decoder.deep_supervision``, which its validation turns off). The parent's plain
     settings (its training flag, its attributes that are numbers, strings, None or
     tuples of them) are read at each call; when they changed, the forward is traced
     again and the spans found anew. A span the new trace does not have is an error with
     grad (the plan was made for the other settings: plan again); without grad (nothing
     saved, nothing planned) the parent's own forward runs instead.
"""

from __future__ import annotations

import builtins
import copy
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import fx, nn

from remat3d.errors import PlanError
from remat3d.graph import CostGraph
from remat3d.planner.stages import build_stages

__all__ = ["Span", "SpannedForward", "find_spans", "install_spans", "span_modules",
           "spanned_copy", "spans_for", "uninstall_spans"]

_PLUMBING_FUNCTIONS = {operator.getitem, builtins.getattr, builtins.len, builtins.tuple,
                       builtins.list}
_SHAPE_METHODS = {"size", "dim", "numel", "type_as", "__len__"}
_SHAPE_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda"}
_ATTR = "_remat3d_spans"  # parent.__dict__: the SpannedForward installed on it


class _Shallow(fx.Tracer):
    """torch.fx tracer that keeps every child of ``root`` a leaf (one ``call_module``)."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self._root = root

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return m is not self._root


def _shallow_graph(parent: nn.Module, *, own_forward: bool = False) -> fx.Graph | None:
    """The class forward of ``parent`` as an fx graph over its children's calls; None: it
    cannot be traced, or (unless ``own_forward``) the instance has a forward of its own."""
    if (not own_forward and "forward" in parent.__dict__) or isinstance(
            parent, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return None
    try:
        return _Shallow(parent).trace(parent)
    except Exception:  # noqa: BLE001 - any trace failure means: no spans for this parent
        return None


def _is_plumbing(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _PLUMBING_FUNCTIONS
    if node.op == "call_method":
        return node.target in _SHAPE_METHODS
    return node.op not in ("call_module",)


def _is_shape_plumbing(node: fx.Node) -> bool:
    """``x.shape``, ``x.size()``, ``x.shape[2:]``: reads a tensor's metadata only."""
    if node.op == "call_method":
        return node.target in _SHAPE_METHODS
    if node.op == "call_function" and node.target is builtins.getattr:
        return len(node.args) > 1 and node.args[1] in _SHAPE_ATTRS
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and _is_shape_plumbing(source)
    return False


def _spans_of(graph: fx.Graph) -> list[list[fx.Node]]:
    """The spans of one traced forward (NOTE rules 2 and 3), in the traced order."""
    nodes = [n for n in graph.nodes]
    order = {n: i for i, n in enumerate(nodes)}
    seeds = [n for n in nodes if n.op in ("call_function", "call_method")
             and not _is_plumbing(n)]
    groups: list[set[fx.Node]] = []
    for seed in seeds:
        members = {seed}
        stack = [seed]
        while stack:  # producers whose only reader is in the span
            node = stack.pop()
            for source in node.all_input_nodes:
                if source in members or len(source.users) != 1:
                    continue
                if source.op == "call_module":  # a child call: its own inputs stay out
                    members.add(source)
                elif source.op in ("call_function", "call_method") and (
                        not _is_plumbing(source) or _is_shape_plumbing(source)):
                    members.add(source)
                    stack.append(source)
        users = list(seed.users)
        if len(users) == 1 and users[0].op == "call_module":
            members.add(users[0])
        groups.append(members)
    merged: list[set[fx.Node]] = []
    for group in groups:  # spans sharing a node are one
        overlapping = [m for m in merged if m & group]
        for m in overlapping:
            merged.remove(m)
            group |= m
        merged.append(group)
    children = {n for n in nodes if n.op == "call_module"}
    own = {n for n in nodes if n.op in ("call_function", "call_method", "call_module")
           and not _is_plumbing(n)}
    spans = []
    for group in merged:
        ordered = sorted(group, key=order.__getitem__)
        if any(u not in group for n in ordered[:-1] for u in n.users):
            continue  # read outside before its end: not one output
        between = nodes[order[ordered[0]]:order[ordered[-1]]]
        if any(n not in group and not _is_plumbing(n) for n in between):
            continue  # the span runs at its end: nothing with effects may move across it
        if not group & children or own <= group:
            continue  # no child call, or the whole forward
        spans.append(ordered)
    return sorted(spans, key=lambda s: order[s[-1]])


def _traced_spans(model: nn.Module, parents: Iterable[str]) -> dict[str, list[list[fx.Node]]]:
    modules = dict(model.named_modules())
    found: dict[str, list[list[fx.Node]]] = {}
    for name in sorted(set(parents)):
        parent = modules.get(name)
        graph = None if parent is None else _shallow_graph(parent)
        spans = [] if graph is None else _spans_of(graph)
        if spans:
            found[name] = spans
    return found


def _names(spans: dict[str, list[list[fx.Node]]]) -> dict[str, list[list[str]]]:
    return {name: [[n.name for n in span] for span in group] for name, group in spans.items()}


def find_spans(model: nn.Module, parents: Iterable[str]) -> dict[str, list[list[str]]]:
    """The spans of each named parent's forward, as node names (NOTE rules 2 and 3)."""
    return _names(_traced_spans(model, parents))


def spans_for(model: nn.Module, graph: CostGraph) -> dict[str, list[list[str]]]:
    """The spans of ``model`` worth planning, from its profile's ``graph``: those of the
    model's own forward and of every invocation above two or more stages, and of a block
    whose spans would make two or more units of it (two compute layers each: ResEnc's
    decoder, one conv per stage, is one block of single layers; a residual block's one
    span, or a functional ReLU between two convs, leaves the block the unit)."""
    names = {n.name for n in graph.nodes}
    containers = {name for name, _call, _covered in build_stages(graph).containers}
    found = _traced_spans(model, sorted({"", *containers} & names))
    layers: dict[str, int] = {}
    for n in reversed(graph.nodes):  # compute layers (ops with FLOPs) under each module
        count = int(bool(n.self_fwd_flops)) + sum(layers.get(graph.nodes[c].name, 0)
                                                  for c in n.children)
        layers[n.name] = max(layers.get(n.name, 0), count)

    def compute(parent: str, span: list[fx.Node]) -> int:
        prefix = f"{parent}." if parent else ""
        return sum(layers.get(prefix + str(n.target), 0) for n in span
                   if n.op == "call_module")

    # a span without a compute layer (a cat and a dropout) would be no stage: none
    found = {name: kept for name, spans in found.items()
             if (kept := [s for s in spans if compute(name, s) >= 1])}
    blocks = {b.name for b in graph.blocks()} - set(found)
    found.update({name: spans for name, spans in _traced_spans(model, sorted(blocks)).items()
                  if sum(compute(name, s) >= 2 for s in spans) >= 2})
    return dict(sorted(_names(found).items()))


def _target(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _module(nodes: Iterable[fx.Node], parent: nn.Module, extra: Mapping[str, Any],
            graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule over ``graph`` whose targets are the parent's (by reference)."""
    root: dict[str, Any] = dict(extra)
    for node in nodes:
        if node.op in ("call_module", "get_attr") and node.target not in root:
            root[str(node.target)] = _target(parent, str(node.target))
    module = fx.GraphModule(root, graph, class_name=type(parent).__name__ + "Spanned")
    return module


class Span(nn.Module):
    """One span of a parent's forward, called with its inputs (NOTE rule 4). It holds no
    parameters, buffers or registered children of its own: the parent's are its."""

    def __init__(self, parent: nn.Module, label: str, nodes: list[str]) -> None:
        super().__init__()
        object.__setattr__(self, "_parent", parent)
        self.label = label
        self.nodes = list(nodes)
        object.__setattr__(self, "_run", None)

    def build(self, traced: dict[str, fx.Node]) -> list[fx.Node]:
        """Make the span's graph from the parent's traced nodes; returns its inputs."""
        members = [traced[n] for n in self.nodes]
        inside = set(members)
        inputs: list[fx.Node] = []
        for node in members:
            for source in node.all_input_nodes:
                if source not in inside and source not in inputs:
                    inputs.append(source)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for k, source in enumerate(inputs):
            env[source] = graph.placeholder(f"input_{k}")
        for node in members:
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(env[members[-1]])
        object.__setattr__(self, "_run", _module(members, self._parent, {}, graph))
        return inputs

    def forward(self, *inputs: Any) -> Any:
        if self._run is None:
            raise PlanError(f"Span {self.label} runs only inside its parent's forward.")
        return self._run(*inputs)

    def extra_repr(self) -> str:
        return f"{self.label}: {', '.join(self.nodes)}"

    def __deepcopy__(self, memo: dict[int, Any]) -> Span:
        new = Span(copy.deepcopy(self._parent, memo), self.label, self.nodes)
        memo[id(self)] = new
        return new


class SpannedForward:
    """The parent's forward with each span one call (NOTE rule 4); made on first call,
    so a deep copy (made while its parent is being copied) builds from the copy."""

    def __init__(self, parent: nn.Module, name: str, spans: list[list[str]],
                 original: Any) -> None:
        self.parent = parent
        self.name = name
        self.original = original  # the parent's instance forward before (usually none)
        prefix = f"{name}." if name else ""
        self.spans = [Span(parent, f"{prefix}@{k}", nodes) for k, nodes in enumerate(spans)]
        self._run: fx.GraphModule | None = None
        self._key: tuple | None = None  # the parent's settings it was traced with (rule 7)

    def build(self) -> None:
        graph = None if self.original is not None else _shallow_graph(self.parent,
                                                                      own_forward=True)
        if graph is None:
            raise PlanError(f"The plan has spans of module '{self.name or '(model)'}', but "
                            "its forward cannot be traced by torch.fx here. Make a new "
                            "plan for this model (remat3d.plan).")
        traced = {n.name: n for n in graph.nodes}
        for span in self.spans:
            missing = [n for n in span.nodes if n not in traced]
            if missing:
                raise PlanError(
                    f"Plan span {span.label} names {', '.join(missing[:3])}, which the "
                    f"traced forward of '{self.name or '(model)'}' does not have: the plan "
                    "was made for another version of this model. Make a new plan for it.")
        valid = {tuple(n.name for n in span) for span in _spans_of(graph)}
        for span in self.spans:  # a plan written by hand: only what NOTE rules 2-3 allow
            if tuple(span.nodes) not in valid:
                raise PlanError(
                    f"Plan span {span.label} ({', '.join(span.nodes)}) is not a span of "
                    f"the forward of '{self.name or '(model)'}' (spans: "
                    f"{'; '.join(', '.join(v) for v in sorted(valid)) or 'none'}). Make a "
                    "new plan for this model (remat3d.plan).")
        last = {}
        member_of: dict[fx.Node, Span] = {}
        inputs: dict[int, list[fx.Node]] = {}
        for span in self.spans:
            inputs[id(span)] = span.build(traced)
            for n in span.nodes:
                member_of[traced[n]] = span
            last[traced[span.nodes[-1]]] = span
        new = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        extra: dict[str, Any] = {}
        for node in graph.nodes:
            span = member_of.get(node)
            if span is None:
                env[node] = new.node_copy(node, lambda n: env[n])
            elif node in last:
                target = span.label.rsplit(".", 1)[-1].replace("@", "span_")
                extra[target] = span
                env[node] = new.call_module(target, tuple(env[i] for i in inputs[id(span)]))
        self._run = _module(graph.nodes, self.parent, extra, new)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = _settings(self.parent)
        if self._run is None or key != self._key:  # NOTE rule 7
            try:
                self.build()
            except PlanError:
                if torch.is_grad_enabled():
                    raise
                self._run = None
                return type(self.parent).forward(self.parent, *args, **kwargs)
            self._key = key
        assert self._run is not None
        return self._run(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> SpannedForward:
        parent = copy.deepcopy(self.parent, memo)
        new = SpannedForward.__new__(SpannedForward)
        memo[id(self)] = new
        new.parent = parent
        new.name = self.name
        new.original = copy.deepcopy(self.original, memo)
        new.spans = [copy.deepcopy(s, memo) for s in self.spans]
        new._run = None
        new._key = None
        return new


_PLAIN = (bool, int, float, str, type(None))


def _settings(module: nn.Module) -> tuple:
    """The plain values a traced forward may have branched on (NOTE rule 7): the module's
    training flag and its attributes that are numbers, strings, None or tuples of them."""
    items = [("training", module.training)]
    for key, value in module.__dict__.items():
        if key.startswith("_"):
            continue
        if isinstance(value, _PLAIN) or (isinstance(value, tuple)
                                         and all(isinstance(v, _PLAIN) for v in value)):
            items.append((key, value))
    return tuple(items)


def install_spans(model: nn.Module, spans: Mapping[str, list[list[str]]], *,
                  register: bool = False) -> dict[str, Span]:
    """Install the spans on ``model`` (NOTE rule 4); returns them by qualified name.
    ``register``: also make them children of their parents (on the planner's copies)."""
    modules = dict(model.named_modules())
    installed: dict[str, Span] = {}
    done: list[nn.Module] = []
    try:
        for name, nodes in spans.items():
            parent = modules.get(name)
            if parent is None:
                raise PlanError(f"The plan has spans of module '{name}', which this model "
                                "does not have. Make a plan for this model (remat3d.plan).")
            if _ATTR in parent.__dict__:
                raise PlanError(f"Module '{name}' has spans installed already.")
            forward = SpannedForward(parent, name, nodes, parent.__dict__.get("forward"))
            forward.build()
            parent.__dict__[_ATTR] = forward
            object.__setattr__(parent, "forward", forward)
            done.append(parent)
            for span in forward.spans:
                installed[span.label] = span
                if register:
                    parent.add_module(span.label.rsplit(".", 1)[-1], span)
    except BaseException:
        for parent in done:
            _uninstall(parent)
        raise
    return installed


def _uninstall(parent: nn.Module) -> None:
    forward = parent.__dict__.pop(_ATTR, None)
    if forward is None:
        return
    for span in forward.spans:
        parent._modules.pop(span.label.rsplit(".", 1)[-1], None)
    if forward.original is None:
        parent.__dict__.pop("forward", None)
    else:
        object.__setattr__(parent, "forward", forward.original)


def uninstall_spans(model: nn.Module) -> None:
    """Put back every parent's forward ``install_spans`` replaced."""
    for module in list(model.modules()):
        _uninstall(module)


def span_modules(model: nn.Module) -> dict[str, Span]:
    """The spans installed on ``model``, by qualified name."""
    found: dict[str, Span] = {}
    for module in model.modules():
        forward = module.__dict__.get(_ATTR)
        if forward is not None:
            found.update({s.label: s for s in forward.spans})
    return found


def spanned_copy(model: nn.Module, spans: Mapping[str, list[list[str]]]) -> nn.Module:
    """A meta copy of ``model`` with the spans installed and registered (for profiling and
    probing: hooks and names find them like any module)."""
    from remat3d.instrument.step import meta_copy

    copy_ = meta_copy(model)
    install_spans(copy_, spans, register=True)
    return copy_


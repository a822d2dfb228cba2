"""The model's inference forward as one functional aten graph, read into a TileGraph.

NOTE [ Tracing the forward for prediction ]
  1. ``make_fx`` over ``torch.func.functionalize`` traces the model in ``eval()`` mode under
     ``no_grad``, on fake tensors of the model's device (nothing allocated: any size), its
     forward under ``amp``'s autocast rules, as ``capture/joint.py`` traces a training
     step's forward (NOTE [ Tracing the joint graph ] rules 2, 3, 6 and 9 hold here too).
     Functionalized, an in-place activation is its out-of-place op: a tile never writes
     into a tensor another tile reads.
  2. ``post`` (a function of the model's output) is traced with it, so what follows the
     network (softmax, argmax, a cast) runs tile by tile too. A model returning several
     outputs (deep supervision) predicts with its first.
  3. Each op is classified for tiling (``tilegraph.py``'s kinds) by what it computes, not
     by its name alone: a view or reduction is local only where it keeps the three
     spatial axes last and whole; a pooling only without ceil mode; an interpolation only
     at integer scales, without ``align_corners``; a max pooling's indices or a
     normalisation's statistics read by a later op make it ``whole``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from remat3d.capture.joint import (
    _eager_upsampling,
    _forward_precision,
    _own_forward,
    _without_ambient_autocast,
    fake_step,
    swapped_weights,
    tracing_errors,
)
from remat3d.instrument.flops import op_flops
from remat3d.tilegraph import TileGraph, TileNode

__all__ = ["ForwardCapture", "capture_forward", "spatial_size_args"]

aten = torch.ops.aten


@dataclass
class ForwardCapture:
    """A traced forward: its FX graph (placeholders: parameters, buffers, then the volume)
    and the plain data the planner reads."""

    gm: fx.GraphModule
    graph: TileGraph
    weights: list[str]  # the placeholders before the volume: parameter and buffer names


def _first_tensor(out: Any) -> torch.Tensor:
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise TypeError("the model returned no tensor")


def capture_forward(model: nn.Module, shape: tuple[int, ...], *, device: str | None = None,
                    amp: torch.dtype | None = None,
                    post: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    ) -> ForwardCapture:
    """Trace ``post(model(x))`` for an ``x`` of ``shape`` in eval mode (NOTE rules 1-2)."""
    from torch.func import functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_model, (x,) = fake_step(model, (shape,), device)
    fake_model.eval()
    named = [*fake_model.named_parameters(), *fake_model.named_buffers()]
    names = [n for n, _ in named]

    def forward(*flat: Any) -> torch.Tensor:
        *weights, volume = flat
        with _own_forward(fake_model), swapped_weights(fake_model, dict(zip(names, weights))), \
                _forward_precision(amp):
            out = _first_tensor(fake_model(volume))
        return post(out) if post is not None else out

    with tracing_errors(model, advice=""), _without_ambient_autocast(), torch.no_grad(), \
            _eager_upsampling(), x.fake_mode:
        gm = make_fx(functionalize(forward))(*[t for _, t in named], x)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return ForwardCapture(gm, tile_graph(gm, type(model).__name__, tuple(shape)), names)


# ----------------------------------------------------------------------------- to plain data

_SIZE_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
               aten.expand.default}
_COPIES = {aten.clone.default, aten._to_copy.default, aten.alias.default,
           aten.detach.default, aten.contiguous.default}
_CHANNEL_REDUCTIONS = {aten._softmax.default, aten._log_softmax.default, aten.argmax.default,
                       aten.argmin.default, aten.amax.default, aten.amin.default,
                       aten.sum.dim_IntList, aten.mean.dim}
_STATS = {aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
          aten._native_batch_norm_legit_functional.default, aten.native_group_norm.default}
_EVAL_NORMS = {aten._native_batch_norm_legit_no_training.default}
_UPSAMPLE = {aten.upsample_nearest3d.default: "nearest",
             aten.upsample_nearest3d.vec: "nearest",
             aten.upsample_trilinear3d.default: "linear",
             aten.upsample_trilinear3d.vec: "linear"}
_PADS = {aten.constant_pad_nd.default, aten.replication_pad3d.default,
         aten.reflection_pad3d.default}


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _spatial(value: Any) -> bool:
    if isinstance(value, (tuple, list)) and value:  # a tuple op: its first output
        value = value[0]
    return isinstance(value, torch.Tensor) and value.dim() == 5


def _shape(node: fx.Node) -> tuple[int, ...]:
    value = _val(node)
    if isinstance(value, (tuple, list)):
        value = value[0]
    return tuple(value.shape)


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value)
               if isinstance(t, torch.Tensor))


def _triple(values: Any, default: tuple[int, ...]) -> tuple[int, ...]:
    values = tuple(int(v) for v in values) if values else default
    return values * 3 if len(values) == 1 else values


def _channel_dim(dim: Any, rank: int = 5) -> bool:
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return bool(dims) and all(d is not None and int(d) % rank == 1 for d in dims)


def spatial_size_args(node: fx.Node) -> bool:
    """Whether ``node``'s second argument is a shape whose last three entries are the
    spatial extent (a tile rewrites them)."""
    return node.target in _SIZE_VIEWS


def _is_train_norm(node: fx.Node) -> bool:
    t = node.target
    if t is aten.native_batch_norm.default or t is \
            aten._native_batch_norm_legit_functional.default:
        return bool(node.args[5])
    if t is aten._native_batch_norm_legit.default:
        return bool(node.args[5]) if len(node.args) > 5 else True
    return t is aten.native_group_norm.default


def _reads_beyond_first(node: fx.Node) -> bool:
    """Whether an op's outputs other than its first are read (indices, statistics)."""
    return any(u.target is operator.getitem and u.args[1] != 0 for u in node.users)


def _relation(node: fx.Node, out: Any, ins: list[fx.Node]) -> dict[str, Any] | None:
    """The window relation of a local op to its spatial inputs; None: not local."""
    t = node.target
    size = tuple(out.shape[2:])
    same = all(_shape(i)[2:] == size for i in ins)
    if t is aten.convolution.default:
        _, _, _, stride, padding, dilation, transposed, output_padding, _ = node.args
        if len(stride) != 3:
            return None
        w = _val(node.args[1])
        kind = "conv_transpose" if transposed else "conv"
        if transposed and any(int(p) for p in output_padding):
            return None
        return {"relation": kind, "kernel": tuple(w.shape[2:]), "stride": _triple(stride, ()),
                "padding": _triple(padding, ()), "dilation": _triple(dilation, ())}
    if t is aten.max_pool3d_with_indices.default:
        args = list(node.args) + [None] * (6 - len(node.args))
        _, kernel, stride, padding, dilation, ceil = args
        if ceil or _reads_beyond_first(node):
            return None
        k = _triple(kernel, ())
        return {"relation": "conv", "kernel": k, "stride": _triple(stride, k),
                "padding": _triple(padding, (0, 0, 0)), "dilation": _triple(dilation, (1, 1, 1))}
    if t is aten.avg_pool3d.default:
        args = list(node.args) + [None] * (7 - len(node.args))
        _, kernel, stride, padding, ceil, _, _ = args
        k = _triple(kernel, ())
        pad = _triple(padding, (0, 0, 0))
        if ceil or any(pad):
            return None
        return {"relation": "conv", "kernel": k, "stride": _triple(stride, k)}
    if t in _UPSAMPLE:
        mode = _UPSAMPLE[t]
        if mode == "linear" and node.args[2]:  # align_corners
            return None
        src = _shape(ins[0])[2:]
        if any(o % i for o, i in zip(size, src)):
            return None
        return {"relation": "interpolate", "scale": tuple(o // i for o, i in zip(size, src)),
                "mode": mode}
    if not same:
        return None
    if t in _STATS:
        return {}
    if t in _SIZE_VIEWS or t in _COPIES or t in _EVAL_NORMS or t is operator.getitem:
        return {}
    if t is aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else 0
        return {} if _channel_dim(dim) else None
    if t is aten.slice.Tensor:
        return {} if _channel_dim(node.args[1] if len(node.args) > 1 else 0) else None
    if t in _CHANNEL_REDUCTIONS:
        return {} if len(node.args) > 1 and _channel_dim(node.args[1]) else None
    if t in _PADS:
        pads = node.args[1]
        return {} if not any(int(p) for p in pads[:6]) else None
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
        return {}
    return None


def tile_graph(gm: fx.GraphModule, model: str, input_shape: tuple[int, ...]) -> TileGraph:
    """``gm``'s nodes as plain data, each classified for tiling (NOTE rule 3)."""
    nodes: list[TileNode] = []
    kinds: dict[str, str] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    volume = placeholders[-1]
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        value = _val(node)
        if node.op == "placeholder":
            kind = "input" if node is volume else "const"
            kinds[node.name] = kind
            nodes.append(TileNode(node.name, kind, kind,
                                  size=tuple(value.shape[2:]) if node is volume else None,
                                  bytes=_nbytes(value), itemsize=value.element_size()))
            continue
        reads = [a for a in node.all_input_nodes]
        op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        entry = TileNode(node.name, op, "const", reads=[a.name for a in reads],
                         bytes=_nbytes(value))
        first = next((t for t in tree_leaves(value) if isinstance(t, torch.Tensor)), None)
        entry.itemsize = first.element_size() if first is not None else 0
        if isinstance(node.target, torch._ops.OpOverload):
            entry.view = node.target.is_view
            entry.flops = op_flops(node.target, fx.node.map_arg(node.args, _val),
                                   fx.node.map_arg(node.kwargs, _val), value)
        if all(kinds[a.name] == "const" for a in reads):
            kinds[node.name] = "const"
            nodes.append(entry)
            continue
        # spatial inputs: those a local op crops; a (1, 1, 1) operand broadcast over a
        # larger output is read whole (a materialized tensor, not an input)
        out = value[0] if node.target in _STATS or isinstance(value, (tuple, list)) else value
        spatial = [a for a in reads if kinds[a.name] != "const" and _spatial(_val(a))]
        if _spatial(out):
            size = tuple(out.shape[2:])
            entry.size = size
            ins = [a for a in spatial
                   if not (_shape(a)[2:] == (1, 1, 1) and size != (1, 1, 1))]
        else:
            ins = spatial
        relation = _relation(node, out, ins) if _spatial(out) and ins and \
            len(spatial) == len([a for a in reads if kinds[a.name] != "const"]) else None
        if relation is not None and node.target in _STATS and _is_train_norm(node):
            entry.kind = "stats" if not _reads_beyond_first(node) else "whole"
        elif relation is not None:
            entry.kind = "local"
            for key, value_ in relation.items():
                setattr(entry, key, value_)
        else:
            entry.kind = "whole"
        entry.inputs = [a.name for a in (ins if entry.kind != "whole" else spatial)]
        kinds[node.name] = entry.kind
        nodes.append(entry)
    (out_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = next(a for a in tree_leaves(out_node.args) if isinstance(a, fx.Node))
    return TileGraph(model, input_shape, nodes, result.name)

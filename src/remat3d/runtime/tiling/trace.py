"""Record a run of spatially local ops once, on fake tensors, as plain halo-arithmetic data.

The run (a module or a function of 5-D tensors) is executed once under PyTorch's
``FakeTensorMode`` (no memory, no compute) with a ``TorchFunctionMode`` that sees each
top-level call (``F.conv3d``, ``F.instance_norm``, ``torch.cat``, ``Tensor.add_`` ...), as
the user's code makes it. Every call that takes a spatial tensor of the run becomes one
:class:`TracedOp`: its kind for halo arithmetic, its window parameters, and what the tiled
executor must do with it. Anything that is not spatially local, or cannot be made exact
tile by tile, is refused here with a :class:`TilingError` that names the op and module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from remat3d.errors import TilingError
from remat3d.halo import (
    CONV,
    CONV_TRANSPOSE,
    INTERPOLATE,
    POINTWISE,
    SpatialOp,
)
from remat3d.instrument.state import module_name
from remat3d.runtime.guards import BufferGuard, ModuleStack
from remat3d.runtime.tiling.signatures import (
    DIM_OPS,
    DROPOUT,
    REFUSED,
    SCALAR_READS,
    SHAPE_OPS,
    bind,
    func_name,
)

__all__ = ["NormSpec", "TilingError", "Trace", "TracedOp", "trace"]

_NODE = "_remat3d_tile_node"
_INNER = "_remat3d_tile_inner"


def _triple(value: Any, default: Any = None) -> tuple[int, ...]:
    if value is None:
        value = default
    if isinstance(value, (int, float)):
        return (int(value),) * 3
    values = tuple(int(v) for v in value)
    return values * 3 if len(values) == 1 else values


@dataclass(frozen=True)
class NormSpec:
    """A normalisation with statistics: over what it averages and what it updates."""

    kind: str            # "instance" | "group" | "batch"
    groups: int          # statistic groups per sample (channels for instance/batch)
    eps: float
    updates_running: bool


@dataclass
class TracedOp:
    """One call of the run that touches a spatial tensor."""

    name: str
    role: str            # conv, conv_transpose, max_pool, avg_pool, interpolate, norm, generic
    spatial: SpatialOp
    module: str
    out_dtype: torch.dtype
    norm: NormSpec | None = None
    norm_index: int | None = None   # ordinal among norms with batch statistics
    flops: int = 0                  # untiled forward FLOPs (convolutions; 0 for the rest)
    inplace: bool = False           # writes its first spatial input and returns it
    single: bool = True             # returns one tensor (not a tuple of channel chunks)


@dataclass
class Trace:
    """A run, recorded: ops in execution order, node sizes, its inputs, outputs, parameters."""

    ops: list[TracedOp]
    inputs: list[int]
    outputs: list[int]       # the first output's grid defines the tiles
    sizes: dict[int, tuple[int, ...]]
    out_shapes: list[tuple[int, ...]]
    out_dtypes: list[torch.dtype]
    params: list[torch.Tensor]
    norms: list[int] = field(default_factory=list)   # op index of each norm with statistics
    voxel_bytes: dict[int, int] = field(default_factory=dict)
    returns_tuple: bool = False
    leading: dict[int, tuple[int, int]] = field(default_factory=dict)  # node -> (N, C)
    dtypes: dict[int, torch.dtype] = field(default_factory=dict)       # node -> dtype

    @property
    def spatial_ops(self) -> list[SpatialOp]:
        return [op.spatial for op in self.ops]


class _Recorder(TorchFunctionMode):
    def __init__(self, modules: ModuleStack) -> None:
        super().__init__()
        self.modules = modules
        self.ops: list[TracedOp] = []
        self.sizes: dict[int, tuple[int, ...]] = {}
        self.params: dict[int, torch.Tensor] = {}
        self.voxel_bytes: dict[int, int] = {}   # node -> bytes per voxel (batch x channels)
        self.leading: dict[int, tuple[int, int]] = {}
        self.dtypes: dict[int, torch.dtype] = {}
        self.next_node = 0

    def new_node(self, t: torch.Tensor) -> int:
        node = self.next_node
        self.next_node += 1
        setattr(t, _NODE, node)
        self.sizes[node] = tuple(int(s) for s in t.shape[2:])
        self.voxel_bytes[node] = int(t.shape[0]) * int(t.shape[1]) * t.element_size()
        self.leading[node] = (int(t.shape[0]), int(t.shape[1]))
        self.dtypes[node] = t.dtype
        return node

    def fail(self, name: str, why: str, fix: str) -> TilingError:
        return TilingError(f"Cannot tile {name} in module '{self.modules.current()}': {why}. "
                           f"{fix}")

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        spatial = [t for t in tensors if getattr(t, _NODE, None) is not None]
        spatial_ids = {id(t) for t in spatial}
        name = func_name(func)
        if name in SCALAR_READS and not spatial and not any(
                isinstance(t, FakeTensor) for t in tensors):
            # a real buffer read as a number (BatchNorm's 1 / num_batches_tracked): read it
            # outside the fake mode, which cannot produce data-dependent values
            with _disable_current_modes():
                return func(*args, **kwargs)
        for t in tensors:
            if id(t) in spatial_ids or getattr(t, _INNER, False) or not t.requires_grad:
                continue
            if not t.is_leaf:
                raise self.fail(name, "it uses a tensor that requires grad and comes from "
                                "outside the run", "Pass that tensor as an input of the run.")
            self.params.setdefault(id(t), t)
        if not spatial:
            out = func(*args, **kwargs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    setattr(t, _INNER, True)
            return out
        role, op_args = self.classify(name, args, kwargs, spatial, tensors)
        out = func(*args, **kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            return out
        for t in outs:
            setattr(t, _INNER, True)
        inputs = tuple(getattr(t, _NODE) for t in spatial)
        in_size = self.sizes[inputs[0]]
        for t in outs:
            if t.dim() != 5 or (role in ("generic", "norm") and tuple(t.shape[2:]) != in_size):
                raise self.fail(name, f"it turns a spatial tensor of size {in_size} into "
                                f"shape {tuple(t.shape)}", "Only spatially local ops can be "
                                "tiled; end the run before this op.")
        output = self.new_node(outs[0])
        for t in outs[1:]:  # e.g. torch.chunk over channels: same region, same node
            setattr(t, _NODE, output)
        spatial_op = self.spatial_op(role, op_args, inputs, output)
        norm: NormSpec | None = op_args.get("norm")
        flops = 0
        if role in ("conv", "conv_transpose"):  # multiply-adds x 2, as torch's flop counter
            weight = bind(name, args, kwargs)["weight"]
            per_voxel = 2 * int(weight.numel()) * int(spatial[0].shape[0])
            side = spatial[0] if role == "conv_transpose" else outs[0]
            flops = per_voxel * int(torch.Size(side.shape[2:]).numel())
        self.ops.append(TracedOp(name, role, spatial_op, self.modules.current(),
                                 outs[0].dtype, norm, flops=flops,
                                 inplace=outs[0] is spatial[0], single=len(outs) == 1))
        return out

    def classify(self, name: str, args: Sequence[Any], kwargs: dict[str, Any],
                 spatial: list[torch.Tensor], tensors: list[torch.Tensor]
                 ) -> tuple[str, dict[str, Any]]:
        for t in spatial:
            if t.dim() != 5:
                raise self.fail(name, f"a tensor of the run has {t.dim()} dims",
                                "Tiled runs take 5-D tensors (N, C, D, H, W).")
        if name == "pad":
            amounts = kwargs.get("pad", args[1] if len(args) > 1 else ())
            if all(int(p) == 0 for p in amounts):  # BasicUNet pads by 0 when sizes agree
                return "generic", {}
            raise self.fail(name, f"padding by {list(amounts)} inside the run changes "
                            "positions", "Pad outside the tiled run, or use the padding "
                            "argument of the convolution.")
        if name in REFUSED:
            raise self.fail(name, "this op is not local or not supported in a tiled run",
                            "End the run before it, or keep it outside the tiled module.")
        if name in DROPOUT:
            b = dict(zip(("input", "p", "training", "inplace"), args)) | kwargs
            if b.get("training", True) and float(b.get("p", 0.5)) > 0:
                raise self.fail(name, f"dropout (p={b.get('p', 0.5)}) draws its mask for the "
                                "whole volume at once, so tiles cannot reproduce it",
                                "Set the dropout probability to 0 in tiled stages, or leave "
                                "this stage untiled (remat3d.checkpoint replays dropout "
                                "exactly).")
            return "generic", {}
        if name == "conv3d":
            b = bind(name, args, kwargs)
            kernel = tuple(int(k) for k in b["weight"].shape[2:])
            dilation = _triple(b["dilation"])
            padding = b["padding"]
            if isinstance(padding, str):
                padding = (0,) * 3 if padding == "valid" else \
                    tuple(d * (k - 1) // 2 for k, d in zip(kernel, dilation))
            return "conv", {"kernel": kernel, "stride": _triple(b["stride"]),
                            "padding": _triple(padding), "dilation": dilation}
        if name == "conv_transpose3d":
            b = bind(name, args, kwargs)
            return "conv_transpose", {"kernel": tuple(int(k) for k in b["weight"].shape[2:]),
                                      "stride": _triple(b["stride"]),
                                      "padding": _triple(b["padding"]),
                                      "dilation": _triple(b["dilation"])}
        if name in ("max_pool3d", "avg_pool3d"):
            b = bind(name, args, kwargs)
            if b["ceil_mode"]:
                raise self.fail(name, "ceil_mode=True", "Use ceil_mode=False in tiled runs.")
            if b.get("return_indices"):
                raise self.fail(name, "return_indices=True (indices are global positions)",
                                "Do not return pooling indices inside a tiled run.")
            padding = _triple(b["padding"])
            if name == "avg_pool3d" and any(padding) and not b["count_include_pad"]:
                raise self.fail(name, "count_include_pad=False with padding",
                                "Use count_include_pad=True or no padding in tiled runs.")
            kernel = _triple(b["kernel_size"])
            return name.replace("3d", ""), {
                "kernel": kernel, "stride": _triple(b["stride"], kernel), "padding": padding,
                "dilation": _triple(b.get("dilation", 1))}
        if name == "interpolate":
            b = bind(name, args, kwargs)
            mode = b["mode"]
            if mode not in ("nearest", "linear", "bilinear", "trilinear"):
                raise self.fail(name, f"mode={mode!r}", "Use 'nearest' or 'trilinear'.")
            if mode != "nearest" and b["align_corners"]:
                raise self.fail(name, "align_corners=True makes every output position depend "
                                "on the whole size", "Use align_corners=False.")
            return "interpolate", {"mode": "nearest" if mode == "nearest" else "linear",
                                   "request": b}
        if name in ("instance_norm", "group_norm", "batch_norm"):
            return "norm", {"norm": self.norm_spec(name, args, kwargs, spatial[0])}
        if name in DIM_OPS or name in SHAPE_OPS:
            self.check_dims(name, args, kwargs, spatial[0])
        spatial_ids = {id(t) for t in spatial}
        for t in tensors:  # a full-size tensor from outside the run cannot be tiled
            if id(t) not in spatial_ids and not getattr(t, _INNER, False) and t.dim() >= 3 \
                    and any(s > 1 for s in t.shape[-3:]):
                raise self.fail(name, f"it combines the run's tensors with a tensor of shape "
                                f"{tuple(t.shape)} from outside the run",
                                "Pass that tensor as an input of the run.")
        return "generic", {}

    def check_dims(self, name: str, args: Sequence[Any], kwargs: dict[str, Any],
                   x: torch.Tensor) -> None:
        if name in SHAPE_OPS:
            raise self.fail(name, "it may move voxels between positions",
                            "Keep reshapes and permutations outside tiled runs.")
        dims = kwargs.get("dim", kwargs.get("dims", args[1] if len(args) > 1 else None))
        values = dims if isinstance(dims, (list, tuple)) else [dims]
        for d in values:
            if not isinstance(d, int) or d % 5 >= 2:
                raise self.fail(name, f"it works along dimension {d!r}, which is spatial",
                                "Only channel-wise versions of this op can be tiled.")

    def norm_spec(self, name: str, args: Sequence[Any], kwargs: dict[str, Any],
                  x: torch.Tensor) -> NormSpec | None:
        b = bind(name, args, kwargs)
        channels = int(x.shape[1])
        if name == "group_norm":
            return NormSpec("group", int(b["num_groups"]), float(b["eps"]), False)
        if name == "instance_norm":
            if not b["use_input_stats"]:
                return None
            return NormSpec("instance", channels, float(b["eps"]),
                            b["running_mean"] is not None)
        if not (b["training"] or b["running_mean"] is None):
            return None  # BatchNorm in eval: running statistics, pointwise
        return NormSpec("batch", channels, float(b["eps"]), b["running_mean"] is not None)

    def spatial_op(self, role: str, a: dict[str, Any], inputs: tuple[int, ...],
                   output: int) -> SpatialOp:
        if role in ("conv", "max_pool", "avg_pool"):
            return SpatialOp(CONV, inputs[:1], output, a["kernel"], a["stride"], a["padding"],
                             a["dilation"])
        if role == "conv_transpose":
            return SpatialOp(CONV_TRANSPOSE, inputs[:1], output, a["kernel"], a["stride"],
                             a["padding"], a["dilation"])
        if role == "interpolate":
            src, dst = self.sizes[inputs[0]], self.sizes[output]
            if any(d % s for s, d in zip(src, dst)):
                raise TilingError(
                    f"Cannot tile interpolate in module '{self.modules.current()}': it "
                    f"resizes {src} to {dst}, not by an integer factor per axis. Use an "
                    "integer scale_factor.")
            return SpatialOp(INTERPOLATE, inputs[:1], output,
                             scale=tuple(d // s for s, d in zip(src, dst)), mode=a["mode"])
        return SpatialOp(POINTWISE, inputs, output)


UNTILEABLE = "_remat3d_untileable"  # a class attribute: why its modules cannot run tiled


def _refuse_untileable(module: torch.nn.Module) -> None:
    """A module whose class says it cannot run tiled (a reversible coupling rebuilds its
    input from its whole output) is refused by name, wherever it is called in the run."""
    reason = getattr(type(module), UNTILEABLE, None)
    if reason:
        raise TilingError(f"{module_name(module)} ({type(module).__name__}) cannot run "
                          f"tiled: {reason}.")


@contextlib.contextmanager
def _no_autocast_cache() -> Iterator[None]:
    """Autocast's weight-cast cache off while the trace runs: a weight cast on fake
    tensors, kept, would be what the real step's later ops of the same autocast block get
    (fake tensors: every later use of the weight fails or runs on fakes)."""
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def trace(fn: Callable[..., Any], inputs: Sequence[torch.Tensor],
          device: torch.device | None = None) -> Trace:
    """Record ``fn(*inputs)`` on fake tensors (no memory, no compute, buffers untouched).
    ``device``: where the run computes (inputs elsewhere, host-resident ones, are traced
    as if on it)."""
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise TilingError(f"Input {i} of a tiled run must be a 5-D tensor "
                              f"(N, C, D, H, W); got {got}.")
    modules = ModuleStack()
    modules.on_enter.append(_refuse_untileable)
    recorder = _Recorder(modules)
    with _disable_current_modes(), torch.no_grad():
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes: list[torch.Tensor] = [fake_mode.from_tensor(x) for x in inputs]
        if device is not None:
            with fake_mode:
                fakes = [f if f.device == device else torch.empty_like(f, device=device)
                         for f in fakes]
        nodes = [recorder.new_node(f) for f in fakes]
        with modules, BufferGuard(modules), _no_autocast_cache(), fake_mode, recorder:
            out = fn(*fakes)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not outs or any(not isinstance(o, torch.Tensor) or getattr(o, _NODE, None) is None
                       for o in outs):
        raise TilingError(f"A tiled run must return spatial tensors computed from its "
                          f"inputs (one, or a tuple); got {type(out).__name__}.")
    nodes_out = [getattr(o, _NODE) for o in outs]
    if len(set(nodes_out)) != len(nodes_out) or set(nodes_out) & set(nodes):
        raise TilingError("A tiled run must return distinct tensors that it computed, not "
                          "its inputs or the same tensor twice.")
    ops = recorder.ops
    norms: list[int] = []
    for i, op in enumerate(ops):
        if op.norm is not None:
            op.norm_index = len(norms)
            norms.append(i)
    return Trace(ops=ops, inputs=nodes, outputs=nodes_out, sizes=recorder.sizes,
                 out_shapes=[tuple(o.shape) for o in outs], out_dtypes=[o.dtype for o in outs],
                 params=list(recorder.params.values()), norms=norms,
                 voxel_bytes=recorder.voxel_bytes, returns_tuple=isinstance(out, (tuple, list)),
                 leading=recorder.leading, dtypes=recorder.dtypes)

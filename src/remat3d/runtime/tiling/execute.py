"""Run a traced run over one tile: every op computes exactly its planned region.

NOTE [ Exact tiles ]
  Each tensor of a tile run carries its region (global coordinates) as an attribute. The
  ``_TileMode`` function mode sees the user's calls in the order the trace recorded them
  and rewrites each so that it produces exactly the region the plan asks of its output:
  1. Convolutions and pooling read the input slice the halo arithmetic names and pad
     only where that slice leaves the volume (zeros, or -inf for max pooling), then run
     with padding 0: interior tile borders see real neighbours, volume borders the same
     padding as the untiled op. Strides need no alignment: the slice starts on the global
     grid of the op.
  2. Transposed convolutions and interpolation run on the input slice and crop (or pad)
     the local result to the planned region; positions no input reaches get the bias only,
     as in the untiled op.
  3. Pointwise ops, concatenation and residual additions crop every spatial operand to
     the planned region (regions are bounding boxes of what consumers need, so operands
     always cover it).
  4. Normalisations with statistics use statistics of the whole tensor, gathered over
     tiles in extra passes (``_Stats``), never the tile's own. Their backward uses the
     whole tensor's sums of the gradient (``_GlobalNorm``), gathered the same way.
  5. The backward sums of rule 4 are taken against the normalised tensor ``xhat`` that
     ``_GlobalNorm`` returns (the "capture"), so the run's later ops must never write into
     it. Without an affine weight or bias and without a cast, the normalisation's result
     would be a view of ``xhat``, and an in-place activation after it (MONAI's default
     ``InstanceNorm3d(affine=False)`` followed by ``LeakyReLU(inplace=True)``) would turn
     ``xhat`` into the activation's output: the sums would be taken against the wrong
     tensor and every gradient before the norm would be wrong. In a capture pass such a
     result is a copy.
  So every value a tile computes equals the untiled value at that position up to
  floating-point rounding order (statistics and parameter gradients are sums over tiles).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from remat3d.halo import (
    Region,
    conv_input_interval,
    conv_transpose_input_slices,
    interpolate_input_interval,
    region_size,
)
from remat3d.instrument.tensors import map_leaves, tensors_in
from remat3d.runtime.tiling.signatures import bind, func_name
from remat3d.runtime.tiling.trace import NormSpec, TilingError, Trace, TracedOp

__all__ = ["REGION", "REPLACE", "SKIP", "Stashing", "StopPass", "crop", "region_of",
           "whole_region"]

REGION = "_remat3d_tile_region"
SKIP = "skip"        # an op whose result the pass does not need: an uninitialised tensor
REPLACE = "replace"  # an op whose result is stashed: read from the stash, not computed


class StopPass(Exception):
    """Raised inside a statistics pass once the statistics it gathers are complete."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Normalisation arithmetic: at least float32 (bf16/fp16 inputs are widened)."""
    return torch.promote_types(dtype, torch.float32)


def region_of(t: torch.Tensor) -> Region:
    region: Region = getattr(t, REGION)
    return region


def whole_region(t: torch.Tensor) -> Region:
    """The region a whole 5-D tensor covers (from 0 on each spatial axis)."""
    return tuple((0, n) for n in t.shape[2:])


def crop(t: torch.Tensor, have: Region, want: Region) -> torch.Tensor:
    """The part of ``t`` (covering ``have``) that covers ``want`` (a view)."""
    for axis, ((h0, h1), (w0, w1)) in enumerate(zip(have, want)):
        if (h0, h1) == (w0, w1):
            continue
        if w0 < h0 or w1 > h1:
            raise AssertionError(f"region {want} is not inside {have}")
        t = t.narrow(2 + axis, w0 - h0, w1 - w0)
    return t


def _mark(out: Any, region: Region) -> Any:
    for t in tensors_in(out):
        if t.dim() == 5:
            setattr(t, REGION, region)
    return out


@dataclass
class Stashing:
    """What one pass of one tile does with stashed tensors (NOTE [ Stashed passes ] in
    ``tiled.py``): which ops it skips or reads from a stash, the stashes it reads (node
    -> the whole tensor) and those it fills at the tile's owned region (normalisation
    ordinal -> the whole tensor of that normalisation's input)."""

    actions: dict[int, str]
    read: dict[int, torch.Tensor] = field(default_factory=dict)
    write: dict[int, torch.Tensor] = field(default_factory=dict)


class Stats:
    """Mean and variance of one normalisation's input, merged over tiles (Chan et al.)."""

    def __init__(self, spec: NormSpec) -> None:
        self.spec = spec
        self.reset()

    def reset(self) -> None:
        """Forget everything gathered (a new forward of the run)."""
        self.count = 0
        self.mean: torch.Tensor | None = None   # float64, (N|1, G, 1, 1, 1, 1)
        self.m2: torch.Tensor | None = None
        self.rstd: torch.Tensor | None = None   # float64, once final
        self.sums: tuple[torch.Tensor, torch.Tensor] | None = None  # backward: sum g, g*xhat
        self.running: tuple[Any, Any, float | None] | None = None  # buffers, momentum

    def dims(self) -> tuple[int, ...]:
        return (0, 2, 3, 4, 5) if self.spec.kind == "batch" else (2, 3, 4, 5)

    def add(self, x6: torch.Tensor) -> None:
        dims = self.dims()
        n = x6.numel() // (x6.shape[1] * (1 if self.spec.kind == "batch" else x6.shape[0]))
        if n == 0:
            return
        # one fused pass (CPU reductions of float32 accumulate in float64)
        var, mean = torch.var_mean(x6.to(compute_dtype(x6.dtype)), dims, correction=0,
                                   keepdim=True)
        m2, mean = var.double() * n, mean.double()
        if self.mean is None or self.m2 is None:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta.square() * (self.count * n / total)
        self.count = total

    def finish(self) -> None:
        assert self.mean is not None and self.m2 is not None
        var = self.m2 / self.count
        self.rstd = (var + self.spec.eps).rsqrt()

    def unbiased_var(self) -> torch.Tensor:
        assert self.m2 is not None
        return self.m2 / max(self.count - 1, 1)


class _GlobalNorm(torch.autograd.Function):
    """``(x - mean) * rstd`` with whole-tensor statistics, and their exact backward."""

    @staticmethod
    def forward(ctx: Any, x6: torch.Tensor, stats: Stats,  # type: ignore[override]
                owned: Region | None) -> torch.Tensor:
        assert stats.mean is not None and stats.rstd is not None
        ctx.stats = stats
        ctx.owned = owned
        ctx.save_for_backward(x6)
        dtype = compute_dtype(x6.dtype)
        return (x6.to(dtype) - stats.mean.to(dtype)) * stats.rstd.to(dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        # dx_i = rstd * (g_i - mean(g) - xhat_i * mean(g * xhat)): the first term is this
        # tile's own contribution (linear in its output gradient); the mean terms are
        # whole-tensor sums, so each position takes them from exactly one tile: the tile
        # that owns it (NOTE rule 4).
        (x6,) = ctx.saved_tensors
        stats: Stats = ctx.stats
        if stats.sums is None:
            raise AssertionError("normalisation backward ran before its sums were gathered")
        assert stats.mean is not None and stats.rstd is not None
        dtype = g.dtype
        rstd = stats.rstd.to(dtype)
        dx = rstd * g
        if ctx.owned is not None:
            sum_g, sum_gx = (s.to(dtype) for s in stats.sums)
            local = tuple((0, n) for n in x6.shape[3:])
            x_own = _crop6(x6, local, ctx.owned)
            xhat = (x_own.to(dtype) - stats.mean.to(dtype)) * rstd
            correction = rstd * (sum_g / stats.count + xhat * (sum_gx / stats.count))
            _crop6(dx, local, ctx.owned).sub_(correction)
        return dx.to(x6.dtype), None, None


def _crop6(t: torch.Tensor, have: Region, want: Region) -> torch.Tensor:
    for axis, ((h0, _), (w0, w1)) in enumerate(zip(have, want)):
        t = t.narrow(3 + axis, w0 - h0, w1 - w0)
    return t


class TileMode(TorchFunctionMode):
    """See NOTE [ Exact tiles ]."""

    def __init__(self, trace: Trace, plan: dict[int, Region], stats: Sequence[Stats],
                 owned: dict[int, Region], stop_at: int | None = None,
                 capture: int | None = None, stashing: Stashing | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.trace = trace
        self.plan = plan
        self.stats = stats
        self.owned = owned          # norm ordinal -> region of its input this tile owns
        self.stop_at = stop_at      # norm ordinal whose statistics this pass gathers
        self.capture = capture      # norm ordinal whose normalised tile backward wants
        self.captured: torch.Tensor | None = None
        self.stashing = stashing
        self.device = device
        self.index = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if not any(getattr(t, REGION, None) is not None for t in tensors_in((args, kwargs))):
            return func(*args, **kwargs)
        ops = self.trace.ops
        name = func_name(func)
        if self.index >= len(ops) or ops[self.index].name != name:
            out = func(*args, **kwargs)
            if tensors_in(out):
                expected = ops[self.index].name if self.index < len(ops) else "nothing"
                raise TilingError(
                    f"A tile of the run called {name} where its trace called {expected} "
                    f"(op #{self.index}): the run's code depends on the size of its input. "
                    "Make it independent of the input size, or do not tile it.")
            return out
        op = ops[self.index]
        self.index += 1
        want = self.plan[op.spatial.output]
        action = self.stashing.actions.get(self.index - 1) if self.stashing else None
        if action == SKIP:
            return _mark(self._placeholder(op, want), want)
        if action == REPLACE:
            return _mark(self._stashed(op, want), want)
        handler = getattr(self, "_" + op.role)
        return _mark(handler(op, func, args, kwargs, want), want)

    # -- stashed passes (NOTE [ Stashed passes ] in tiled.py) ---------------------------
    def _placeholder(self, op: TracedOp, want: Region) -> torch.Tensor:
        """A result no op of this pass reads: uninitialised, no compute."""
        node = op.spatial.output
        extent = tuple(hi - lo for lo, hi in want)
        return torch.empty((*self.trace.leading[node], *extent), dtype=self.trace.dtypes[node],
                           device=self.device)

    def _stashed(self, op: TracedOp, want: Region) -> torch.Tensor:
        """``op``'s result over ``want``, copied from its stash (a leaf: with grad in a
        backward pass, so the pass differentiates from here on)."""
        from remat3d.runtime.tiling.host import is_host, to_device

        assert self.stashing is not None and self.device is not None
        whole = self.stashing.read[op.spatial.output]
        piece = crop(whole, whole_region(whole), want)
        value = to_device(piece, self.device) if is_host(whole) else piece.clone()
        return value.requires_grad_(torch.is_grad_enabled())

    # -- window ops (NOTE rule 1) -----------------------------------------------------
    def _window(self, op: TracedOp, x: torch.Tensor, want: Region, fill: float
                ) -> torch.Tensor:
        s = op.spatial
        slices, pads = [], []
        size = self.trace.sizes[s.inputs[0]]
        for a, (lo, hi) in enumerate(want):
            i0, i1 = conv_input_interval(lo, hi, kernel=s.kernel[a], stride=s.stride[a],
                                         padding=s.padding[a], dilation=s.dilation[a])
            slices.append((max(i0, 0), min(i1, size[a])))
            pads.append((max(-i0, 0), max(i1 - size[a], 0)))
        x = crop(x, region_of(x), tuple(slices))
        if any(p for pair in pads for p in pair):
            flat = [p for pair in reversed(pads) for p in pair]  # F.pad: last axis first
            x = F.pad(x, flat, value=fill)
        return x

    def _conv(self, op, func, args, kwargs, want):  # type: ignore[no-untyped-def]
        b = bind("conv3d", args, kwargs)
        x = self._window(op, b["input"], want, 0.0)
        return F.conv3d(x, b["weight"], b["bias"], op.spatial.stride, 0, op.spatial.dilation,
                        b["groups"])

    def _max_pool(self, op, func, args, kwargs, want):  # type: ignore[no-untyped-def]
        b = bind("max_pool3d", args, kwargs)
        x = self._window(op, b["input"], want, float("-inf"))
        return F.max_pool3d(x, op.spatial.kernel, op.spatial.stride, 0, op.spatial.dilation)

    def _avg_pool(self, op, func, args, kwargs, want):  # type: ignore[no-untyped-def]
        b = bind("avg_pool3d", args, kwargs)
        x = self._window(op, b["input"], want, 0.0)
        return F.avg_pool3d(x, op.spatial.kernel, op.spatial.stride, 0,
                            divisor_override=b["divisor_override"])

    # -- ops that crop their local result (NOTE rule 2) ---------------------------------
    def _conv_transpose(self, op, func, args, kwargs, want):  # type: ignore[no-untyped-def]
        b = bind("conv_transpose3d", args, kwargs)
        s = op.spatial
        x = b["input"]
        size = self.trace.sizes[s.inputs[0]]
        slices, starts = conv_transpose_input_slices(
            want, kernel=s.kernel, stride=s.stride, padding=s.padding, dilation=s.dilation,
            size=size)
        x = crop(x, region_of(x), slices)
        y = F.conv_transpose3d(x, b["weight"], None, s.stride, 0, 0, b["groups"], s.dilation)
        pads = [(g0 - lo, hi - (g0 + n)) for g0, (lo, hi), n in zip(starts, want, y.shape[2:])]
        bias = b["bias"]
        if all(p <= 0 for pair in pads for p in pair):
            if bias is not None:  # all positions reached: let the kernel add the bias
                y = F.conv_transpose3d(x, b["weight"], bias, s.stride, 0, 0, b["groups"],
                                       s.dilation)
            return crop(y, tuple((g0, g0 + n) for g0, n in zip(starts, y.shape[2:])), want)
        y = F.pad(y, [p for pair in reversed(pads) for p in pair])
        if bias is not None:
            y = y + bias.to(y.dtype).view(1, -1, 1, 1, 1)
        return y

    def _interpolate(self, op, func, args, kwargs, want):  # type: ignore[no-untyped-def]
        b = bind("interpolate", args, kwargs)
        s = op.spatial
        x = b["input"]
        size = self.trace.sizes[s.inputs[0]]
        slices = tuple(interpolate_input_interval(lo, hi, scale=s.scale[a], mode=s.mode,
                                                  size=size[a])
                       for a, (lo, hi) in enumerate(want))
        x = crop(x, region_of(x), slices)
        y = F.interpolate(x, scale_factor=tuple(float(f) for f in s.scale), mode=b["mode"],
                          align_corners=b["align_corners"], antialias=b["antialias"])
        local = tuple((i0 * f, i1 * f) for (i0, i1), f in zip(slices, s.scale))
        return crop(y, local, want)

    # -- pointwise, concatenation, residuals (NOTE rule 3) -------------------------------
    def _generic(self, op, func, args, kwargs, want):  # type: ignore[no-untyped-def]
        def fit(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and getattr(t, REGION, None) is not None:
                return crop(t, region_of(t), want)
            return t

        return func(*map_leaves(fit, args), **map_leaves(fit, kwargs))

    # -- normalisation (NOTE rule 4) -----------------------------------------------------
    def _norm(self, op, func, args, kwargs, want):  # type: ignore[no-untyped-def]
        spec = op.norm
        b = bind(op.name, args, kwargs)
        x = b["input"]
        if spec is None:  # running statistics (eval mode): pointwise
            return self._generic(op, func, args, kwargs, want)
        j = op.norm_index
        assert j is not None
        stats = self.stats[j]
        if self.stashing is not None and j in self.stashing.write:
            owned = self.owned[j]
            if region_size(owned):
                whole = self.stashing.write[j]
                crop(whole, whole_region(whole), owned).copy_(
                    crop(x, region_of(x), owned).detach())
        if self.stop_at == j:
            if spec.updates_running:
                stats.running = (b["running_mean"], b["running_var"], b["momentum"])
            owned = self.owned[j]
            if region_size(owned):
                stats.add(crop(x, region_of(x), owned).unflatten(1, (spec.groups, -1)))
            raise StopPass
        x6 = crop(x, region_of(x), want).unflatten(1, (spec.groups, -1))
        owned = self.owned[j]
        local_owned = tuple((o0 - w0, o1 - w0) for (o0, o1), (w0, _) in zip(owned, want)) \
            if region_size(owned) else None
        xhat = _GlobalNorm.apply(x6, stats, local_owned)
        y = xhat.flatten(1, 2)
        if b["weight"] is not None:
            y = y * b["weight"].to(y.dtype).view(1, -1, 1, 1, 1)
        if b["bias"] is not None:
            y = y + b["bias"].to(y.dtype).view(1, -1, 1, 1, 1)
        y = y.to(op.out_dtype)
        if self.capture == j:
            self.captured = xhat
            if b["weight"] is None and b["bias"] is None and y.dtype == xhat.dtype:
                # NOTE rule 5: y is a view of xhat; an in-place op of the run (nnU-Net's
                # LeakyReLU(inplace=True)) would overwrite the captured tensor
                y = y.clone()
        return y

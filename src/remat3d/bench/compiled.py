"""torch.compile with ``torch._functorch.config.activation_memory_budget``, measured.

The budget (a fraction in [0, 1]) steers AOTAutograd's min-cut partitioner: what the
forward graph saves for the backward graph, and what the backward graph recomputes. The
step is compiled with the ``aot_eager`` backend (the same partitioner as inductor, graphs
run op by op), then one step is measured by remat3d's tracker, as every other method.

NOTE [ Measuring a compiled step ]
  1. Dynamo refuses to run compiled code while a TorchDispatchMode is active (it falls
     back to eager and marks the frame skipped). The tracker here declares
     ``ignore_compile_internals``, so the compiled graphs run and the tracker sees each
     aten op they execute. The graphs are compiled by a first, untracked step; the
     measured step must not recompile (checked, else an error).
  2. No module hooks are installed (they would invalidate the compiled code), so there is
     no per-module attribution: peak, saved bytes and FLOPs only.
  3. ``aot_eager`` runs the partitioned graphs unfused: pointwise temporaries that inductor
     would fuse away are counted. ``saved_bytes`` (what the partitioner chose to keep) is
     exact; the peak is the peak of the unfused execution.
  4. Autocast on meta is remat3d's ``MetaAutocast`` function mode, which dynamo cannot
     trace. Under ``amp="bf16"`` the model gets explicit casts instead
     (:func:`cast_like_autocast`: weight and input casts on convolutions and linear
     layers, fp32 inputs for group/layer norm), which is what CUDA autocast does for
     networks built from those modules; :func:`cast_matches_autocast` checks it against
     MetaAutocast on the eager model, and the runner reports the difference.
  5. On meta, some ops have no autograd kernel inside a compiled graph (``aot_eager``
     traces ``aten::prelu`` of MONAI's UNet as non-differentiable: 2 of 97 parameters
     get gradients), which silently cuts the backward. A compiled step that leaves a
     parameter without a gradient that the eager step gives one is refused; such models
     are measured on CPU. (Parameters no step reaches, nnU-Net v2's deep-supervision
     heads with deep supervision off, have no gradient in either.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from remat3d.errors import Remat3dError
from remat3d.instrument.amp import amp_dtype
from remat3d.instrument.step import forward_backward, prepare_step, tracked_forward_backward
from remat3d.instrument.tracker import MemoryTracker

__all__ = [
    "CompiledStep",
    "budget_context",
    "cast_like_autocast",
    "compiled_step",
    "measure_cast_step",
]

_LOWER = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
          nn.ConvTranspose3d, nn.Linear)
_FP32 = (nn.GroupNorm, nn.LayerNorm)


class _CompileTracker(MemoryTracker):
    """The tracker, allowed to observe compiled code (NOTE rule 1)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def _cast_inputs(dtype: torch.dtype) -> Any:
    def hook(_module: nn.Module, args: tuple) -> tuple:
        return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point()
                     else a for a in args)

    return hook


def cast_like_autocast(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Give ``model`` the casts CUDA autocast would insert (NOTE rule 4), in place.

    >>> net = cast_like_autocast(nn.Sequential(nn.Conv3d(1, 2, 3)), torch.bfloat16)
    >>> net(torch.randn(1, 1, 4, 4, 4)).dtype
    torch.bfloat16
    """
    for module in model.modules():
        if isinstance(module, _LOWER):
            for name in ("weight", "bias"):
                if getattr(module, name, None) is not None:
                    parametrize.register_parametrization(module, name, _Cast(dtype),
                                                     unsafe=True)
            module.register_forward_pre_hook(_cast_inputs(dtype))
        elif isinstance(module, _FP32):
            module.register_forward_pre_hook(_cast_inputs(torch.float32))
    return model


@dataclass
class CompiledStep:
    """One measured training step of a compiled model."""

    peak_bytes: int
    saved_bytes: int
    flops: int
    graphs: int  # graphs dynamo compiled for this step (1: no graph break)


def _measure(model: nn.Module, shape: tuple[int, ...], device: str, amp: str | None,
             compiled: bool) -> CompiledStep:
    from torch._dynamo.utils import counters

    setup = prepare_step(model, [shape], device, amp, None)
    start = counters["stats"]["unique_graphs"]
    if compiled:  # compile on an untracked step (NOTE rule 1)
        forward_backward(setup)
        for p in model.parameters():
            p.grad = None
    before = counters["stats"]["unique_graphs"]
    tracker = _CompileTracker(device)
    tracker.register(list(model.parameters()), "param")
    tracker.register(list(model.buffers()), "buffer")
    tracker.register(list(setup.inputs), "input")
    tracked_forward_backward(setup, tracker)
    if compiled and counters["stats"]["unique_graphs"] != before:
        raise Remat3dError("torch.compile recompiled during the measured step, so the "
                           "measurement would include compilation; not measured.")
    trainable = [p for p in model.parameters() if p.requires_grad]
    reached = {id(p) for p in trainable if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    if compiled:  # what the eager step reaches (NOTE rule 5)
        forward_backward(prepare_step(getattr(model, "_orig_mod", model), [shape], device,
                                      amp, None))
        expected = [p for p in trainable if p.grad is not None]
        for p in model.parameters():
            p.grad = None
        trainable = expected
    else:  # the eager step is the reference
        trainable = [p for p in trainable if id(p) in reached]
    missing = sum(id(p) not in reached for p in trainable)
    if missing:  # NOTE rule 5
        raise Remat3dError(
            f"the compiled step on {device} left {missing} of {len(trainable)} parameters "
            "without a gradient (an op without an autograd kernel for this device cut the "
            "backward), so its memory and FLOPs are not the training step's; not measured.")
    return CompiledStep(tracker.peak_bytes, tracker.saved_bytes, sum(tracker.flops.values()),
                        counters["stats"]["unique_graphs"] - start)


def measure_cast_step(model: nn.Module, shape: tuple[int, ...], device: str,
                      amp: str | None) -> CompiledStep:
    """The eager step of ``model`` measured the way :func:`compiled_step` measures."""
    if amp is not None:
        cast_like_autocast(model, amp_dtype(amp))
    return _measure(model, shape, device, None, compiled=False)


def budget_context(memory_budget: float) -> contextlib.AbstractContextManager:
    """``activation_memory_budget`` set for compiling (and running) a step."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=memory_budget)


def compiled_step(model: nn.Module, shape: tuple[int, ...], device: str, amp: str | None,
                  memory_budget: float) -> tuple[nn.Module, CompiledStep]:
    """Compile ``model`` (``aot_eager``) at ``memory_budget`` and measure one step.

    Returns the compiled module (to time it or check its gradients) and the measurement.
    """
    import torch._dynamo

    torch._dynamo.reset()
    if amp is not None:
        cast_like_autocast(model, amp_dtype(amp))
    with budget_context(memory_budget):
        compiled = torch.compile(model, backend="aot_eager")
        step = _measure(compiled, shape, device, None, compiled=True)  # type: ignore[arg-type]
    return compiled, step  # type: ignore[return-value]

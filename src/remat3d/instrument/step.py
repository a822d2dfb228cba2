"""One training step (forward, loss, backward), run under the tracker.

This is shared by :func:`remat3d.profile` and :func:`remat3d.measure`; it decides where the
step runs and leaves the caller's model as it found it.

NOTE [ The caller's model is never changed ]
  1. ``device="meta"``: the step runs on a structural copy whose parameters and buffers are
     meta tensors (made without copying any weight data), so a 512³ step of any model is
     measured without memory.
  2. Another device than the model's: the step runs on a copy moved there.
  3. The model's own device: the step runs on the model itself; buffers (BatchNorm running
     statistics), ``.grad`` fields and the RNG state are restored afterwards.
  Gradients start from ``None`` (as after ``optimizer.zero_grad(set_to_none=True)``).

NOTE [ What a step holds ]
  A training loop is written ``out = model(x); loss = criterion(out, y); loss.backward()``:
  the model's output stays referenced through backward. So every step here holds it until
  backward ends (``forward_output_loss``), and a verified peak is that loop's peak. A loop
  that drops it (``criterion(model(x), y)``, remat3d's own trainer) peaks as high or lower,
  never higher. Dropping it here instead made the verified peak an output's size below an
  ordinary loop's whenever the peak came in backward (16 MiB on a 128³ AttentionUnet with
  two classes).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from remat3d.errors import ModelForwardError, Remat3dError, quoted
from remat3d.instrument.amp import MetaAutocast, amp_dtype
from remat3d.instrument.tracker import MemoryTracker, normalize_device
from remat3d.units import format_shape

__all__ = ["StepSetup", "default_loss", "forward_backward", "forward_output_loss", "meta_copy",
           "prepare_step", "preserved_state", "rare_full_collections", "run_step",
           "tracked_forward_backward"]

LossFn = Callable[[Any], torch.Tensor]


def default_loss(output: Any) -> torch.Tensor:
    """Mean of every floating-point output tensor, summed (works for tuples and dicts).

    A mean keeps no activation alive for backward, so the measured step is the model's.
    Pass ``loss_fn`` to measure a real loss (Dice + cross-entropy allocate more).
    """
    terms = [t.float().mean() for t in tree_leaves(output)
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not terms:
        raise Remat3dError(
            "The model's output has no floating-point tensor that requires grad, so there is "
            "no backward to measure. Check that parameters require grad, or pass loss_fn."
        )
    return terms[0] if len(terms) == 1 else torch.stack(terms).sum()


def meta_copy(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers live on the meta device."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def model_device(model: nn.Module) -> torch.device | None:
    """The device of a module's first parameter or buffer (``None``: it has neither)."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device
    return None


def input_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype an input given only by its shape takes: the model's floating-point
    parameters' (a model in pure bf16 takes bf16 inputs); None, the default, without any."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def example_input(x: Any, device: str, dtype: torch.dtype | None = None) -> Any:
    """A step's input on ``device``: a tensor moved there (its dtype kept), or for a shape
    a new tensor of ``dtype`` (random off meta); anything else as it is."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "meta" and device != "meta":
            raise Remat3dError(
                f"Input of shape {tuple(x.shape)} is on the meta device and has no data; "
                f"a step on {device} needs real inputs. Use device='meta' or pass a tensor "
                "(or just its shape as a tuple)."
            )
        y = x.detach().to(device)
        return y.requires_grad_(x.requires_grad)
    if isinstance(x, (tuple, list, torch.Size)) and x and all(isinstance(s, int) for s in x):
        if device == "meta":
            return torch.empty(tuple(x), device="meta", dtype=dtype)
        return torch.randn(tuple(x), device=device, dtype=dtype)
    return x


@dataclass
class StepSetup:
    """Where and how a step runs."""

    model: nn.Module
    inputs: tuple
    device: str
    amp: torch.dtype | None
    loss_fn: LossFn
    in_place: bool  # the caller's own model object (restore its state afterwards)


def prepare_step(
    model: nn.Module,
    inputs: Sequence[Any],
    device: str | torch.device,
    amp: str | None,
    loss_fn: LossFn | None,
) -> StepSetup:
    if not isinstance(model, nn.Module):
        raise Remat3dError(f"Expected a torch.nn.Module, got {type(model).__name__}.")
    if not inputs:
        raise Remat3dError("Pass at least one example input (a tensor or a shape tuple).")
    # The first convolution under a dispatch mode imports torch._dynamo (torch/_compile.py).
    # Imported mid-step, the import machinery keeps the step's frames, and the activations
    # they hold, in reference cycles until Python's cyclic collector runs: the first step of
    # a process then peaked higher than the next ones (3 MB on a 32³ SegResNet). Import it
    # before any step instead.
    import torch._dynamo  # noqa: F401
    try:
        dev = normalize_device(device)
    except (RuntimeError, AssertionError) as exc:
        raise Remat3dError(f"Device {device!r} is not usable here: {exc}") from None
    dtype = amp_dtype(amp)
    model_dev = model_device(model)
    if dev == "meta":
        step_model = model if model_dev is not None and model_dev.type == "meta" \
            else meta_copy(model)
        in_place = False
    elif model_dev is None or str(model_dev) == dev:
        step_model, in_place = model, True
    else:
        step_model, in_place = copy.deepcopy(model).to(dev), False
    dtype_of_shapes = input_dtype(step_model)
    step_inputs = tuple(example_input(x, dev, dtype_of_shapes) for x in inputs)
    return StepSetup(step_model, step_inputs, dev, dtype, loss_fn or default_loss, in_place)


@contextlib.contextmanager
def preserved_state(setup: StepSetup) -> Iterator[None]:
    """Restore buffers, grads and RNG of the caller's model after an in-place step."""
    if not setup.in_place:
        yield
        return
    model = setup.model
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _autocast(setup: StepSetup) -> contextlib.AbstractContextManager:
    if setup.amp is None:
        return contextlib.nullcontext()
    if setup.device == "meta":
        return MetaAutocast(setup.amp)
    return torch.autocast(torch.device(setup.device).type, dtype=setup.amp)


def forward_output_loss(setup: StepSetup) -> tuple[Any, torch.Tensor]:
    """The model's output and the loss on it (hold both through backward: module NOTE)."""
    with _autocast(setup):
        try:
            output = setup.model(*setup.inputs)
        except Remat3dError:
            raise
        except (RuntimeError, ValueError, TypeError, IndexError, AssertionError) as exc:
            shapes = ", ".join(format_shape(x.shape) + f" {str(x.dtype).replace('torch.', '')}"
                               for x in setup.inputs if isinstance(x, torch.Tensor))
            amp = "" if setup.amp is None else f" under {str(setup.amp)[6:]} autocast"
            raise ModelForwardError(
                f"{type(setup.model).__name__}'s forward failed on a {shapes} input{amp}: "
                f"{type(exc).__name__}: {quoted(exc) or 'no message'} Check the model's "
                "settings (channels, strides, kwargs) against the input's shape and channels."
            ) from exc
        try:
            loss = setup.loss_fn(output)
        except RuntimeError as exc:
            if setup.device == "meta" and "meta" in str(exc):
                raise Remat3dError(
                    "loss_fn mixed the model's meta-device output with real tensors "
                    f"({exc}). On device='meta', make the tensors it uses (targets) meta "
                    "too, e.g. target.to('meta'), or profile on device='cpu'."
                ) from exc
            raise
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise Remat3dError(
            f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            + "."
        )
    return output, loss


def forward_backward(setup: StepSetup) -> None:
    """One untracked step, the output held through backward (NOTE [ What a step holds ])."""
    output, loss = forward_output_loss(setup)
    loss.backward()
    del output, loss


def held_tensors(fn: Any) -> list[torch.Tensor]:
    """The tensors a loss function holds itself (its closure, a ``functools.partial``'s
    arguments, its defaults): its targets, alive through the whole step, so counted from
    its start like the inputs (a label first read by the loss is as alive during forward
    as in a training loop, which loads it with the image)."""
    held: list[Any] = []
    while fn is not None:
        held += [cell.cell_contents for cell in getattr(fn, "__closure__", None) or ()
                 if _filled(cell)]
        held += list(getattr(fn, "__defaults__", None) or ())
        held += list((getattr(fn, "__kwdefaults__", None) or {}).values())
        if isinstance(fn, functools.partial):
            held += [*fn.args, *fn.keywords.values()]
        fn = fn.func if isinstance(fn, functools.partial) else None
    return [t for t in tree_leaves(held) if isinstance(t, torch.Tensor)]


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def tracked_forward_backward(setup: StepSetup, tracker: MemoryTracker) -> None:
    """Forward, loss and backward under ``tracker``, marking where forward ends (what is
    alive then is what autograd saved) and that the ops after it are backward's."""
    with tracker:
        output, loss = forward_output_loss(setup)
        tracker.mark_forward_end(output)
        tracker.phase = "backward"
        loss.backward()
        del output, loss


def run_step(setup: StepSetup, *, time_ops: bool = False,
             replays: bool = False) -> MemoryTracker:
    """Run one instrumented training step; return the tracker holding what it saw
    (``replays``: repeated tiles on meta booked, not run, NOTE [ Repeats on meta ])."""
    tracker = MemoryTracker(setup.device, setup.model, time_ops=time_ops, replays=replays)
    with preserved_state(setup):
        for p in setup.model.parameters():
            p.grad = None
        try:
            tracker.register_model(setup.model)
            tracker.register(list(setup.inputs), "input")
            tracker.register(held_tensors(setup.loss_fn), "input")
            tracked_forward_backward(setup, tracker)
            tracker.mark_gradients(list(setup.model.parameters()) + list(setup.inputs))
        finally:
            if tracker.invocations is not None:
                tracker.invocations.remove()
    return tracker


@contextlib.contextmanager
def rare_full_collections() -> Iterator[None]:
    """Python's full garbage collections, a hundred times rarer while a step runs on meta.

    A verified 512³ step makes millions of objects that live to its end (timeline events,
    ledger records, meta tensors); each full collection walks all of them, which was a
    sixth of a tiled step's wall time. The young generations are collected as often as
    before (what a step frees through reference cycles is freed as soon). The threshold
    is process-wide: the first of nested or concurrent users (threads planning at once)
    raises it, the last to leave puts back what the first found, whatever happened."""
    global _RARE_USERS, _RARE_BEFORE
    with _RARE_LOCK:
        if _RARE_USERS == 0:
            _RARE_BEFORE = gc.get_threshold()
            gc.set_threshold(_RARE_BEFORE[0], _RARE_BEFORE[1], max(_RARE_BEFORE[2], 1000))
        _RARE_USERS += 1
    try:
        yield
    finally:
        with _RARE_LOCK:
            _RARE_USERS -= 1
            if _RARE_USERS == 0:
                gc.set_threshold(*_RARE_BEFORE)


_RARE_LOCK = threading.Lock()
_RARE_USERS = 0  # how many rare_full_collections() blocks are running now
_RARE_BEFORE: tuple[int, ...] = gc.get_threshold()


def time_step(setup: StepSetup, repeats: int = 1) -> float:
    """Median wall time of ``repeats`` uninstrumented steps (state restored after each)."""
    sync = setup.device.startswith("cuda")
    times = []
    for _ in range(repeats):
        with preserved_state(setup):
            for p in setup.model.parameters():
                p.grad = None
            if sync:
                torch.cuda.synchronize()
            start = time.perf_counter()
            forward_backward(setup)
            if sync:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]

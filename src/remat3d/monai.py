"""``remat3d.monai.WholeVolumeInferer``: whole-volume prediction as a MONAI inferer.

A drop-in for ``SlidingWindowInferer`` in a MONAI bundle's ``inference.json`` (or any
``SupervisedEvaluator``): the network runs once on the whole volume through
:func:`remat3d.predict`, tiled under a device budget where the whole forward does not fit,
every voxel computed from the same whole-volume statistics. No windows, no blending::

    "inferer": {"_target_": "remat3d.monai.WholeVolumeInferer", "budget": "8GiB"}

``import remat3d`` never imports this module (nor MONAI); a bundle's ``_target_`` or
``import remat3d.monai`` does.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from monai.data import MetaTensor
from monai.inferers import Inferer
from torch import nn

from remat3d.errors import BudgetError, InputShapeError, ModelForwardError, ModelSpecError
from remat3d.instrument.step import model_device
from remat3d.planning import resolve_budget
from remat3d.predicting import OUTPUTS, PredictionPlan, plan_prediction, predict
from remat3d.units import format_shape, parse_amp

__all__ = ["WholeVolumeInferer"]

logger = logging.getLogger(__name__)

_PADDING_MODES = ("constant", "reflect", "replicate")


class WholeVolumeInferer(Inferer):
    """The network's output on the whole input batch, by :func:`remat3d.predict`.

    Called as MONAI calls an inferer, ``inferer(inputs, network)``, it returns what
    ``SlidingWindowInferer`` returns for that call: ``(N, C, D, H, W)`` logits in the
    input's dtype, a ``MetaTensor`` with the input's metadata where the input is one, so
    a bundle's post-processing (``Activationsd``, ``Invertd``, ``AsDiscreted``,
    ``SaveImaged``) runs unchanged. The network must be an ``nn.Module`` called with the
    volume alone.

    Args:
        budget: device memory for the forward: ``"8GiB"``, ``"0.5x"`` (of the untiled
            forward's peak), bytes, or ``"auto"``. Default ``None``: ``"auto"`` (the free
            memory of the CUDA device, less 5 %) where the network computes on CUDA, else
            ``"1.0x"`` (the untiled forward, bit for bit the network's own). A bundle is
            shared across GPUs of any size, so the default is the card's free memory, not
            a number written for one card; a CPU has no such number to query.
        amp: ``"bf16"`` / ``"fp16"`` / ``"none"``: the forward under autocast's rules.
            Default ``None``: the autocast around the call (``SupervisedEvaluator(amp=True)``
            enters one), if any, else none.
        output: ``"logits"`` (default: what ``SlidingWindowInferer`` returns, for the
            bundle's own post-processing), ``"probabilities"`` (softmax over channels,
            float16) or ``"labels"`` (argmax over channels, uint8, with a channel axis of 1:
            drop ``Activationsd``/``AsDiscreted(argmax=True)`` from the post-processing).
        device: where the network computes (default: where its parameters are).
        divisible_by: pad each spatial size up to a multiple of this (the network's total
            downsampling, e.g. 16 for a SegResNet with four levels) and crop the output
            back, as ``SlidingWindowInferer`` pads a volume smaller than its window.
            Default ``None``: no padding; a volume the network cannot take is an
            :class:`~remat3d.errors.InputShapeError` naming this option.
        padding_mode: ``"constant"`` (zeros, ``SlidingWindowInferer``'s default),
            ``"reflect"`` or ``"replicate"``.

    Plans are cached per network, input shape, dtype, device and amp, so a dataset of
    same-shaped volumes is planned once; the weights may change between calls (a plan
    does not depend on them).
    """

    def __init__(self, budget: str | int | None = None, *, amp: str | None = None,
                 output: str = "logits", device: str | torch.device | None = None,
                 divisible_by: int | Sequence[int] | None = None,
                 padding_mode: str = "constant") -> None:
        super().__init__()
        _check_budget(budget)
        if output not in OUTPUTS:
            raise ModelSpecError(f"WholeVolumeInferer(output={output!r}): the output is one "
                                 f"of {', '.join(OUTPUTS)}.")
        if padding_mode not in _PADDING_MODES:
            raise ModelSpecError(f"WholeVolumeInferer(padding_mode={padding_mode!r}): use "
                                 f"one of {', '.join(_PADDING_MODES)}.")
        self.budget = budget
        self.amp = parse_amp(amp) if amp is not None else None
        self.follow_autocast = amp is None
        self.output = output
        self.device = torch.device(device) if device is not None else None
        self.divisible_by = _divisors(divisible_by)
        self.padding_mode = padding_mode
        self._plans: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...],
                                                               PredictionPlan]] = \
            weakref.WeakKeyDictionary()

    def __call__(self, inputs: torch.Tensor, network: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        if not isinstance(network, nn.Module):
            raise ModelSpecError(
                f"WholeVolumeInferer runs an nn.Module, not a {type(network).__name__}: "
                "pass the network itself (a bundle's @network), not a function around it.")
        if args or kwargs:
            raise ModelForwardError(
                f"WholeVolumeInferer calls the network with the volume alone, and this call "
                f"passes {len(args)} more arguments and keywords {sorted(kwargs)}. Remove "
                "them from the evaluator (prepare_batch, network kwargs), or use MONAI's "
                "SlidingWindowInferer for such a network.")
        if not isinstance(inputs, torch.Tensor) or inputs.dim() != 5:
            shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else None
            raise InputShapeError(
                f"WholeVolumeInferer takes a batch (N, C, D, H, W), not "
                f"{format_shape(shape) if shape else type(inputs).__name__}: load volumes "
                "with a channel axis (EnsureChannelFirstd) and batch them (DataLoader).")
        volume = inputs.as_tensor() if isinstance(inputs, MetaTensor) else inputs
        volume, crop = self._pad(volume)
        plan = self.plan(network, volume)
        out = predict(network, volume, plan=plan)
        if self.output == "labels":
            out = out.unsqueeze(1)  # the channel axis MONAI's post-processing expects
        elif self.output == "logits" and out.dtype != inputs.dtype and \
                inputs.dtype.is_floating_point:
            out = out.to(inputs.dtype)  # as SlidingWindowInferer: logits in the input's dtype
        if crop is not None:
            out = out[(slice(None), slice(None), *crop)]
        if isinstance(inputs, MetaTensor):
            # as SlidingWindowInferer: the input's metadata (affine, applied operations,
            # is_batch), shared, not copied
            out = MetaTensor(out).copy_meta_from(inputs, copy_attr=False)
        return out

    def plan(self, network: nn.Module, volume: torch.Tensor) -> PredictionPlan:
        """The cached :class:`~remat3d.predicting.PredictionPlan` for ``network`` on a
        (padded) ``volume``, planned on first use."""
        device = self.device or model_device(network) or volume.device
        amp = self._amp(device)
        key = (tuple(volume.shape), volume.dtype, str(device), amp)
        plans = self._plans.setdefault(network, {})
        if key not in plans:
            budget = self.budget
            if budget is None:
                budget = "auto" if device.type == "cuda" else "1.0x"
            try:
                plans[key] = plan_prediction(network, tuple(volume.shape), budget=budget,
                                             amp=amp, output=self.output, device=device)
            except InputShapeError as exc:
                if self.divisible_by is not None:
                    raise
                raise InputShapeError(
                    f"{exc} With WholeVolumeInferer, pass divisible_by=<the network's total "
                    "downsampling> (e.g. 16) to pad and crop back, or add DivisiblePadd to the "
                    "pre-processing.") from exc
            logger.info("WholeVolumeInferer: %s", plans[key].summary())
        return plans[key]

    def _amp(self, device: torch.device) -> str | None:
        if not self.follow_autocast:
            return self.amp
        if device.type in ("cuda", "cpu") and torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
            return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
        return None

    def _pad(self, volume: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
        """Pad each spatial size to a multiple of ``divisible_by`` (half before, the rest
        after, as MONAI's inferers pad); the slices that crop the output back."""
        if self.divisible_by is None:
            return volume, None
        spatial = volume.shape[2:]
        steps = self.divisible_by * 3 if len(self.divisible_by) == 1 else self.divisible_by
        extra = [-size % step for size, step in zip(spatial, steps)]
        if not any(extra):
            return volume, None
        pad: list[int] = []
        for diff in reversed(extra):  # F.pad: the last axis first
            pad += [diff // 2, diff - diff // 2]
        crop = tuple(slice(d // 2, d // 2 + size) for d, size in zip(extra, spatial))
        padded = F.pad(volume, pad, mode=self.padding_mode)
        return padded, crop


def _check_budget(budget: str | int | None) -> None:
    """Fail at construction, naming the option, rather than at the first volume."""
    if budget is None or (isinstance(budget, str) and budget.strip().lower() == "auto"):
        return
    try:
        resolve_budget(budget, 1)
    except BudgetError as exc:
        raise BudgetError(f"WholeVolumeInferer(budget={budget!r}): {exc}") from None


def _divisors(divisible_by: int | Sequence[int] | None) -> tuple[int, ...] | None:
    if divisible_by is None:
        return None
    steps = (divisible_by,) if isinstance(divisible_by, int) else tuple(divisible_by)
    if len(steps) not in (1, 3) or not all(isinstance(s, int) and s >= 1 for s in steps):
        raise InputShapeError(f"WholeVolumeInferer(divisible_by={divisible_by!r}): give a "
                              "positive int (e.g. 16) or one per spatial axis.")
    return steps

"""Pretrained weights: read a checkpoint in any common container, fit it to the model, and
say exactly what was loaded.

Checkpoints in the wild wrap their state dict (``{"state_dict": ...}``, ``{"model": ...}``,
nnU-Net's ``network_weights``), prefix its keys (``module.`` from DDP, ``model.`` from
Lightning, ``_orig_mod.`` from torch.compile, ``_checkpoint_wrapped_module.`` from
activation-checkpoint wrappers) and carry a head for another task. :func:`load_pretrained`
unwraps and strips all of that, loads every tensor whose name and shape match, and returns a
:class:`LoadReport` of loaded, missing, unexpected and shape-mismatched keys (a new
segmentation head is normal and is reported, not refused).
"""

from __future__ import annotations

import fnmatch
import logging
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from remat3d.errors import WeightsError
from remat3d.zoo.fitting import read_state_dict

__all__ = ["LoadReport", "apply_freeze", "load_pretrained", "read_state_dict"]

logger = logging.getLogger(__name__)

_PREFIXES = ("module.", "model.", "_orig_mod.", "net.", "network.")
_INFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did; ``str()`` is a short human summary."""

    path: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)      # in the model, not in the file
    unexpected: list[str] = field(default_factory=list)   # in the file, not in the model
    mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=dict)                             # name -> (file shape, model shape)
    stripped: list[str] = field(default_factory=list)     # prefixes removed

    def __str__(self) -> str:
        lines = [f"pretrained {self.path}: loaded {len(self.loaded)} tensors"
                 + (f" (stripped {', '.join(repr(p) for p in self.stripped)})"
                    if self.stripped else "")]
        for name, (old, new) in list(self.mismatched.items())[:8]:
            lines.append(f"  shape mismatch, kept the model's: {name} file {list(old)} "
                         f"model {list(new)}")
        if self.missing:
            lines.append(f"  missing from the file (kept as initialised): {len(self.missing)}"
                         f": {', '.join(self.missing[:6])}{' …' if len(self.missing) > 6 else ''}")
        if self.unexpected:
            lines.append(f"  not in the model (ignored): {len(self.unexpected)}: "
                         f"{', '.join(self.unexpected[:6])}"
                         f"{' …' if len(self.unexpected) > 6 else ''}")
        return "\n".join(lines)


def _fit_names(tensors: dict[str, torch.Tensor], wanted: set[str]) -> tuple[
        dict[str, torch.Tensor], list[str]]:
    """Strip wrapper infixes, then the prefixes that make the most names match the model."""
    stripped: list[str] = []
    for infix in _INFIXES:
        if any(infix in k for k in tensors):
            tensors = {k.replace(infix, ""): v for k, v in tensors.items()}
            stripped.append(infix)
    # peel wrapper prefixes while every key has one (e.g. "model.module."), and keep the
    # version whose names match the model best
    best = (len(wanted & set(tensors)), tensors, list(stripped))
    peeled = list(stripped)
    for _ in range(len(_PREFIXES)):
        prefix = next((p for p in _PREFIXES if all(k.startswith(p) for k in tensors)), None)
        if prefix is None:
            break
        tensors = {k[len(prefix):]: v for k, v in tensors.items()}
        peeled.append(prefix)
        score = len(wanted & set(tensors))
        if score > best[0]:
            best = (score, tensors, list(peeled))
    return best[1], best[2]


def load_pretrained(model: nn.Module, path: str | os.PathLike[str]) -> LoadReport:
    """Load what fits of ``path`` into ``model`` (in place) and report the rest."""
    own = model.state_dict()
    tensors, stripped = _fit_names(read_state_dict(path), set(own))
    report = LoadReport(str(path), stripped=stripped)
    fitting = {}
    for name, tensor in tensors.items():
        if name not in own:
            report.unexpected.append(name)
        elif tuple(tensor.shape) != tuple(own[name].shape):
            report.mismatched[name] = (tuple(tensor.shape), tuple(own[name].shape))
        else:
            fitting[name] = tensor
    report.loaded = sorted(fitting)
    report.missing = sorted(set(own) - set(tensors))
    if not fitting:
        raise WeightsError(
            f"None of the {len(tensors)} tensors in {str(path)!r} fits this "
            f"{type(model).__name__} (e.g. file key {next(iter(tensors), '?')!r}, model key "
            f"{next(iter(own), '?')!r}). Are the weights for another architecture or other "
            "model_kwargs?"
        )
    model.load_state_dict(fitting, strict=False)
    logger.info("%s", report)
    return report


def apply_freeze(model: nn.Module, freeze: list[str], unfreeze: list[str]) -> list[str]:
    """Set ``requires_grad=False`` on parameters matching a ``freeze`` pattern (fnmatch),
    then back to True for ``unfreeze`` matches; return the frozen names. A pattern that
    matches nothing is an error (a typo would otherwise silently train everything)."""
    names = [n for n, _ in model.named_parameters()]
    for pattern in [*freeze, *unfreeze]:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            close = [n for n in names if pattern.strip("*.") in n][:3]
            raise WeightsError(
                f"Freeze pattern {pattern!r} matches no parameter of {type(model).__name__}"
                + (f" (similar: {', '.join(close)})" if close else
                   f" (names look like {', '.join(names[:3])})")
                + ". Patterns are fnmatch-style, e.g. 'encoder.*'."
            )
    frozen = []
    for name, p in model.named_parameters():
        off = any(fnmatch.fnmatchcase(name, pat) for pat in freeze)
        on = any(fnmatch.fnmatchcase(name, pat) for pat in unfreeze)
        p.requires_grad_(not off or on)
        if off and not on:
            frozen.append(name)
    return frozen

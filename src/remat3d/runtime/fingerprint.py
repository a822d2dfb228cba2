"""Which model a plan is for: a fingerprint of the module tree, and the finer signature
the plan cache keys on."""

from __future__ import annotations

import hashlib

from torch import nn

__all__ = ["model_fingerprint", "model_signature"]


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of the module tree: names, types and parameter shapes."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__name__};".encode())
        for pname, p in module.named_parameters(recurse=False):
            digest.update(f"{pname}{tuple(p.shape)};".encode())
    return digest.hexdigest()[:16]


def model_signature(model: nn.Module) -> str:
    """:func:`model_fingerprint` plus what a training step's memory also depends on: each
    module's settings (its ``extra_repr``: stride, padding, ...), training mode, parameter
    dtypes and which parameters require grad, buffer shapes and dtypes.

    Plans are cached by it (``remat3d.plan``). ``apply`` checks only the fingerprint: a
    plan still applies to a model whose layers were frozen after planning.
    """
    digest = hashlib.sha256(model_fingerprint(model).encode())
    for name, module in model.named_modules():
        digest.update(f"{name}:{module.extra_repr()}:{module.training};".encode())
        for pname, p in module.named_parameters(recurse=False):
            digest.update(f"{pname}:{p.dtype}:{p.requires_grad};".encode())
        for bname, b in module.named_buffers(recurse=False):
            digest.update(f"{bname}:{tuple(b.shape)}:{b.dtype};".encode())
    return digest.hexdigest()[:16]

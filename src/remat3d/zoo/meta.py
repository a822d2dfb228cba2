"""Building a model on the meta device: no memory, whatever its constructor does."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["build_on_meta"]

logger = logging.getLogger(__name__)


def build_on_meta(constructor: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    # NOTE [ Building on meta ]
    # `with torch.device("meta")` makes every factory call allocate nothing. Some constructors
    # read a tensor back as a Python number while building (SwinUNETR calls .item() on a
    # torch.linspace of drop-path rates), which meta tensors cannot do. For those, build on
    # the CPU and move each parameter and buffer to meta as it is registered, so only one
    # parameter at a time is ever materialised.
    try:
        with torch.device("meta"):
            return constructor(**kwargs)
    except (RuntimeError, NotImplementedError) as exc:
        if "meta" not in str(exc):
            raise
        logger.debug("constructor needs real tensors (%s); registering parameters on meta", exc)
    with _parameters_on_meta():
        return constructor(**kwargs)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter and buffer registered while this is active moves to meta, through
    PyTorch's module registration hooks (removed on the way out, whatever happened)."""
    from torch.nn.modules.module import (
        register_module_buffer_registration_hook,
        register_module_parameter_registration_hook,
    )

    def to_meta_parameter(module: nn.Module, name: str, param: nn.Parameter | None
                          ) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    def to_meta_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None
                       ) -> torch.Tensor | None:
        return None if tensor is None or tensor.is_meta else tensor.to("meta")

    handles = [register_module_parameter_registration_hook(to_meta_parameter),
               register_module_buffer_registration_hook(to_meta_buffer)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()

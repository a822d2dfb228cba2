"""FLOPs of one aten op, by PyTorch's own formulas.

We count with ``torch.utils.flop_counter``'s registry (the formulas behind
``FlopCounterMode``), so our totals agree with it by construction, while attributing each
op to the module invocation and phase we track ourselves. Like ``FlopCounterMode``, only
matmul-, convolution- and attention-type ops are counted; pointwise ops, norms and
reductions count zero (their cost is memory traffic, not arithmetic).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, shape_wrapper

from remat3d.instrument.tensors import map_leaves

__all__ = ["op_flops"]

# the code of the wrapper shape_wrapper puts around a formula (the formulas it wraps take
# shapes, and op_flops hands them shapes itself)
_SHAPE_WRAPPED = shape_wrapper(lambda: 0).__code__


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of ``func(*args, **kwargs) -> out``; 0 for ops without a formula."""
    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return 0
    inner = getattr(formula, "__wrapped__", None)
    if inner is None or getattr(formula, "__code__", None) is not _SHAPE_WRAPPED:
        # not wrapped by the registry's shape_wrapper: the formula takes tensors
        return int(formula(*args, **kwargs, out_val=out))
    # what shape_wrapper hands the formula, without its general tree_map: every op of a
    # verified step comes through here
    shaped_args, shaped_kwargs, out_shape = map_leaves(_shape, (args, kwargs, out))
    return int(inner(*shaped_args, out_shape=out_shape, **shaped_kwargs))


def _shape(value: Any) -> Any:
    return value.shape if isinstance(value, torch.Tensor) else value

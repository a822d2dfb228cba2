"""FLOPs of one aten op, by PyTorch's own formulas.

We count with ``torch.utils.flop_counter``'s registry (the formulas behind
``FlopCounterMode``), so our totals agree with it by construction, while attributing each
op to the module invocation and phase we track ourselves. Like ``FlopCounterMode``, only
matmul-, convolution- and attention-type ops are counted; pointwise ops, norms and
reductions count zero (their cost is memory traffic, not arithmetic).
"""

from __future__ import annotations

from typing import Any

from torch.utils.flop_counter import flop_registry

__all__ = ["op_flops"]


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of ``func(*args, **kwargs) -> out``; 0 for ops without a formula."""
    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))

"""The exactness sweep (``tests/runtime/sweep.py``) over MONAI's convolutional U-Nets."""

from __future__ import annotations

import pytest

from .sweep import STRATEGY_NAMES, check, networks


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
@pytest.mark.parametrize("net", networks("UNet", "BasicUNet", "BasicUNetPlusPlus",
                                         "AttentionUnet", "DynUNet", "VNet"),
                         ids=lambda n: n.name)
def test_monai_unets(net, strategy):
    check(net, strategy)

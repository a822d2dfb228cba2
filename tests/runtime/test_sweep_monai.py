"""The exactness sweep (``tests/runtime/sweep.py``) over MONAI's convolutional U-Nets."""

from __future__ import annotations

import pytest

from .sweep import cases, check

FAMILIES = ("UNet", "BasicUNet", "BasicUNetPlusPlus", "AttentionUnet", "DynUNet", "VNet")


@pytest.mark.parametrize(("net", "strategy"), cases(*FAMILIES))
def test_monai_unets(net, strategy):
    check(net, strategy)

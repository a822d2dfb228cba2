"""The exactness sweep (``tests/runtime/sweep.py``) over MONAI's transformer U-Nets (their
graphs are the largest of the sweep: a file of their own, for pytest-xdist's balance)."""

from __future__ import annotations

import pytest

from .sweep import cases, check

FAMILIES = ("UNETR", "SwinUNETR")


@pytest.mark.parametrize(("net", "strategy"), cases(*FAMILIES))
def test_transformer_unets(net, strategy):
    check(net, strategy)

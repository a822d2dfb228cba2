"""A model spec that needs an optional extra names it (issue 21 item 6)."""

from __future__ import annotations

import importlib.util

import pytest

from remat3d.errors import ModelSpecError
from remat3d.zoo import build_model


def test_an_nnunet_spec_without_nnunet_names_the_extra(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "nnunetv2" else real(name, *a))
    for spec in (f"nnunetv2:{tmp_path / 'nnUNetPlans.json'}:3d_fullres",
                 str(tmp_path / "checkpoint_final.pth")):
        with pytest.raises(ModelSpecError, match=r"pip install 'remat3d\[nnunet\]'"):
            build_model(spec)

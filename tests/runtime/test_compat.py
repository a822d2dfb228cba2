"""Each PyTorch internal remat3d uses exists in the installed torch (issue 19 point 6): a
release that drops one fails here instead of turning a guard off silently."""

from __future__ import annotations

from pathlib import Path

import tomllib
import torch
from torch.utils import checkpoint as ckpt

from remat3d.runtime import compat


def test_the_declared_floor_is_the_tested_release():
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (torch_requirement,) = [r for r in project["project"]["dependencies"]
                            if r.split(">")[0].strip() == "torch"]
    floor = tuple(int(part) for part in torch_requirement.split(">=")[1].split(".")[:2])
    assert floor == compat.TESTED_TORCH
    installed = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    assert installed >= compat.TESTED_TORCH


def test_every_gate_finds_what_it_needs():
    assert compat.register_determinism_check("remat3d-test", lambda t: None)
    assert "remat3d-test" in ckpt._allowed_determinism_checks_to_fns
    del ckpt._allowed_determinism_checks_to_fns["remat3d-test"]
    assert compat.selective_cache_internals() is not None
    assert compat.checkpoint_debug_enabled() is None
    with ckpt.set_checkpoint_debug_enabled(True):
        assert compat.checkpoint_debug_enabled() is True
    assert compat.checkpoint_early_stop(True) is True
    with ckpt.set_checkpoint_early_stop(False):
        assert compat.checkpoint_early_stop(True) is False


def test_the_selective_checkpoint_cache_is_read_as_this_torch_stores_it():
    """``RecomputeOverwritten`` reads the per-op storage of the caching mode (a dict per
    op on 2.13, a list on 2.11); on this torch it must find entries, or the guard of NOTE
    [ Exact recomputation ] rule 3 would do nothing."""
    from remat3d.runtime.policies import resolve_policy, selective_contexts

    caching, _ = selective_contexts(resolve_policy("save-compute-heavy"))
    storage = getattr(caching, "storage", None)
    assert isinstance(storage, dict)
    conv = torch.nn.Conv3d(1, 1, 3)
    x = torch.randn(1, 1, 5, 5, 5, requires_grad=True)
    with caching:
        conv(x)
    assert storage and all(isinstance(v, (dict, list)) for v in storage.values())
    entries = compat.selective_cache_entries(caching)
    assert entries is not None and len(list(entries)) >= 1  # the convolution's output

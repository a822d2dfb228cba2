"""The package is lazy and the planner is torch-free, as a fresh interpreter sees it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import remat3d

TORCH_FREE = ["remat3d", "remat3d.errors", "remat3d.units", "remat3d.graph",
              "remat3d.planspec", "remat3d.decisions", "remat3d.halo", "remat3d.planner",
              "remat3d.planner.searching",
              "remat3d.cli"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_without_torch(module: str) -> None:
    code = (f"import sys, {module}\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False,
                            timeout=120)
    assert result.returncode == 0, result.stderr


def test_every_public_name_resolves() -> None:
    for name in remat3d.__all__:
        assert getattr(remat3d, name) is not None, name
    assert set(remat3d.__all__) <= set(dir(remat3d))
    assert remat3d.plan.__module__ == "remat3d.planning"  # the function, not a module
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        remat3d.nothing  # noqa: B018

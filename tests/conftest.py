from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    """Seeded, deterministic algorithms: the bar for exactness everywhere in the suite."""
    torch.manual_seed(0)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config):
    # pytest-xdist runs the suite in several processes (pyproject's addopts): each takes its
    # share of the cores for torch's intra-op threads, or the workers' thread pools fight
    # over the same cores and the run is slower than one process
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // workers))


@pytest.fixture(autouse=True)
def _deterministic():
    """Seeded, deterministic algorithms: the bar for exactness everywhere in the suite."""
    torch.manual_seed(0)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)

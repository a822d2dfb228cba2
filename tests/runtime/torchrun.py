"""Run a test script under torchrun in a fresh process group of gloo processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def torchrun(script: Path, processes: int, out: Path) -> Any:
    """Run ``script out`` under ``torchrun --nproc-per-node=processes`` (one thread each,
    this repository importable) and load what rank 0 saved to ``out``."""
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={processes}", str(script), str(out)],
        env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return torch.load(out, weights_only=True)

"""Plan kinds under DDP and FSDP2, 2 gloo processes, against one process accumulating the
same volumes (``tests/runtime/distributed_plan.py``): the gradients bit for bit. Graph plans
under DDP: ``tests/runtime/test_inductor.py`` and ``tests/train/test_distributed.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


@pytest.mark.parametrize(("mode", "kind"), [
    ("fsdp", "tiled"),  # crashed in backward: a rebuilt input read a freed parameter
    pytest.param("ddp", "tiled", marks=pytest.mark.slow),  # (.ci/run runs -m slow here)
    pytest.param("fsdp", "recompute", marks=pytest.mark.slow),  # and in test_distributed
    pytest.param("ddp", "recompute", marks=pytest.mark.slow),
])
def test_two_processes_equal_one_accumulating_process(tmp_path, mode, kind):
    out = tmp_path / "grads.pt"
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1]), "OMP_NUM_THREADS": "1",
           "PYTHONFAULTHANDLER": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(HERE / "distributed_plan.py"), str(out), mode, kind],
        env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    saved = torch.load(out, weights_only=True)
    single, wrapped = saved["single"], saved["wrapped"]
    assert single.keys() == wrapped.keys()
    for name, grad in single.items():
        assert torch.equal(wrapped[name], grad), name

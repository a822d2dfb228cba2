"""The tracker against CUDA's own allocator statistics (needs a GPU: ``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

from remat3d import zoo
from remat3d.instrument.step import prepare_step, run_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("name", zoo.preset_names())
@pytest.mark.parametrize("amp", [None, "bf16"])
def test_tracker_peak_against_max_memory_allocated(name, amp):
    preset = zoo.get_preset(name)
    shape = zoo.legal_shape(preset, (1, preset.in_channels, 64, 64, 64))
    model = zoo.build_model(name, spatial_size=tuple(shape[2:])).cuda()
    x = torch.randn(shape, device="cuda")
    setup = prepare_step(model, (x,), "cuda", amp, None)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    tracker = run_step(setup)
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated()
    tracker.close()
    # The allocator also holds kernel workspaces (cuDNN, cuBLAS) the tracker cannot see,
    # so the tracker is at most the allocator's peak, and close to it.
    assert tracker.peak_bytes <= allocated
    assert tracker.peak_bytes >= 0.8 * allocated, (tracker.peak_bytes, allocated)

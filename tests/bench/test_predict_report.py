"""``remat3d bench predict``'s sliding-window measurement (NOTE [ Sliding windows on meta ]
in ``bench/predict_report.py``): running the network on two windows gives the peak and
FLOPs that running it on every window gives, on the device and in host memory."""

from __future__ import annotations

import pytest
import torch
from monai.networks.nets import SegResNet

from remat3d.bench.predict_report import _label_changes, plan_flops, sliding_window_run
from remat3d.predicting import plan_prediction


def _network() -> SegResNet:
    torch.manual_seed(0)
    return SegResNet(spatial_dims=3, in_channels=1, out_channels=3, init_filters=4,
                     blocks_down=(1, 1), blocks_up=(1,), norm=("GROUP", {"num_groups": 2}))


@pytest.mark.parametrize("amp", [None, "bf16"])
@pytest.mark.parametrize("output_on_host", [False, True])
def test_two_windows_measure_what_every_window_does(amp: str | None,
                                                    output_on_host: bool) -> None:
    net = _network()
    shape = (1, 1, 48, 40, 32)
    fast = sliding_window_run(net, shape, 24, 0.5, amp=amp, output_on_host=output_on_host)
    full = sliding_window_run(net, shape, 24, 0.5, amp=amp, output_on_host=output_on_host,
                              every_window=True)
    assert fast.windows == full.windows == 3 * 3 * 2
    assert (fast.peak_bytes, fast.host_peak_bytes, fast.flops) == \
        (full.peak_bytes, full.host_peak_bytes, full.flops)
    output_and_count = (3 + 1) * 48 * 40 * 32 * 4  # fp32 logits and count map
    if output_on_host:
        assert full.host_peak_bytes >= output_and_count
    else:
        assert full.host_peak_bytes == 0 and full.peak_bytes > output_and_count


def test_the_tiled_plans_flops_include_its_halo() -> None:
    net = _network().eval()
    shape = (1, 1, 32, 32, 32)
    untiled = plan_prediction(net, shape, device="meta")
    tiled = plan_prediction(net, shape, budget="0.5x", device="meta")
    assert plan_flops(tiled, net) > plan_flops(untiled, net) > 0


def test_label_changes_count_near_ties() -> None:
    reference = torch.tensor([[[1.0, 0.0, 0.50]], [[0.0, 1.0, 0.49]]])[None]  # (1, 2, 1, 3)
    logits = reference.clone()
    logits[0, 1, 0, 2] = 0.51  # flips the third voxel, a near-tie
    changed, ties, largest = _label_changes(logits, reference)
    assert (changed, ties) == (1, 1) and largest == pytest.approx(0.02)

"""The exactness sweep (``tests/runtime/sweep.py``) over MONAI's other 3D networks and
nnU-Net v2's PlainConvUNet and ResidualEncoderUNet."""

from __future__ import annotations

import pytest

from .sweep import cases, check

FAMILIES = ("SegResNet", "SegResNetVAE", "SegResNetDS", "HighResNet", "MedNeXt",
            "FlexibleUNet", "DenseNet", "ResNet", "PlainConvUNet", "ResidualEncoderUNet")


@pytest.mark.parametrize(("net", "strategy"), cases(*FAMILIES))
def test_networks(net, strategy):
    check(net, strategy)


def test_the_sweep_files_cover_every_network_once():
    from . import test_sweep_monai, test_sweep_transformers
    from .sweep import NETWORKS, networks

    swept = [n.name for families in (test_sweep_monai.FAMILIES,
                                     test_sweep_transformers.FAMILIES, FAMILIES)
             for n in networks(*families)]
    assert sorted(swept) == sorted(n.name for n in NETWORKS)


def test_a_tiled_plan_is_judged_against_float64():
    """At the sweep's sizes every strategy reaches its budget untiled; the judgement of
    tiled plans (two steps, within twice the unplanned fp32 step's error against
    float64, every buffer included) is checked on a plan that tiles: DynUNet with
    BatchNorm at 32³, module plans only, no dropout (docs/tiling.md: a stage with
    dropout is not tiled). tests/tiling/test_norms.py covers every norm."""
    import copy

    import torch

    import remat3d

    from .sweep import Net, _monai, _within_float64

    net = Net("DynUNet-batch", _monai("DynUNet", spatial_dims=3, in_channels=1, out_channels=2,
                                      kernel_size=(3, 3, 3), strides=(1, 2, 2),
                                      upsample_kernel_size=(2, 2), filters=(4, 8, 16),
                                      norm_name="batch"), (1, 1, 32, 32, 32))
    torch.manual_seed(0)
    model = net.build()
    plan = remat3d.plan(model, net.shape, budget="0.5x", graph=False)
    assert plan.tiled, plan.summary()
    planned = remat3d.apply(copy.deepcopy(model), plan)
    _within_float64(model, planned, torch.randn(net.shape))

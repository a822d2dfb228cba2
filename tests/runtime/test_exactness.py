"""Every plan family keeps outputs, gradients and buffers bit-identical on CPU in fp32."""

from __future__ import annotations

import pytest
import torch

from remat3d import zoo

from .exactness import assert_exact, plans_for
from .torture import Torture

PLAN_FAMILIES = ["every-node", "every-block", "nested", "save-compute-heavy",
                 "save-norm-and-pool", "offload"]


@pytest.mark.parametrize("family", PLAN_FAMILIES)
def test_torture_model(family):
    model = Torture()
    x = torch.randn(2, 1, 12, 12, 12)
    plan = plans_for(model, x)[family]
    report = assert_exact(model, x, plan)
    assert all(r.forward_runs >= 1 for r in report.regions), str(report)
    if family == "every-node":
        runs = {r.label: r for r in report.regions}
        assert runs["shared"].forward_runs == 2  # a module called twice: both calls planned
    if family != "offload":
        assert all(r.recomputes >= 1 for r in report.regions), str(report)


@pytest.mark.parametrize("family", PLAN_FAMILIES)
def test_torture_model_under_bf16_autocast(family):
    model = Torture()
    x = torch.randn(2, 1, 12, 12, 12)
    assert_exact(model, x, plans_for(model, x)[family], amp="bf16")


FAST = ["unet", "basicunet", "segresnet", "resnet3d"]


def _preset_case(name):
    preset = zoo.get_preset(name)
    shape = zoo.legal_shape(preset, (1, preset.in_channels, 16, 16, 16))
    torch.manual_seed(0)
    model = zoo.build_model(name, spatial_size=tuple(shape[2:]))
    if preset.task == "classification" or name in ("unet", "resnet3d"):
        shape = (2, *shape[1:])  # BatchNorm needs more than one value per channel
    return model, torch.randn(shape)


# -m slow (about 50 s): the exactness sweep (tests/runtime/sweep.py) plans these networks'
# kinds under every strategy by default; the torture model above takes every family
@pytest.mark.slow
@pytest.mark.parametrize("family", PLAN_FAMILIES)
@pytest.mark.parametrize("name", FAST)
def test_zoo_presets(name, family):
    model, x = _preset_case(name)
    assert_exact(model, x, plans_for(model, x)[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", PLAN_FAMILIES)
@pytest.mark.parametrize("name", ["nnunet", "swinunetr", "unetr"])
def test_zoo_presets_large(name, family):
    model, x = _preset_case(name)
    assert_exact(model, x, plans_for(model, x)[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", PLAN_FAMILIES)
@pytest.mark.parametrize("name", ["nnunetv2", "resenc-l"])
def test_nnunet_v2_networks(name, family):
    """Their decoders concatenate in their own forward: the blocks are spans
    (runtime/spans.py), bitwise like modules."""
    model, x = _preset_case(name)
    plan = plans_for(model, x)[family]
    assert plan.spans and (family == "every-node"
                           or any("@" in r.module for r in plan.regions))
    assert_exact(model, x, plan)


# -m slow (11 s and 5 s): by default the sweep takes UNETR and nnU-Net's U-Nets under
# every strategy (tests/runtime/sweep.py)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["nnunet", "unetr"])
def test_large_presets_every_block(name):
    model, x = _preset_case(name)
    assert_exact(model, x, plans_for(model, x)["every-block"])


@pytest.mark.parametrize("strategy", ["blocks", "uniform", "sqrt", "balanced", "recursive",
                                      "selective", "optimal"])
def test_attention_unet_updates_batchnorm_statistics_once(strategy):
    """The attention gates' BatchNorms run inside spans of AttentionLayer's forward (its
    ``torch.cat`` between ``attention`` and ``merge``); a span region has no children of
    its own, so its recomputation restored none of their buffers: running statistics
    were updated twice under six strategies (guards.py NOTE rule 1)."""
    import copy

    from monai.networks.nets import AttentionUnet

    import remat3d

    torch.manual_seed(0)  # (deterministic algorithms: tests/conftest.py)
    model = AttentionUnet(spatial_dims=3, in_channels=1, out_channels=2,
                          channels=(8, 16, 32), strides=(2, 2)).train()
    x = torch.randn(1, 1, 32, 32, 32)
    plan = remat3d.plan(model, x, strategy=strategy, budget="1.0x")
    planned = remat3d.apply(copy.deepcopy(model), plan)
    for net in (model, planned):
        net(x).float().square().mean().backward()
    buffers = dict(planned.named_buffers())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers()), [
        n for n, b in model.named_buffers() if not torch.equal(b, buffers[n])]
    assert buffers["model.1.attention.W_g.1.num_batches_tracked"] == 1

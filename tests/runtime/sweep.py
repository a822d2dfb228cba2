"""The exactness sweep: every strategy on every 3D network MONAI ships and on nnU-Net v2's
two U-Nets, with BatchNorm, InstanceNorm and GroupNorm variants and dropout where the
network takes them.

Each case plans the network with ``remat3d.plan`` under one strategy, applies the plan to a
copy, and runs two training steps (loss, backward, an SGD update: the second step reads
the weights and running statistics the first wrote) on the planned copy and on the
unplanned model, in ``train()`` mode on CPU in fp32 with deterministic algorithms. Outputs,
every gradient and every buffer must be bitwise equal after each step. A plan that tiles
is judged against float64 instead, like ``tests/tiling/test_norms.py``: its error is at
most twice the unplanned fp32 step's.

The budget is a fraction of the unplanned step's peak that makes every strategy checkpoint
(``optimal`` then plans the graph, or modules where no graph plan fits; the
fixed strategies do what they do under it); where a strategy cannot reach it, the plan is
made at the smallest budget it can reach. The norm variants are spread over the networks:
BatchNorm on most, InstanceNorm on DynUNet and PlainConvUNet, GroupNorm on UNet, SegResNetVAE
and MedNeXt.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import remat3d
from remat3d.errors import InfeasibleBudgetError
from remat3d.planner.registry import STRATEGIES

# every strategy of the registry (``auto`` is ``optimal`` at a budget it resolves, one code
# path: ``tests/test_graph_plan.py`` checks that it plans what ``optimal`` does)
STRATEGY_NAMES = sorted(STRATEGIES)
LR = 0.1


@dataclass(frozen=True)
class Net:
    """One network of the sweep: how to build it and the input it takes."""

    name: str
    build: Callable[[], nn.Module]
    shape: tuple[int, ...] = (2, 1, 16, 16, 16)  # batch 2: BatchNorm at a 1³ bottleneck
    budget: str = "0.9x"  # every strategy's but none's (the module docstring)


def networks(*families: str) -> list[Net]:
    """The networks of :data:`NETWORKS` whose name starts with one of ``families``."""
    return [n for n in NETWORKS if n.name.split("-")[0] in families]


# ``optimal`` on the networks whose graph search takes 10-35 s here (the transformers'
# graphs have 1.9k-2.7k ops): -m slow, which .ci/run runs after the default suite
SLOW = {("UNETR", "optimal"), ("SwinUNETR", "optimal"), ("VNet", "optimal"),
        ("FlexibleUNet", "optimal")}


def cases(*families: str) -> list[Any]:
    """(network, strategy) for every strategy on the networks of ``families``, as pytest
    parameters; the :data:`SLOW` ones marked ``slow``."""
    return [pytest.param(net, strategy, id=f"{net.name}-{strategy}",
                         marks=[pytest.mark.slow] if (net.name, strategy) in SLOW else [])
            for net in networks(*families) for strategy in STRATEGY_NAMES]


def _monai(cls: str, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from monai.networks import nets

        return getattr(nets, cls)(**kwargs)

    return build


def _nnunet(cls: str, norm: type[nn.Module], **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from dynamic_network_architectures.architectures import unet

        return getattr(unet, cls)(
            input_channels=1, n_stages=3, features_per_stage=(4, 8, 16), conv_op=nn.Conv3d,
            kernel_sizes=3, strides=(1, 2, 2), num_classes=2, conv_bias=True, norm_op=norm,
            norm_op_kwargs={"eps": 1e-5, "affine": True}, dropout_op=nn.Dropout3d,
            dropout_op_kwargs={"p": 0.1}, nonlin=nn.LeakyReLU,
            nonlin_kwargs={"inplace": True}, **kwargs)

    return build


GROUP = ("group", {"num_groups": 2})
NETWORKS = [
    *(Net(f"UNet-{n}", _monai("UNet", spatial_dims=3, in_channels=1, out_channels=2,
                                channels=(4, 8, 16), strides=(2, 2), num_res_units=1,
                                norm=norm, dropout=0.1))
      for n, norm in (("batch", "batch"), ("group", GROUP))),
    *(Net(f"BasicUNet-{n}", _monai("BasicUNet", spatial_dims=3, in_channels=1,
                                     out_channels=2, features=(4, 4, 8, 8, 16, 4),
                                     norm=norm, dropout=0.1), shape)
      for n, norm, shape in (("batch", "batch", (2, 1, 16, 16, 16)),)),
    Net("BasicUNetPlusPlus", _monai("BasicUNetPlusPlus", spatial_dims=3, in_channels=1,
                                    out_channels=2, features=(4, 4, 8, 8, 16, 4),
                                    norm="batch", dropout=0.1)),
    Net("AttentionUnet", _monai("AttentionUnet", spatial_dims=3, in_channels=1,
                                out_channels=2, channels=(4, 8, 16), strides=(2, 2),
                                dropout=0.1)),
    Net("VNet", _monai("VNet", spatial_dims=3, in_channels=1, out_channels=2,
                       dropout_prob_down=0.1, dropout_prob_up=(0.1, 0.1))),
    *(Net(f"SegResNet-{n}", _monai("SegResNet", spatial_dims=3, init_filters=4,
                                     in_channels=1, out_channels=2, blocks_down=(1, 2),
                                     blocks_up=(1,), norm=norm, dropout_prob=0.1))
      for n, norm in (("batch", "batch"),)),
    Net("SegResNetVAE", _monai("SegResNetVAE", input_image_size=(16, 16, 16),
                               spatial_dims=3, init_filters=4, in_channels=1,
                               out_channels=2, blocks_down=(1, 2), blocks_up=(1,),
                               norm=GROUP)),
    Net("SegResNetDS", _monai("SegResNetDS", spatial_dims=3, init_filters=4, in_channels=1,
                              out_channels=2, blocks_down=(1, 2, 2), norm="batch")),
    *(Net(f"DynUNet-{n}", _monai("DynUNet", spatial_dims=3, in_channels=1, out_channels=2,
                                   kernel_size=(3, 3, 3), strides=(1, 2, 2),
                                   upsample_kernel_size=(2, 2), filters=(4, 8, 16),
                                   norm_name=norm, dropout=0.1, res_block=res))
      for n, norm, res in (("instance", "instance", False), ("batch-res", "batch", True))),
    Net("UNETR", _monai("UNETR", in_channels=1, out_channels=2, img_size=16, feature_size=4,
                        hidden_size=24, mlp_dim=48, num_heads=2, norm_name="batch",
                        dropout_rate=0.1, spatial_dims=3)),
    Net("SwinUNETR", _monai("SwinUNETR", in_channels=1, out_channels=2, feature_size=12,
                            depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), drop_rate=0.1,
                            norm_name="batch", spatial_dims=3), (2, 1, 32, 32, 32),
        "0.97x"),  # its graph's recompute floor lies near its unplanned peak
    Net("HighResNet", _monai("HighResNet", spatial_dims=3, in_channels=1, out_channels=2,
                             layer_params=({"name": "conv_0", "n_features": 4,
                                            "kernel_size": 3},
                                           {"name": "res_1", "n_features": 4,
                                            "kernels": (3, 3), "repeat": 1},
                                           {"name": "res_2", "n_features": 8,
                                            "kernels": (3, 3), "repeat": 1},
                                           {"name": "conv_1", "n_features": 8,
                                            "kernel_size": 1},
                                           {"name": "conv_2", "kernel_size": 1}),
                             dropout_prob=0.1)),
    Net("MedNeXt", _monai("MedNeXt", spatial_dims=3, init_filters=4, in_channels=1,
                          out_channels=2, encoder_expansion_ratio=2,
                          decoder_expansion_ratio=2, bottleneck_expansion_ratio=2,
                          blocks_down=(1, 1), blocks_bottleneck=1, blocks_up=(1, 1))),
    Net("DenseNet", _monai("DenseNet", spatial_dims=3, in_channels=1, out_channels=2,
                           init_features=4, growth_rate=4, block_config=(2, 2), bn_size=2,
                           dropout_prob=0.1)),
    Net("FlexibleUNet", _monai("FlexibleUNet", in_channels=1, out_channels=2,
                               backbone="resnet10", pretrained=False, spatial_dims=3,
                               decoder_channels=(16, 8, 8, 4, 4), dropout=0.1),
        (2, 1, 32, 32, 32)),
    Net("ResNet", _monai("ResNet", block="basic", layers=(1, 1, 1, 1),
                         block_inplanes=(4, 8, 16, 32), spatial_dims=3, n_input_channels=1,
                         num_classes=2)),
    *(Net(f"PlainConvUNet-{n}", _nnunet("PlainConvUNet", norm, n_conv_per_stage=2,
                                          n_conv_per_stage_decoder=1, deep_supervision=ds))
      for n, norm, ds in (("instance", nn.InstanceNorm3d, False),
                          ("batch-ds", nn.BatchNorm3d, True))),
    *(Net(f"ResidualEncoderUNet-{n}", _nnunet("ResidualEncoderUNet", norm,
                                                n_blocks_per_stage=(1, 2, 2),
                                                n_conv_per_stage_decoder=1,
                                                deep_supervision=False))
      for n, norm in (("batch", nn.BatchNorm3d),)),
]


# (network, strategy) -> the smallest budget it reached where its budget was infeasible
_REACHED: dict[tuple[str, str], int] = {}


def make_plan(net: Net, model: nn.Module, strategy: str) -> remat3d.Plan:
    """``strategy``'s plan at ``net.budget`` (``none``: at the unplanned peak), or at the
    smallest budget it reaches where it cannot reach that one."""
    key = (net.name, strategy)
    budget: str | int = "1.0x" if strategy == "none" else _REACHED.get(key, net.budget)
    try:
        return remat3d.plan(model, net.shape, budget=budget, strategy=strategy)
    except InfeasibleBudgetError as exc:
        _REACHED[key] = exc.smallest_feasible_bytes
        return remat3d.plan(model, net.shape, budget=exc.smallest_feasible_bytes,
                            strategy=strategy)


def step(model: nn.Module, x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """One training step, the update included; returns the outputs, every gradient and
    every buffer after it (detached copies, in a fixed order)."""
    torch.manual_seed(seed)  # the same dropout masks and VAE noise in both runs
    model.train()
    for p in model.parameters():
        p.grad = None
    out = [t for t in tree_leaves(model(x)) if isinstance(t, torch.Tensor)]
    sum((t.float() ** 2).mean() for t in out if t.is_floating_point()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    return [t.detach().clone() for t in (*out, *grads, *model.buffers())]


def check(net: Net, strategy: str) -> remat3d.Plan:
    """Plan ``net`` with ``strategy`` and compare two planned steps with two unplanned
    ones (the module docstring); returns the plan."""
    torch.manual_seed(0)
    model = net.build()
    x = torch.randn(net.shape)
    plan = make_plan(net, model, strategy)
    planned = remat3d.apply(copy.deepcopy(model), plan)
    try:
        if plan.tiled:
            _within_float64(model, planned, x)
        else:
            for seed in (1, 2):
                want, got = step(model, x, seed), step(planned, x, seed)
                assert len(want) == len(got)
                for i, (a, b) in enumerate(zip(want, got)):
                    assert torch.equal(a, b), (
                        f"{net.name} under {strategy} ({plan.summary()}): value {i} of "
                        f"step {seed} (outputs, gradients, buffers) differs")
    finally:
        remat3d.remove(planned)
    return plan


def _within_float64(model: nn.Module, planned: nn.Module, x: torch.Tensor) -> None:
    exact = copy.deepcopy(model).double()
    for seed in (1, 2):
        reference = step(exact, x.double(), seed)
        plain, tiled = step(model, x, seed), step(planned, x, seed)
        for i, (r, a, b) in enumerate(zip(reference, plain, tiled)):
            if not r.is_floating_point():
                assert torch.equal(r, b.to(r.dtype)), f"value {i} of step {seed}"
                continue
            scale = max(r.abs().max().item(), 1e-30)
            plain_error = (a.double() - r).abs().max().item() / scale
            tiled_error = (b.double() - r).abs().max().item() / scale
            assert tiled_error <= 2 * plain_error + 1e-6, (i, seed, tiled_error, plain_error)

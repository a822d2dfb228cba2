"""Tiled runs are exact for every normalisation a user can build, alone and in networks.

Every configuration of InstanceNorm, GroupNorm and BatchNorm that ``nn`` and MONAI's
``norm_name`` offer — affine or not, running statistics tracked or not, train and eval,
non-default ``eps`` and ``momentum`` (``momentum=None``: BatchNorm's cumulative average) —
followed by an in-place activation, an ordinary one, or nothing. Tiled runs, hand-written
plans and the plans ``remat3d.plan`` chooses by itself are compared in float64 with the
same step untiled: output, input gradient, every parameter gradient and every buffer.

Regression: an affine-free normalisation followed by an in-place activation (MONAI's
default ``InstanceNorm3d(affine=False)`` + ``LeakyReLU(inplace=True)``) gave gradients
386 % off (NOTE [ Exact tiles ] rule 5).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import remat3d
from remat3d.planspec import Plan, Region
from remat3d.runtime.tiling import tile
from tests.tiling.test_fused import _step, assert_same_step

TOL64 = 1e-10

NORMS: dict[str, Callable[[int], nn.Module]] = {
    "instance": lambda c: nn.InstanceNorm3d(c),  # MONAI's "instance": affine=False
    "instance-affine": lambda c: nn.InstanceNorm3d(c, affine=True),
    "instance-running": lambda c: nn.InstanceNorm3d(c, track_running_stats=True),
    "instance-affine-running-eps-momentum": lambda c: nn.InstanceNorm3d(
        c, affine=True, track_running_stats=True, eps=1e-2, momentum=0.3),
    "group": lambda c: nn.GroupNorm(2, c, affine=False),
    "group-affine-eps": lambda c: nn.GroupNorm(2, c, eps=1e-2),
    "group-one": lambda c: nn.GroupNorm(1, c, affine=False),  # layer-norm-like
    "group-per-channel": lambda c: nn.GroupNorm(c, c),  # instance-norm-like
    "batch": lambda c: nn.BatchNorm3d(c),
    "batch-no-affine": lambda c: nn.BatchNorm3d(c, affine=False),
    "batch-eps-momentum": lambda c: nn.BatchNorm3d(c, eps=1e-2, momentum=0.3),
    "batch-cumulative": lambda c: nn.BatchNorm3d(c, momentum=None),
    "batch-no-running": lambda c: nn.BatchNorm3d(c, track_running_stats=False),
}
EVAL = {"batch", "batch-no-affine", "instance-running"}  # running statistics in eval mode

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "leakyrelu-inplace": lambda: nn.LeakyReLU(0.01, inplace=True),  # nnU-Net's
    "relu-inplace": lambda: nn.ReLU(inplace=True),
    "prelu": lambda: nn.PReLU(),  # MONAI UNet's
    "none": lambda: nn.Identity(),
}


def _block(norm: str, act: str) -> nn.Sequential:
    """conv → norm → act → conv → norm → act → 1x1 conv: two normalisations in a run, so
    the second's backward sums flow into the first's."""
    make, activation = NORMS[norm], ACTIVATIONS[act]
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), make(4), activation(),
                         nn.Conv3d(4, 4, 3, stride=(1, 2, 1), padding=1), make(4), activation(),
                         nn.Conv3d(4, 3, 1))


def _tiled_step(block: nn.Module, x: torch.Tensor, tile_size: object,
                stash: str | None = None, stash_norms: list[int] | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step, untiled (``tile_size`` None) or tiled (with ``stash``: test_stash.py)."""
    xi = x.clone().requires_grad_(True)
    out = block(xi) if tile_size is None else tile(block, xi, tile=tile_size, stash=stash,
                                                   stash_norms=stash_norms)
    seed = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * seed).sum().backward()
    values = {n: p.grad.clone() for n, p in block.named_parameters()}
    values["input"] = xi.grad
    values.update({n: b.clone().to(out.dtype) for n, b in block.named_buffers()})
    return out.detach(), values


def _warm_running_statistics(net: nn.Module, x: torch.Tensor) -> None:
    """Running statistics far from their initial values, for eval-mode checks."""
    with torch.no_grad():
        for k in range(3):
            net(x * (1 + k) + k)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("norm", NORMS)
def test_tiled_run_is_exact_for_every_normalisation(norm: str, act: str) -> None:
    torch.manual_seed(0)
    block = _block(norm, act).double()
    x = torch.randn(2, 2, 10, 12, 7, dtype=torch.float64)  # batch 2: batch != instance stats
    reference = _tiled_step(copy.deepcopy(block), x, None)
    for tile_size in ((10, 6, 7), (4, 3, 5)):  # one tile (the whole volume), and many
        got = _tiled_step(copy.deepcopy(block), x, tile_size)
        assert_same_step(reference, got, TOL64)
        for name, value in reference[1].items():  # buffers too: running stats, counters
            assert torch.allclose(got[1][name], value, rtol=TOL64, atol=TOL64), (name, tile_size)


@pytest.mark.parametrize("act", ["leakyrelu-inplace", "none"])
@pytest.mark.parametrize("norm", sorted(EVAL))
def test_tiled_run_is_exact_in_eval_mode(norm: str, act: str) -> None:
    torch.manual_seed(0)
    block = _block(norm, act).double()
    x = torch.randn(2, 2, 10, 12, 7, dtype=torch.float64)
    _warm_running_statistics(block, x)
    block.eval()
    reference = _tiled_step(copy.deepcopy(block), x, None)
    assert_same_step(reference, _tiled_step(copy.deepcopy(block), x, (4, 3, 5)), TOL64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_affine_free_instance_norm_before_an_inplace_activation_fp32_and_float64(
        dtype: torch.dtype) -> None:
    """The reported case, small: fp32 tiled within fp32 noise of fp32 untiled."""
    torch.manual_seed(0)
    block = _block("instance", "leakyrelu-inplace").to(dtype)
    x = torch.randn(1, 2, 12, 12, 12, dtype=dtype)
    reference = _tiled_step(copy.deepcopy(block), x, None)
    assert_same_step(reference, _tiled_step(copy.deepcopy(block), x, 12),
                     TOL64 if dtype == torch.float64 else 1e-5)


# -- whole networks: MONAI's own norm_name spellings ----------------------------------

NORM_NAMES: dict[str, object] = {
    "instance": "instance",  # MONAI's default: InstanceNorm3d(affine=False)
    "instance-affine": ("instance", {"affine": True}),
    "instance-running": ("instance", {"track_running_stats": True}),
    "group": ("group", {"num_groups": 2, "affine": False}),
    "group-affine": ("group", {"num_groups": 2}),
    "batch": "batch",
    "batch-eps-momentum": ("batch", {"eps": 1e-3, "momentum": 0.3}),
}


def _dynunet(norm_name: object, dtype: torch.dtype = torch.float64) -> nn.Module:
    from monai.networks.nets import DynUNet

    torch.manual_seed(0)
    return DynUNet(3, 1, 2, kernel_size=[3, 3, 3], strides=[1, 2, 2],
                   upsample_kernel_size=[2, 2], filters=[4, 8, 16], norm_name=norm_name,
                   res_block=False).to(dtype)


@pytest.mark.parametrize("norm", NORM_NAMES)
def test_tiled_plan_of_a_whole_network_is_exact(norm: str) -> None:
    """DynUNet (nnU-Net's blocks: conv → norm → LeakyReLU(inplace)) with its full-
    resolution encoder and decoder stages tiled and fused, against the untiled step."""
    net = _dynunet(NORM_NAMES[norm])
    x = torch.randn(2, 1, 16, 16, 12, dtype=torch.float64)
    for size in ([16, 16, 12], [6, 7, 5]):
        plan = Plan(regions=[Region("input_block", decision="tile", tile=size, fuse=True),
                             Region("upsamples.1", decision="tile", tile=size)])
        tiled = remat3d.apply(copy.deepcopy(net), plan)
        assert_same_step(_step(copy.deepcopy(net), x), _step(tiled, x), TOL64)


@pytest.mark.parametrize(("norm", "offload"), [("instance", False), ("group", False),
                                               ("batch", False), ("instance", True),
                                               ("batch", True)])
def test_plans_the_planner_chooses_are_exact(norm: str, offload: bool) -> None:
    """Below what recomputation alone reaches, ``optimal`` tiles by itself (the reported
    case: 0.45x on MONAI's default DynUNet, fused; with offload, its runs stash in host
    memory, NOTE [ Stashed passes ]); the plan it returns is exact in float64 on the real
    model."""
    net = _dynunet(NORM_NAMES[norm], torch.float32)
    shape = (1, 1, 32, 32, 32)
    plan = remat3d.plan(net, shape, budget="0.3x" if offload else "0.5x", graph=False,
                        offload=offload)  # (a graph plan fits too)
    assert plan.tiled, plan.summary()
    assert all(r.stash in (("host",) if offload else (None, "device")) or r.fuse
               for r in plan.regions if r.decision == "tile"), plan.summary()
    net = net.double()
    x = torch.randn(shape, dtype=torch.float64)
    tiled = remat3d.apply(copy.deepcopy(net), plan)
    assert_same_step(_step(copy.deepcopy(net), x), _step(tiled, x), TOL64)

"""Graph plans with tiled regions (runtime/tiled_graph.py): each tiled value equals the
untiled one up to rounding, so a tiled step's gradients are those of the untiled graph
plan in float64 and no further from float64 in float32 than the unplanned step's."""

from __future__ import annotations

import copy

import pytest
import torch

from remat3d.capture.joint import capture
from remat3d.planner.liveness import closed_recompute
from remat3d.planspec import GraphTiling
from remat3d.runtime.graph_run import apply_graph_plan


def _nnunetv2():
    pytest.importorskip("dynamic_network_architectures")
    from remat3d.zoo.presets import get_preset

    return get_preset("nnunetv2").factory(strides=[1, 2, 2], features_per_stage=[4, 8, 16])


def _resenc():
    # residual blocks: a copied chain passes through a residual add another region's copy
    # rewired (tiled_graph._copy_across copies one region's chains a round)
    pytest.importorskip("dynamic_network_architectures")
    from remat3d.zoo.presets import get_preset

    return get_preset("resenc-l").factory(strides=[1, 2, 2], features_per_stage=[4, 8, 16])


def _segresnet():
    from monai.networks.nets import SegResNet

    return SegResNet(init_filters=4, blocks_down=(1, 2), blocks_up=(1,),
                     norm=("GROUP", {"num_groups": 2}))


def _unet():
    from monai.networks.nets import UNet

    return UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1,
                norm="instance")


NETS = {"nnunetv2-instancenorm": (_nnunetv2, 32), "segresnet-groupnorm": (_segresnet, 16),
        "unet-instancenorm": (_unet, 16), "resenc-residual": (_resenc, 32)}


def _grads(model, x, dtype, tile=None, recompute=(), copied=True):
    model = copy.deepcopy(model).to(dtype) if copied else model
    if tile is not None:
        apply_graph_plan(model, recompute, tiling=tile)
    out = model(x.to(dtype))
    torch.manual_seed(1)
    weight = torch.randn(out.shape, dtype=torch.float64)
    (out * weight.to(dtype)).sum().backward()
    return out.double(), [torch.zeros_like(p, dtype=torch.float64) if p.grad is None
                          else p.grad.double() for p in model.parameters()]


# stashing everything on two grids is the third layout; -m slow (the default run keeps
# one grid, and two grids with copies and stashes of sums)
@pytest.mark.parametrize("levels,stash,copy", [
    (1, "none", False), pytest.param(2, "all", False, marks=pytest.mark.slow),
    (2, "sums", True)])
@pytest.mark.parametrize("net", NETS)
def test_tiled_step_is_the_untiled_step_up_to_rounding(net, levels, stash, copy):
    factory, size = NETS[net]
    torch.manual_seed(0)
    model = factory()
    x = torch.randn(1, 1, size, size, size)
    graph = capture(model, tuple(x.shape)).graph
    # every forward op recomputed: the backward's full-resolution work all tiled
    recompute = sorted(closed_recompute(graph, [n.name for n in graph.nodes
                                                if n.phase == "forward"]))
    tile = GraphTiling((size // 4, size // 2, size // 4), levels, stash, copy)
    out64, ref64 = _grads(model, x, torch.float64)
    out_t64, tiled64 = _grads(model, x, torch.float64, tile, recompute)
    assert torch.allclose(out_t64, out64, rtol=1e-10, atol=1e-12)
    scale = max(g.abs().max().item() for g in ref64)
    for a, b in zip(ref64, tiled64):
        assert (a - b).abs().max().item() <= 1e-10 * scale
    # float32: no further from float64 than the unplanned float32 step (NOTE rule 3):
    # the whole gradient, and each parameter's up to rounding noise (a few float32 ulps
    # of its own gradient, or 1e-7 of the step's: a bias before a normalisation has a
    # gradient of zero, and any two float32 steps differ there by noise alone)
    _, ref32 = _grads(model, x, torch.float32)
    _, tiled32 = _grads(model, x, torch.float32, tile, recompute)

    def error(grads):
        return torch.cat([(a - b).flatten() for a, b in zip(ref64, grads)]).norm().item()

    assert error(tiled32) <= 2 * error(ref32)
    total = torch.cat([a.flatten() for a in ref64]).norm().item()
    for a, b, c in zip(ref64, ref32, tiled32):
        floor = 1e-6 * a.norm().item() + 1e-7 * total
        assert (a - c).norm().item() <= 2 * max((a - b).norm().item(), floor)


def test_plan_tiles_the_graph_below_what_recomputation_reaches(tmp_path):
    """``remat3d.plan(graph=True)`` below every recompute set's peak: a tiled graph plan,
    verified under the budget, saved and loaded, applied to a real model."""
    import remat3d
    from remat3d.errors import InfeasibleBudgetError

    torch.manual_seed(0)
    model = _nnunetv2()
    x = torch.randn(1, 1, 32, 32, 32)
    with pytest.raises(InfeasibleBudgetError) as untiled:
        remat3d.plan(model, x, budget=1, graph=True, tile=False)
    with pytest.raises(InfeasibleBudgetError) as tiled:
        remat3d.plan(model, x, budget=1, graph=True)
    lowest = tiled.value.smallest_feasible_bytes
    assert 0 < lowest < untiled.value.smallest_feasible_bytes
    budget = (lowest + untiled.value.smallest_feasible_bytes) // 2
    plan = remat3d.plan(model, x, budget=budget, graph=True)
    assert plan.graph_tiling is not None and plan.verified_peak_bytes <= budget
    assert "tiled: the" in plan.summary()
    plan.save(tmp_path / "plan.json")
    loaded = remat3d.Plan.load(tmp_path / "plan.json")
    assert loaded == plan
    planned = remat3d.apply(copy.deepcopy(model), loaded)
    out_plain, grads_plain = _grads(model, x, torch.float32)
    out, grads = _grads(planned, x, torch.float32, copied=False)
    assert torch.allclose(out, out_plain, rtol=1e-4, atol=1e-5)
    total = torch.cat([a.flatten() for a in grads_plain]).norm()
    for a, b in zip(grads_plain, grads):  # float32 rounding, as the first test bounds it
        assert (a - b).norm() <= 1e-4 * a.norm() + 1e-6 * total


@pytest.mark.slow
def test_ddp_trains_with_a_tiled_graph_plan(tmp_path):
    """Two gloo processes under DDP, each stepping a tiled graph plan on its own volume,
    average to one process's gradients over both volumes, bit for bit: the tiled
    backward feeds DDP's gradient hooks like any graph plan's."""
    from pathlib import Path

    from tests.runtime.torchrun import torchrun

    pytest.importorskip("dynamic_network_architectures")
    script = Path(__file__).parent / "ddp_tiled_graph_plan.py"
    saved = {n: torchrun(script, n, tmp_path / f"{n}.pt")["grads"] for n in (1, 2)}
    assert saved[1].keys() == saved[2].keys()
    for name, grad in saved[1].items():
        assert torch.equal(saved[2][name], grad), name

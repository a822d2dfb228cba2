"""Budget sweeps at 128³ on meta (slow): the budget is a promise at every point."""

from __future__ import annotations

import pytest

import remat3d
from remat3d import zoo
from remat3d.errors import BudgetError, InfeasibleBudgetError

SHAPE = (1, 1, 128, 128, 128)


def sweep(name: str, points: int = 20):
    model = zoo.build_model(name, spatial_size=SHAPE[2:], device="meta")
    unplanned = remat3d.profile(model, SHAPE)
    with pytest.raises(InfeasibleBudgetError) as info:  # checkpointing alone: no tiling
        remat3d.plan(model, SHAPE, budget=1, tile=False)
    smallest = info.value.smallest_feasible_bytes
    rows = []
    for k in range(points):
        budget = smallest + (unplanned.peak_bytes - smallest) * k // (points - 1)
        p = remat3d.plan(model, SHAPE, budget=budget, tile=False)
        rows.append((budget, p.verified_peak_bytes, p.recompute_flops / unplanned.flops))
    blocks = remat3d.plan(model, SHAPE, budget=unplanned.peak_bytes, strategy="blocks")
    return rows, blocks, unplanned


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nnunet", "basicunet", "segresnet", "swinunetr"])
def test_sweep_keeps_every_budget(name):
    rows, blocks, unplanned = sweep(name)
    print(f"\n{name}: unplanned {unplanned.peak_bytes} blocks peak "
          f"{blocks.verified_peak_bytes} (+{100 * blocks.recompute_flops / unplanned.flops:.1f}%)")
    for budget, peak, overhead in rows:
        print(f"  budget {budget:>14,} peak {peak:>14,} recompute +{100 * overhead:6.3f}%")
    violations = [(b, p) for b, p, _ in rows if p > b]
    assert not violations
    overheads = [o for _, _, o in rows]
    assert overheads == sorted(overheads, reverse=True)  # more memory: never more recompute
    peaks = [p for _, p, _ in rows]
    assert peaks == sorted(peaks)  # and the verified peak never falls as the budget grows


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nnunet", "basicunet", "segresnet", "swinunetr"])
def test_optimal_never_costs_more_than_a_fixed_strategy_at_its_peak(name):
    model = zoo.build_model(name, spatial_size=SHAPE[2:], device="meta")
    unplanned = remat3d.profile(model, SHAPE)
    for strategy in ("blocks", "uniform", "sqrt", "balanced", "recursive"):
        fixed = remat3d.plan(model, SHAPE, budget=unplanned.peak_bytes, strategy=strategy)
        try:
            best = remat3d.plan(model, SHAPE, budget=fixed.verified_peak_bytes, tile=False)
        except BudgetError:
            print(f"{name} {strategy}: peak {fixed.verified_peak_bytes} is below what "
                  "optimal reaches (nested regions)")
            continue
        print(f"{name} {strategy}: peak {fixed.verified_peak_bytes} "
              f"+{100 * fixed.recompute_flops / unplanned.flops:.1f}% -> optimal "
              f"{best.verified_peak_bytes} +{100 * best.recompute_flops / unplanned.flops:.1f}%")
        assert best.verified_peak_bytes <= fixed.verified_peak_bytes
        assert best.recompute_flops <= fixed.recompute_flops


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nnunet", "basicunet", "segresnet", "swinunetr"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_optimal_needs_half_of_blocks_recompute_at_its_peak(name, deterministic):
    """Issue 4's bar, in both determinism modes. On meta, deterministic algorithms make
    PyTorch decompose trilinear upsampling (as it does on CUDA) into a dozen full-size
    temporaries in forward; that moment, not a plan's choice, is segresnet's peak then,
    and the bar is only asserted with the default (non-deterministic) kernels."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        model = zoo.build_model(name, spatial_size=SHAPE[2:], device="meta")
        unplanned = remat3d.profile(model, SHAPE)
        blocks = remat3d.plan(model, SHAPE, budget=unplanned.peak_bytes, strategy="blocks")
        best = remat3d.plan(model, SHAPE, budget=blocks.verified_peak_bytes, tile=False)
    finally:
        torch.use_deterministic_algorithms(before)
    ratio = best.recompute_flops / blocks.recompute_flops
    print(f"\n{name} deterministic={deterministic}: blocks {blocks.verified_peak_bytes >> 20} "
          f"MiB +{100 * blocks.recompute_flops / unplanned.flops:.1f}% -> optimal "
          f"{best.verified_peak_bytes >> 20} MiB "
          f"+{100 * best.recompute_flops / unplanned.flops:.1f}%: ratio {ratio:.2f}")
    assert best.verified_peak_bytes <= blocks.verified_peak_bytes
    if not (deterministic and name == "segresnet"):
        assert ratio <= 0.5

"""remat3d.plan: verified peaks keep the budget; infeasible budgets name the smallest."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import remat3d
from remat3d import zoo
from remat3d.errors import BudgetError
from remat3d.planning import clear_plan_cache, resolve_budget

SHAPE = (1, 1, 32, 32, 32)


@pytest.fixture(scope="module")
def basicunet():
    return zoo.build_model("basicunet", device="meta")


def _smallest(model, shape, **kw) -> int:
    """The smallest budget of checkpointing plans (tiling, which goes lower, is tested in
    tests/planner/test_tiling.py)."""
    with pytest.raises(BudgetError) as info:
        remat3d.plan(model, shape, budget=1, tile=False, **kw)
    return info.value.smallest_feasible_bytes


def test_budget_sweep_keeps_every_budget(basicunet):
    unplanned = remat3d.profile(basicunet, SHAPE).peak_bytes
    smallest = _smallest(basicunet, SHAPE)
    assert smallest < unplanned
    peaks, costs = [], []
    for k in range(6):
        budget = smallest + (unplanned - smallest) * k // 5
        p = remat3d.plan(basicunet, SHAPE, budget=budget, tile=False)
        assert p.verified_peak_bytes <= budget, (budget, p.verified_peak_bytes)
        peaks.append(p.verified_peak_bytes)
        costs.append(p.recompute_flops)
    assert costs[-1] == 0  # the unplanned peak needs no recomputation
    assert costs == sorted(costs, reverse=True)  # more memory never costs more


def test_infeasible_budget_names_a_feasible_smallest(basicunet):
    smallest = _smallest(basicunet, SHAPE)
    p = remat3d.plan(basicunet, SHAPE, budget=smallest, tile=False)
    assert p.verified_peak_bytes <= smallest
    with pytest.raises(BudgetError, match="smallest feasible budget is .* unplanned peak") as e:
        remat3d.plan(basicunet, SHAPE, budget=smallest // 2, tile=False)
    assert e.value.smallest_feasible_bytes == smallest  # also as a number, for scripts
    assert e.value.unplanned_peak_bytes > smallest


def test_offload_never_raises_the_smallest_feasible_budget(basicunet):
    assert _smallest(basicunet, SHAPE, offload=True) <= _smallest(basicunet, SHAPE)


def test_plan_is_verified_and_describes_itself(basicunet):
    p = remat3d.plan(basicunet, SHAPE, budget="0.8x", amp="bf16")
    assert p.strategy == "optimal" and p.amp == "bf16" and p.input_shapes == [list(SHAPE)]
    assert p.verified_peak_bytes <= p.budget_bytes
    assert p.model_fingerprint and p.regions
    assert "verified peak" in p.summary()


def _not_planned_again():  # type: ignore[no-untyped-def]
    """A cache hit: the step is not profiled again."""
    from unittest import mock

    return mock.patch("remat3d.planning.profile", side_effect=AssertionError("planned again"))


def test_plans_are_cached_per_shape(basicunet):
    clear_plan_cache()
    a = remat3d.plan(basicunet, SHAPE, budget="0.9x")
    with _not_planned_again():
        assert remat3d.plan(basicunet, SHAPE, budget="0.9x") == a
    b = remat3d.plan(basicunet, (1, 1, 48, 48, 48), budget="0.9x")
    assert b is not a and b.input_shapes == [[1, 1, 48, 48, 48]]


@pytest.mark.parametrize("strategy", ["none", "blocks", "selective", "recursive", "uniform",
                                      "sqrt", "balanced"])
def test_fixed_strategies_are_verified(basicunet, strategy):
    p = remat3d.plan(basicunet, SHAPE, budget="1.0x", strategy=strategy)
    assert p.verified_peak_bytes is not None
    assert (len(p.regions) == 0) == (strategy == "none")


def test_recursive_nests_regions_and_stays_exact():
    torch.manual_seed(0)
    model = zoo.build_model("nnunet", {"filters": [4, 8, 16, 16, 16, 16]})
    x = torch.randn(1, 1, 64, 64, 64)
    # below what the chain model fits: revolve's binomial schedule on the 12 stages,
    # expressed with the U-Net's levels (containers) and blocks
    p = remat3d.plan(model, tuple(x.shape), budget="0.5x", strategy="recursive")
    names = [r.module for r in p.regions]
    levels = [n for n in names if n.startswith("skip_layers")]
    assert levels and any(n.startswith("downsamples") for n in names)  # nested regions
    from tests.runtime.exactness import assert_exact

    report = assert_exact(model, x, p)
    assert all(r.recomputes >= 1 for r in report.regions)


@pytest.mark.slow  # -m slow: 18 s; module plans on real models: tests/runtime/test_exactness.py
def test_a_plan_applies_to_the_real_model_and_stays_exact():
    torch.manual_seed(0)
    model = zoo.build_model("segresnet")
    x = torch.randn(1, 1, 32, 32, 32)
    p = remat3d.plan(model, tuple(x.shape), budget="0.8x", graph=False)  # module regions
    assert p.regions
    from tests.runtime.exactness import assert_exact

    assert_exact(model, x, p)


def test_resolve_budget():
    assert resolve_budget("0.25x", 1000) == 250
    assert resolve_budget("12GiB", 0) == 12 * 2**30
    assert resolve_budget(4096, 0) == 4096
    with pytest.raises(BudgetError, match="ambiguous"):
        resolve_budget(0.5, 1000)
    with pytest.raises(BudgetError, match="fraction"):
        resolve_budget("halfx", 1000)
    if not torch.cuda.is_available():
        with pytest.raises(BudgetError, match="no CUDA device"):
            resolve_budget("auto", 1000)


def test_search_also_tries_targets_above_the_budget():
    """The stage model errs both ways (planning NOTE rule 3): when its plan at the budget
    does not fit, a target above the budget may verify under it with less recomputation.
    Here the model under-predicts below the budget and over-predicts above it; the search's
    seeds must be both bisections' winners, the one from above the budget first."""
    from remat3d.planner.optimal import min_peak
    from remat3d.planner.registry import PlannerOptions
    from remat3d.planner.searching import Problem, _Search
    from remat3d.planner.stages import build_stages
    from remat3d.planspec import Plan, Region
    from tests.tiling.test_fused import TinyUNet

    graph = remat3d.profile(TinyUNet(), SHAPE, device="meta").graph
    stages = build_stages(graph)
    budget = min_peak(stages)[0] * 11 // 10  # the second bisection's first target is above

    class Search(_Search):
        def make(self, target: int) -> Plan:
            # a looser target: less recomputation; verified off by +5 % below, -12 % above
            error = budget // 20 if target <= budget else -(budget * 12 // 100)
            p = Plan(regions=[Region(f"t{target}")])
            p.verified_peak_bytes, p.recompute_flops = target + error, 10**9 - target
            return p

        def build(self, decisions) -> Plan:  # type: ignore[no-untyped-def]
            p = Plan(regions=[Region("fixed")])  # fixed strategies: never fit here
            p.verified_peak_bytes, p.recompute_flops = 2 * stages.unplanned_peak, 0
            return p

    problem = Problem(stages=stages, graph=graph, budget=budget, strategy="optimal",
                      options=PlannerOptions(), header=Plan(), step_flops=0,
                      unplanned_peak=stages.unplanned_peak, verify=lambda p, within=None: None)
    seeds = Search(problem).seeds()
    assert len(seeds) == 2
    assert all(s.verified_peak_bytes <= budget for s in seeds)
    above, below = seeds  # cheapest first
    assert above.recompute_flops < below.recompute_flops
    assert int(below.regions[0].module[1:]) <= budget
    assert int(above.regions[0].module[1:]) > budget  # its target was above the budget


def test_the_plan_cache_tells_apart_what_changes_the_step():
    """Freezing a layer, changing a convolution's stride or the loss function changes the
    step's memory: none of them may be answered from the cache of another."""
    def net(stride: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Conv3d(1, 8, 3, padding=1), torch.nn.ReLU(),
                                   torch.nn.Conv3d(8, 8, 3, padding=1, stride=stride),
                                   torch.nn.ReLU())

    base = remat3d.plan(net(1), SHAPE, budget="1x", strategy="none")
    frozen = net(1)
    frozen[0].requires_grad_(False)
    no_grad = remat3d.plan(frozen, SHAPE, budget="1x", strategy="none")
    assert no_grad.step_flops < base.step_flops  # no weight gradient for layer 0
    strided = remat3d.plan(net(2), SHAPE, budget="1x", strategy="none")
    assert strided.verified_peak_bytes < base.verified_peak_bytes
    keep_all = remat3d.plan(net(1), SHAPE, budget="1x", strategy="none",
                            loss_fn=lambda y: (y * y).sum())  # saves y for backward
    assert keep_all.verified_peak_bytes > base.verified_peak_bytes
    with _not_planned_again():  # still cached
        assert remat3d.plan(net(1), SHAPE, budget="1x", strategy="none") == base


def test_offload_plans_drop_the_prefetch_only_when_it_does_not_fit() -> None:
    """NOTE [ Offload paths ]: the prefetch holds the previous region's tensors early. At
    the smallest budget of a 64³ bf16 BasicUNet it does not fit, so the plan copies back
    only on demand; the same plan with the prefetch verifies above the budget."""
    model = zoo.build_model("basicunet", device="meta")
    shape = (1, 1, 64, 64, 64)
    with pytest.raises(BudgetError) as info:
        remat3d.plan(model, shape, budget=1, offload=True, tile=False, amp="bf16",
                     graph=False)
    smallest = info.value.smallest_feasible_bytes  # type: ignore[attr-defined]
    plan = remat3d.plan(model, shape, budget=smallest, offload=True, tile=False, amp="bf16",
                        graph=False)
    assert plan.prefetch is False and any(r.decision == "offload" for r in plan.regions)
    assert "no prefetch" in plan.summary()
    assert plan.verified_peak_bytes is not None and plan.verified_peak_bytes <= smallest
    early = remat3d.Plan.from_dict({**plan.to_dict(), "prefetch": True})
    remat3d.apply(model, early)
    assert remat3d.measure(model, shape, device="meta", amp="bf16").peak_bytes > smallest
    remat3d.remove(model)
    roomy = remat3d.plan(model, shape, budget=int(smallest * 1.3), offload=True, tile=False,
                         amp="bf16", graph=False)
    assert roomy.prefetch is True  # it fits there: the copies stay hidden behind compute


def test_plan_returns_the_callers_own_copy():
    """Editing a returned plan changes neither the cache nor what the next call returns
    (issue 19 point 4)."""
    from tests.tiling.test_fused import TinyUNet

    net = TinyUNet()
    first = remat3d.plan(net, SHAPE, budget="0.8x")
    regions = [dataclasses.replace(r) for r in first.regions]
    first.regions.clear()
    first.notes.append("edited")
    again = remat3d.plan(net, SHAPE, budget="0.8x")
    assert again is not first
    assert again.regions == regions and "edited" not in again.notes


def test_verify_is_part_of_the_cache_key():
    """issue 19 point 4: a verified plan is never answered by an unverified one."""
    from tests.tiling.test_fused import TinyUNet

    net = TinyUNet()
    # (module plans: a graph plan is always measured, verify or not)
    quick = remat3d.plan(net, SHAPE, budget="0.8x", verify=False, graph=False)
    assert quick.verified_peak_bytes is None
    verified = remat3d.plan(net, SHAPE, budget="0.8x", verify=True, graph=False)
    assert verified.verified_peak_bytes is not None


def test_the_cache_does_not_keep_the_loss_function_or_what_it_holds_alive():
    """A trainer's planning loss closes over the trainer (model, optimizer, data): the
    process-wide cache must not pin them (issue 19 point 4)."""
    import gc
    import weakref

    from tests.tiling.test_fused import TinyUNet

    class Owner:  # stands for the trainer
        def loss(self, y):
            return (y.float() ** 2).mean()

    owner = Owner()
    alive = weakref.ref(owner)
    net = TinyUNet()
    bound = remat3d.plan(net, SHAPE, budget="0.8x", loss_fn=owner.loss)
    with _not_planned_again():  # a bound method of the same object: the same key
        assert remat3d.plan(net, SHAPE, budget="0.8x", loss_fn=owner.loss) == bound
    def closing_over(o: Owner):  # what the trainer's planning loss is
        return lambda y: o.loss(y)

    loss = closing_over(owner)
    assert remat3d.plan(net, SHAPE, budget="0.8x", loss_fn=loss) == bound
    del owner, loss
    gc.collect()
    assert alive() is None


def test_a_plan_does_not_depend_on_what_was_planned_before(basicunet):
    """issue 19 point 4: the same call gives the same plan whatever the process planned
    earlier (a cheaper plan found for a smaller budget once replaced the search's own)."""
    # two budgets near basicunet's smallest: the plan made at the smaller one was cheaper
    # than the one the search made at the larger, and replaced it when planned first
    budgets = [79_566_744, 82_752_408]
    clear_plan_cache()
    fresh = remat3d.plan(basicunet, SHAPE, budget=budgets[1], tile=False)
    clear_plan_cache()
    remat3d.plan(basicunet, SHAPE, budget=budgets[0], tile=False)
    after = remat3d.plan(basicunet, SHAPE, budget=budgets[1], tile=False)
    assert after == fresh


def _process_state() -> tuple:
    """What a plan, a profile or a step may install process-wide while it runs."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from remat3d.instrument.state import recompute_depth

    module = torch.nn.modules.module
    return (tuple(_get_current_dispatch_mode_stack()),
            torch._C._autograd._top_saved_tensors_default_hooks(False),
            tuple(torch.overrides._get_current_function_mode_stack()),
            len(module._global_forward_hooks), len(module._global_forward_pre_hooks),
            recompute_depth(), torch.is_grad_enabled())


def test_an_interrupt_anywhere_in_plan_leaves_the_process_as_it_was():
    """Ctrl-C inside plan() (a KeyboardInterrupt from any forward of the step: profiling,
    each verification, recomputations, the tiling probe) leaves no hook, mode or flag
    behind, and the next plan is the plan (issue 19 point 3)."""
    calls = [0, -1]

    class Interruptible(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv3d(4, 4, 3, padding=1)

        def forward(self, x):
            calls[0] += 1
            if calls[0] == calls[1]:
                raise KeyboardInterrupt
            return torch.relu(self.conv(x))

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.InstanceNorm3d(4, affine=True),
            torch.nn.LeakyReLU(inplace=True),
            torch.nn.Sequential(Interruptible(), torch.nn.BatchNorm3d(4)), Interruptible(),
            torch.nn.Conv3d(4, 1, 1))

    shape = (1, 1, 12, 12, 12)
    before = _process_state()
    clear_plan_cache()
    want = remat3d.plan(net(), shape, budget="0.9x")
    total = calls[0]
    assert total > 4
    # the first calls (profiling), then a spread over verifications and recomputations
    for stop in [*range(1, 5), *range(5, total + 1, max(1, total // 10))]:
        clear_plan_cache()
        calls[:] = [0, stop]
        with pytest.raises(KeyboardInterrupt):
            remat3d.plan(net(), shape, budget="0.9x")
        assert _process_state() == before, f"interrupted at forward call {stop} of {total}"
    calls[:] = [0, -1]
    clear_plan_cache()
    assert remat3d.plan(net(), shape, budget="0.9x") == want


def test_a_model_in_pure_bf16_plans_with_its_input_dtype():
    """issue 19 point 5: plan() rebuilt the example input from its shape as float32, so a
    model in pure bf16 failed inside plan()'s own profiling."""
    from tests.tiling.test_fused import TinyUNet

    net = TinyUNet().to(torch.bfloat16)
    x = torch.randn(SHAPE, dtype=torch.bfloat16)
    p = remat3d.plan(net, x, budget="0.8x")
    assert p.verified_peak_bytes is not None and p.verified_peak_bytes <= p.budget_bytes
    assert remat3d.plan(net, SHAPE, budget="0.8x") == p  # a shape takes the weights' dtype
    float_net = TinyUNet()
    assert remat3d.plan(float_net, SHAPE, budget="0.8x").budget_bytes > p.budget_bytes

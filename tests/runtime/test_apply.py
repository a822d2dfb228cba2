"""apply/remove: the model is the same object with the same state; clear errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat3d
from remat3d import Plan, Region
from remat3d.planspec import PlanError
from remat3d.runtime.fingerprint import model_fingerprint

from .exactness import assert_exact, train_step
from .torture import Torture


def test_apply_keeps_state_dict_parameters_and_tree():
    model = Torture()
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    children = [n for n, _ in model.named_modules()]
    assert remat3d.apply(model, Plan(regions=[Region("block"), Region("pair")])) is model
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert [n for n, _ in model.named_modules()] == children
    remat3d.remove(model)
    assert "forward" not in model.block.__dict__ and "forward" not in model.pair.__dict__


def test_remove_restores_a_users_own_instance_forward():
    model = Torture()
    custom = model.pair.forward
    model.pair.forward = custom
    remat3d.apply(model, Plan(regions=[Region("pair")]))
    assert model.pair.forward is not custom
    remat3d.remove(model)
    assert model.pair.forward is custom


def test_select_calls_of_a_module_called_twice():
    model = Torture()
    x = torch.randn(2, 1, 8, 8, 8)
    report = assert_exact(model, x, Plan(regions=[Region("shared", calls=[1])]))
    (stats,) = report.regions
    assert (stats.forward_runs, stats.recomputes) == (1, 1)


def test_sequential_segment():
    model = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(),
                          nn.Conv3d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 1, 1))
    x = torch.randn(2, 1, 8, 8, 8)
    plan = Plan(regions=[Region("", segment=["0", "1", "2"]), Region("", segment=["3", "4"])])
    report = assert_exact(model, x, plan)
    assert [(r.forward_runs, r.recomputes) for r in report.regions] == [(1, 1), (1, 1)]


def test_double_apply_is_refused():
    model = Torture()
    remat3d.apply(model, Plan(regions=[Region("block")]))
    with pytest.raises(PlanError, match="already applied"):
        remat3d.apply(model, Plan(regions=[Region("pair")]))
    remat3d.remove(model)
    with pytest.raises(PlanError, match="nothing to remove"):
        remat3d.remove(model)


def test_plan_for_another_model_is_refused():
    plan = Plan(regions=[Region("block")], model="Torture",
                model_fingerprint=model_fingerprint(Torture(c=8)))
    with pytest.raises(PlanError, match="made for another model"):
        remat3d.apply(Torture(c=4), plan)
    remat3d.apply(Torture(c=8), plan)  # the right model is fine


@pytest.mark.parametrize("region, match", [
    (Region("blokc"), "Did you mean 'block'"),
    (Region("block", segment=["conv"]), "needs an nn.Sequential"),
    (Region("frozen", segment=["1", "0"]), "not a contiguous run"),
])
def test_bad_regions(region, match):
    with pytest.raises(PlanError, match=match):
        remat3d.apply(Torture(), Plan(regions=[region]))


def test_report_counts_each_recompute_once_per_backward_and_resets():
    model = Torture()
    remat3d.apply(model, Plan(regions=[Region("block"), Region("pair")]))
    x = torch.randn(2, 1, 8, 8, 8)
    for _ in range(2):
        train_step(model, x)
        report = remat3d.report(model)
        assert [(r.forward_runs, r.recomputes) for r in report.regions] == [(1, 1), (1, 1)]
    assert report.regions[0].input_bytes == 2 * 4 * 8**3 * 4
    assert "saved outside regions" in str(report)


def test_report_warns_about_regions_that_never_ran():
    model = Torture()
    remat3d.apply(model, Plan(regions=[Region("shared", calls=[5])]))
    train_step(model, torch.randn(2, 1, 8, 8, 8))
    assert "never ran" in str(remat3d.report(model))


def test_eval_and_no_grad_forward_work_unchanged():
    model = Torture().eval()
    reference = copy.deepcopy(model)
    remat3d.apply(model, Plan(regions=[Region("block"), Region("pair")]))
    x = torch.randn(1, 1, 8, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(x)[0], reference(x)[0])

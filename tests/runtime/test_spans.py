"""Spans: a parent's own ops between its children as regions (runtime/spans.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat3d
from remat3d import Plan, Region
from remat3d.errors import PlanError
from remat3d.runtime.spans import find_spans, install_spans, span_modules, uninstall_spans
from tests.runtime.exactness import assert_exact, train_step


def _stage(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), nn.InstanceNorm3d(cout, affine=True),
                         nn.LeakyReLU(inplace=True), nn.Conv3d(cout, cout, 3, padding=1),
                         nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(inplace=True))


class Decoder(nn.Module):
    """nnU-Net v2's UNetDecoder in small: each skip is concatenated in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.transpconvs = nn.ModuleList([nn.ConvTranspose3d(16, 8, 2, stride=2),
                                          nn.ConvTranspose3d(8, 4, 2, stride=2)])
        self.stages = nn.ModuleList([_stage(16, 8), _stage(8, 4)])
        self.head = nn.Conv3d(4, 2, 1)

    def forward(self, skips):
        x = skips[-1]
        for s in range(len(self.stages)):
            x = self.transpconvs[s](x)
            x = torch.cat((x, skips[-(s + 2)]), 1)
            x = self.stages[s](x)
        return self.head(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc0 = _stage(1, 4)
        self.enc1 = nn.Sequential(nn.Conv3d(4, 8, 3, stride=2, padding=1), _stage(8, 8))
        self.enc2 = nn.Sequential(nn.Conv3d(8, 16, 3, stride=2, padding=1), _stage(16, 16))
        self.decoder = Decoder()

    def forward(self, x):
        s0 = self.enc0(x)
        s1 = self.enc1(s0)
        return self.decoder([s0, s1, self.enc2(s1)])


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv3d(1, 2, 1)
        self.b = nn.Conv3d(4, 2, 1)

    def forward(self, x):
        y = self.a(x)
        if y.sum() > 0:  # control flow on a value: torch.fx cannot trace it
            y = y * 2
        return self.b(torch.cat((y, y), 1))


X = (1, 1, 16, 16, 16)


def test_the_concatenation_joins_its_transposed_conv_and_stage():
    spans = find_spans(Net(), ["", "decoder"])
    assert spans == {"decoder": [["transpconvs_0", "cat", "stages_0"],
                                 ["transpconvs_1", "cat_1", "stages_1"]]}


def test_no_spans_where_the_forward_cannot_be_traced_or_the_module_is_the_unit():
    assert find_spans(DataDependent(), [""]) == {}
    whole = nn.Sequential(nn.Conv3d(1, 1, 1))
    assert find_spans(whole, [""]) == {}


def test_installed_spans_leave_the_model_as_it_was():
    net = Net()
    before = (list(net.state_dict()), [n for n, _ in net.named_modules()])
    x = torch.randn(X)
    want = net(x)
    spans = install_spans(net, find_spans(net, ["decoder"]))
    assert list(spans) == ["decoder.@0", "decoder.@1"]
    assert torch.equal(net(x), want)
    assert (list(net.state_dict()), [n for n, _ in net.named_modules()]) == before
    assert span_modules(net) == spans
    uninstall_spans(net)
    assert "forward" not in net.decoder.__dict__ and span_modules(net) == {}


@pytest.mark.parametrize("decision", ["recompute", "offload"])
def test_a_region_on_a_span_is_bitwise_exact(decision):
    net = Net()  # (the suite runs with deterministic algorithms: tests/conftest.py)
    plan = Plan(regions=[Region("decoder.@0", decision=decision),
                         Region("decoder.@1", decision=decision), Region("enc0")],
                spans=find_spans(net, ["decoder"]), offload_min_bytes=0)
    assert_exact(net, torch.randn(X), plan)


def test_a_tiled_span_is_within_the_tiling_tolerance():
    net = Net()
    x = torch.randn(X)
    plan = Plan(regions=[Region("decoder.@1", decision="tile", tile=[8, 8, 8])],
                spans=find_spans(net, ["decoder"]))
    want = train_step(copy.deepcopy(net), x)
    remat3d.apply(net, plan)
    try:
        got = train_step(net, x)
    finally:
        remat3d.remove(net)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-4, atol=1e-5)
    assert "forward" not in net.decoder.__dict__


def test_the_planner_sees_the_span_as_a_block_and_the_plan_round_trips(tmp_path):
    net = Net()
    plan = remat3d.plan(net, X, budget="0.95x", strategy="blocks", graph=False)
    assert plan.spans == find_spans(net, ["decoder"])
    # each transposed conv, its concatenation and its stage are one block, as MONAI's
    # UnetUpBlock would be
    assert [r.module for r in plan.regions] == ["enc0", "enc1", "enc2", "decoder.@0",
                                                "decoder.@1"]
    assert plan.verified_peak_bytes <= plan.budget_bytes
    assert_exact(net, torch.randn(X), plan)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again.spans == plan.spans
    remat3d.apply(net, again)
    remat3d.remove(net)
    assert "forward" not in net.decoder.__dict__


def test_a_span_naming_a_node_the_forward_lacks_is_refused_and_nothing_is_left():
    net = Net()
    plan = Plan(regions=[Region("decoder.@0")],
                spans={"decoder": [["transpconvs_0", "concat"]]})
    with pytest.raises(PlanError, match="concat"):
        remat3d.apply(net, plan)
    assert "forward" not in net.decoder.__dict__
    bad = Plan(regions=[Region("decoder.@2")], spans=find_spans(net, ["decoder"]))
    with pytest.raises(PlanError, match="decoder.@2"):
        remat3d.apply(net, bad)
    assert "forward" not in net.decoder.__dict__ and span_modules(net) == {}
    half = Plan(regions=[Region("decoder.@0")],
                spans={"decoder": [["transpconvs_0", "cat"]]})  # the cat is read outside
    with pytest.raises(PlanError, match="is not a span"):
        remat3d.apply(net, half)
    assert "forward" not in net.decoder.__dict__


def test_a_graph_plan_has_no_spans():
    with pytest.raises(PlanError, match="spans"):
        Plan(graph_recompute=["a"], spans={"": [["a"]]})


class SupervisedDecoder(Decoder):
    """With nnU-Net's deep_supervision flag: a list of outputs while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.deep_supervision = True
        self.aux = nn.Conv3d(8, 2, 1)

    def forward(self, skips):
        x = skips[-1]
        outputs = []
        for s in range(len(self.stages)):
            x = self.transpconvs[s](x)
            x = torch.cat((x, skips[-(s + 2)]), 1)
            x = self.stages[s](x)
            if s == 0:
                outputs.append(self.aux(x))
        out = self.head(x)
        return [out, *outputs] if self.deep_supervision else out


def test_spans_follow_the_parents_settings():
    """NOTE [ Spans of a parent's forward ] rule 7: nnU-Net's validation turns deep
    supervision off on a planned network; the spans' trace follows (one output, as the
    forward gives), with grad and without."""
    net = Net()
    net.decoder = SupervisedDecoder()
    x = torch.randn(X)
    reference = copy.deepcopy(net)
    plan = Plan(regions=[Region("decoder.@0"), Region("decoder.@1")],
                spans=find_spans(net, ["decoder"]))
    remat3d.apply(net, plan)
    try:
        assert isinstance(net(x), list)
        for model in (net, reference):
            model.decoder.deep_supervision = False
        with torch.no_grad():
            got, want = net(x), reference(x)
        assert isinstance(got, torch.Tensor) and torch.equal(got, want)
        got, want = train_step(net, x), train_step(reference, x)
        assert len(got[0]) == len(want[0]) == 1  # one output with grad too
        assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
        assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])
    finally:
        remat3d.remove(net)

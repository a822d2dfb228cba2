"""Graph plans executed (runtime/graph_run.py): exact like ordinary training, the memory
planner/liveness.py predicts, one input signature, removable."""

from __future__ import annotations

import copy

import pytest
import torch

from remat3d.capture.joint import capture
from remat3d.errors import PlanError
from remat3d.planner.liveness import closed_recompute, simulate
from remat3d.runtime.graph_run import (
    apply_graph_plan,
    graph_plan_of,
    measure_graph_plan,
    remove_graph_plan,
)
from tests.capture.nets import Aliased, ParentConcat
from tests.runtime.exactness import train_step


def _unet():
    from monai.networks.nets import UNet

    return UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1,
                norm="instance")


def _segresnet():
    # trilinear upsampling (capture/joint.py NOTE rules 3 and 9: its indices made from
    # nothing, its decomposition not eager's kernel)
    from monai.networks.nets import SegResNet

    return SegResNet(init_filters=4, blocks_down=(1, 1), blocks_up=(1,),
                     norm=("GROUP", {"num_groups": 2}))


def _swinunetr():
    # attention masks made from constants in forward (capture/joint.py NOTE rule 3)
    from monai.networks.nets import SwinUNETR

    # two blocks a stage: the second shifts its windows, and masks them
    return SwinUNETR(in_channels=1, out_channels=2, feature_size=12, depths=(2, 2, 2, 2),
                     num_heads=(1, 1, 1, 1))


NETS = {"concat-batchnorm": lambda: ParentConcat("batch"),
        "concat-instancenorm": lambda: ParentConcat("instance"),
        "aliased-and-tied": Aliased,
        "monai-unet": _unet,
        "monai-segresnet": _segresnet,
        "monai-swinunetr": _swinunetr}
# SwinUNETR's smallest input is 64³: a minute of CPU steps, so not in the default run
CASES = [pytest.param(n, marks=pytest.mark.slow) if n == "monai-swinunetr" else n
         for n in NETS]


def _plans(model, shape):
    graph = capture(model, shape).graph
    cheap = sorted(closed_recompute(graph, [n.name for n in graph.forward if n.flops == 0]))
    every = sorted(closed_recompute(graph, [n.name for n in graph.forward]))
    return graph, {"save-all": ([], []), "recompute-cheap": (cheap, []),
                   "recompute-all": (every, []), "recompute-all-twice": (every, every)}


@pytest.mark.parametrize("net", CASES)
def test_graph_plans_are_bitwise_ordinary_training(net, deterministic):
    torch.manual_seed(0)
    model = NETS[net]()
    edge = 64 if net == "monai-swinunetr" else 16  # its smallest input
    x = torch.randn(1, 1, edge, edge, edge)
    reference = train_step(copy.deepcopy(model), x)
    _, plans = _plans(model, tuple(x.shape))
    for name, (recompute, twice) in plans.items():
        planned = apply_graph_plan(copy.deepcopy(model), recompute, twice=twice)
        weights = [id(t) for t in [*planned.parameters(), *planned.buffers()]]
        for _ in range(2):  # traced on the first step, replayed on the second
            got = train_step(planned, x)
            for want, have in zip(reference, got):
                if isinstance(want, dict):
                    assert want.keys() == have.keys(), name
                    bad = [k for k in want if not torch.equal(want[k], have[k])]
                    assert not bad, (name, bad)
                else:
                    assert all(torch.equal(a, b) for a, b in zip(want, have)), name
            # tracing swapped in its own tensors and put every weight back
            assert [id(t) for t in [*planned.parameters(), *planned.buffers()]] == weights
            remove_graph_plan(planned)
            planned.load_state_dict(model.state_dict())
            apply_graph_plan(planned, recompute, twice=twice)


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("net", CASES)
def test_the_predicted_peak_is_the_measured_one(net):
    torch.manual_seed(0)
    model = NETS[net]()
    edge = 64 if net == "monai-swinunetr" else 32  # its smallest input
    shape = (1, 1, edge, edge, edge)
    graph, plans = _plans(model, shape)
    peaks = {}
    for name, (recompute, twice) in plans.items():
        predicted = simulate(graph, recompute, twice).peak_bytes
        measured = measure_graph_plan(model, (shape,), recompute, twice=twice).peak_bytes
        assert abs(predicted - measured) <= 0.03 * measured, (name, predicted, measured)
        peaks[name] = measured
    assert peaks["recompute-cheap"] <= peaks["save-all"]
    assert peaks["recompute-all-twice"] <= peaks["recompute-all"]
    if net != "aliased-and-tied":  # its peak holds nothing a cheap op made
        assert peaks["recompute-cheap"] < peaks["save-all"]


def test_one_input_signature_and_the_model_as_it_was():
    torch.manual_seed(0)
    model = ParentConcat()
    keys = list(model.state_dict())
    apply_graph_plan(model, [])
    assert graph_plan_of(model) == [] and list(model.state_dict()) == keys
    model(torch.randn(1, 1, 8, 8, 8)).sum().backward()
    with pytest.raises(PlanError, match="made for inputs"):
        model(torch.randn(1, 1, 16, 16, 16))
    with pytest.raises(PlanError, match="already runs a graph plan"):
        apply_graph_plan(model, [])
    remove_graph_plan(model)
    assert graph_plan_of(model) is None and "forward" not in model.__dict__
    model(torch.randn(1, 1, 16, 16, 16))  # its own forward again


def test_a_plan_for_another_graph_is_refused():
    model = apply_graph_plan(ParentConcat(), ["no_such_node"])
    with pytest.raises(PlanError, match="no_such_node"):
        model(torch.randn(1, 1, 8, 8, 8))


def test_a_graph_plan_refuses_meta_tensors():
    from remat3d.instrument.step import meta_copy

    model = apply_graph_plan(meta_copy(ParentConcat()), [])
    with pytest.raises(PlanError, match="does not run on the meta device"):
        model(torch.empty(1, 1, 8, 8, 8, device="meta"))


def test_a_bf16_graph_plan_is_bitwise_eager_under_cuda_autocasts_rules(deterministic):
    # the plan runs its forward under CUDA autocast's rules on every device (NOTE rule 5)
    from remat3d.instrument.amp import MetaAutocast

    torch.manual_seed(0)
    model = ParentConcat("instance")
    x = torch.randn(1, 1, 16, 16, 16)
    eager = copy.deepcopy(model)
    own = eager.forward

    def under_autocast(*args):
        with MetaAutocast(torch.bfloat16, any_device=True):
            return own(*args)

    eager.forward = under_autocast
    reference = train_step(eager, x)
    captured = capture(model, tuple(x.shape), amp=torch.bfloat16)
    casts = [n for n in captured.joint.graph.nodes if "_to_copy" in str(n.target)]
    assert casts and reference[0][0].dtype == torch.bfloat16
    cheap = closed_recompute(captured.graph, [n.name for n in captured.graph.forward
                                              if n.flops == 0])
    planned = apply_graph_plan(copy.deepcopy(model), cheap, amp="bf16",
                               digest=captured.digest)
    got = train_step(planned, x)
    for want, have in zip(reference[1:], got[1:]):
        assert all(torch.equal(want[k], have[k]) for k in want)
    assert all(torch.equal(a, b) for a, b in zip(reference[0], got[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same dtype: no second cast
        assert torch.equal(planned(x), got[0][0])


def test_autocast_a_graph_plan_was_not_made_for_is_refused():
    x = torch.randn(1, 1, 8, 8, 8)
    full = apply_graph_plan(ParentConcat(), [])
    half = apply_graph_plan(ParentConcat(), [], amp="bf16")
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(PlanError, match="made for full precision.*amp='bf16'"):
        full(x)
    with torch.autocast("cpu", dtype=torch.float16), \
            pytest.raises(PlanError, match="made for autocast to torch.bfloat16"):
        half(x)


def test_a_graph_traced_otherwise_than_planned_is_refused():
    # the same node names under another precision: the digest tells them apart
    model = ParentConcat()
    captured = capture(model, (1, 1, 8, 8, 8), amp=torch.bfloat16)
    planned = apply_graph_plan(model, [], digest=captured.digest)  # run without amp
    with pytest.raises(PlanError, match="not the one the graph plan was made for"):
        planned(torch.randn(1, 1, 8, 8, 8))


def test_swinunetr_is_captured_and_measured_without_memory():
    # its attention masks are made in forward from constants: fake tensors, lifted real
    # scalars and AOTAutograd's lazy backward copy all meet here (capture/joint.py rule 3)
    from remat3d.instrument.step import meta_copy

    model = meta_copy(_swinunetr())
    shape = (1, 1, 64, 64, 64)
    graph = capture(model, shape).graph
    every = closed_recompute(graph, [n.name for n in graph.forward])  # masks in backward
    predicted = simulate(graph, every).peak_bytes
    measured = measure_graph_plan(model, (shape,), every).peak_bytes
    assert abs(predicted - measured) <= 0.03 * measured


def test_batchnorm_in_training_is_recomputed_without_its_running_statistics(deterministic):
    # its output reads none of them; they are updated in place after the forward
    torch.manual_seed(0)
    model = ParentConcat("batch")
    x = torch.randn(1, 1, 16, 16, 16)
    graph = capture(model, tuple(x.shape)).graph
    norms = [n.name for n in graph.forward if n.op == "_native_batch_norm_legit_functional"]
    assert norms and all(graph[n].recomputable for n in norms)
    recompute = closed_recompute(graph, norms)
    assert set(norms) <= recompute
    reference = train_step(copy.deepcopy(model), x)
    got = train_step(apply_graph_plan(copy.deepcopy(model), recompute), x)
    for want, have in zip(reference[1:], got[1:]):  # gradients, running statistics
        assert all(torch.equal(want[k], have[k]) for k in want)

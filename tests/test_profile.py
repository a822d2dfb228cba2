"""profile(): the CostGraph and whole-step figures; measure(): a real step."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import remat3d
from remat3d import zoo
from remat3d.errors import Remat3dError
from remat3d.graph import CostGraph
from remat3d.profiling import Profile


def _small_unet():
    from monai.networks.nets import DynUNet

    return DynUNet(3, 1, 2, [3] * 3, [1, 2, 2], [2, 2], filters=[4, 8, 16],
                   norm_name="instance", act_name=("leakyrelu", {"inplace": True}))


def test_self_saved_bytes_sum_to_saved_bytes():
    prof = remat3d.profile(zoo.build_model("nnunet"), (1, 1, 64, 64, 64))
    g = prof.graph
    assert sum(n.self_saved_bytes for n in g.nodes) + g.unattributed["saved_bytes"] == \
        prof.saved_bytes
    root = g.nodes[0]
    assert root.name == "" and root.parent is None
    assert root.saved_bytes + g.unattributed["saved_bytes"] == prof.saved_bytes
    assert root.fwd_flops + g.unattributed["fwd_flops"] == g.forward_flops
    # inclusive figures are the sums over children plus the node's own
    for n in g.nodes:
        assert n.saved_bytes == n.self_saved_bytes + sum(g.nodes[c].saved_bytes
                                                         for c in n.children)


def test_unet_skip_connections_are_edges_with_their_bytes():
    prof = remat3d.profile(_small_unet(), (1, 1, 16, 16, 16))
    g = prof.graph
    # encoder level 0 output (4 channels at 16^3, fp32) is read by the last decoder block
    enc = g.find("input_block")
    dec = g.find("upsamples.1")
    encoder_nodes = {enc.id, *range(enc.id, enc.id + 1 + len(_descendants(g, enc.id)))}
    skips = [e for e in g.edges if e.src in encoder_nodes and e.dst == dec.id]
    assert len(skips) == 1
    assert skips[0].bytes == 4 * 16**3 * 4 and skips[0].shape == [1, 4, 16, 16, 16]
    assert skips[0].span > 10  # it jumps over the whole bottom of the U
    # the model input is an edge from -1
    assert any(e.src == -1 for e in g.edges)


def _descendants(g: CostGraph, node_id: int) -> list[int]:
    out, stack = [], list(g.nodes[node_id].children)
    while stack:
        k = stack.pop()
        out.append(k)
        stack.extend(g.nodes[k].children)
    return out


def test_module_called_twice_is_two_nodes():
    prof = remat3d.profile(_small_unet(), (1, 1, 16, 16, 16))
    lrelus = [n for n in prof.graph.nodes if n.name == "input_block.lrelu"]
    assert [n.call_index for n in lrelus] == [0, 1]
    assert lrelus[1].label == "input_block.lrelu#1"


def test_profile_json_round_trip(tmp_path):
    prof = remat3d.profile(_small_unet(), (1, 1, 16, 16, 16))
    path = tmp_path / "p.json"
    prof.save(path)
    data = json.loads(path.read_text())
    for key in ("peak_bytes", "saved_bytes", "param_bytes", "flops", "nodes", "edges"):
        assert key in data
    again = Profile.load(path)
    assert again.to_dict() == prof.to_dict()
    assert again.peak_bytes == prof.peak_bytes and again.graph.nodes == prof.graph.nodes
    assert not list(tmp_path.glob("*.tmp"))


def test_costgraph_is_plain_data():
    g = remat3d.profile(_small_unet(), (1, 1, 16, 16, 16)).graph
    text = json.dumps(g.to_dict())
    assert CostGraph.from_dict(json.loads(text)) == g


def test_meta_profile_leaves_the_model_alone():
    model = _small_unet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    remat3d.profile(model, torch.randn(1, 1, 16, 16, 16), amp="bf16")
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_cpu_profile_restores_batchnorm_stats_and_grads():
    model = zoo.build_model("unet")  # BatchNorm
    x = torch.randn(1, 1, 32, 32, 32)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prof = remat3d.profile(model, x, device="cpu")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
    assert prof.graph.nodes[0].fwd_seconds is not None  # timed on a real device


def test_meta_matches_cpu_exactly():
    model = _small_unet()
    x = torch.randn(1, 1, 16, 16, 16)
    meta = remat3d.profile(model, x)
    cpu = remat3d.profile(model, x, device="cpu")
    assert (meta.peak_bytes, meta.saved_bytes, meta.flops) == \
        (cpu.peak_bytes, cpu.saved_bytes, cpu.flops)
    assert [n.saved_bytes for n in meta.graph.nodes] == [n.saved_bytes for n in cpu.graph.nodes]


def test_512_cubed_on_meta_and_bf16_halves_activations():
    model = zoo.build_model("nnunet", device="meta")
    fp32 = remat3d.profile(model, (1, 1, 512, 512, 512))
    bf16 = remat3d.profile(model, (1, 1, 512, 512, 512), amp="bf16")
    assert fp32.peak_bytes > 250 * 2**30  # no such memory here: nothing was allocated
    ratio = bf16.saved_bytes / fp32.saved_bytes
    assert 0.48 < ratio < 0.52
    convs = [n for n in bf16.graph.nodes if n.module_type == "Conv3d"]
    assert convs and all(n.output_dtype == "bfloat16" for n in convs)


def test_peak_breakdown_sums_to_peak():
    prof = remat3d.profile(_small_unet(), (1, 1, 16, 16, 16))
    assert sum(prof.breakdown.values()) == prof.peak_bytes
    assert prof.peak_phase in ("forward", "backward")
    assert prof.breakdown["parameters"] == prof.param_bytes


def test_measure_cpu_and_meta():
    model = _small_unet()
    x = torch.randn(1, 1, 16, 16, 16)
    cpu = remat3d.measure(model, x)
    assert cpu.device == "cpu" and cpu.seconds is not None and cpu.seconds > 0
    meta = remat3d.measure(model, x, device="meta")
    assert meta.seconds is None
    assert (meta.peak_bytes, meta.flops) == (cpu.peak_bytes, cpu.flops)
    assert cpu.flops == cpu.forward_flops + cpu.backward_flops and cpu.recompute_flops == 0


def test_custom_loss_is_measured():
    model = _small_unet()
    x = torch.randn(1, 1, 16, 16, 16)
    target = torch.randint(0, 2, (1, 16, 16, 16))
    plain = remat3d.profile(model, x)
    ce = remat3d.profile(model, x, loss_fn=lambda y: nn.functional.cross_entropy(y, target),
                         device="cpu")
    assert ce.saved_bytes > plain.saved_bytes  # cross-entropy keeps its log-softmax
    meta_target = target.to("meta")
    ce_meta = remat3d.profile(model, x,
                              loss_fn=lambda y: nn.functional.cross_entropy(y, meta_target))
    assert ce_meta.saved_bytes == ce.saved_bytes
    with pytest.raises(Remat3dError, match="target.to"):
        remat3d.profile(model, x, loss_fn=lambda y: nn.functional.cross_entropy(y, target))


@pytest.mark.parametrize("call, match", [
    (lambda: remat3d.profile("nnunet", (1, 1, 8, 8, 8)), "nn.Module"),
    (lambda: remat3d.profile(nn.Conv3d(1, 1, 3)), "at least one example input"),
    (lambda: remat3d.profile(nn.Conv3d(1, 1, 3), torch.empty(1, 1, 8, 8, 8, device="meta"),
                             device="cpu"), "meta device and has no data"),
    (lambda: remat3d.profile(nn.Conv3d(1, 1, 3), (1, 1, 8, 8, 8), amp="fp8"), "bf16"),
    (lambda: remat3d.profile(nn.Conv3d(1, 1, 3), (1, 1, 8, 8, 8), loss_fn=lambda y: y),
     "scalar"),
    (lambda: remat3d.profile(nn.Conv3d(1, 1, 3), (1, 1, 8, 8, 8), device="tpu"),
     "not usable"),
])
def test_clear_errors(call, match):
    with pytest.raises(Remat3dError, match=match):
        call()


def test_profile_of_a_planned_model_names_recomputed_nodes():
    from remat3d import Plan, Region

    model = zoo.build_model("basicunet", device="meta")
    remat3d.apply(model, Plan(regions=[Region("conv_0"), Region("upcat_1")]))
    prof = remat3d.profile(model, (1, 1, 32, 32, 32))
    names = {n.name for n in prof.graph.nodes}
    recomputed = [e for e in prof.timeline if e["phase"] == "recompute"]
    assert recomputed and all(e["node"] is None or prof.graph.nodes[e["node"]].name in names
                              for e in recomputed)
    assert isinstance(prof.peak_node, str) and prof.summary()


def test_a_module_that_writes_into_its_input_is_marked():
    """The planner never makes such a module a recompute region of its own (its
    recomputation would start from the overwritten values): the profile says which."""
    from torch import nn

    import remat3d

    net = nn.Sequential(nn.Conv3d(1, 2, 3), nn.ReLU(inplace=True), nn.Conv3d(2, 2, 1),
                        nn.ReLU())
    graph = remat3d.profile(net, (1, 1, 8, 8, 8)).graph
    assert {n.name: n.writes_input for n in graph.nodes} == {
        "": False, "0": False, "1": True, "2": False, "3": False}
    assert remat3d.CostGraph.from_dict(graph.to_dict()).nodes[2].writes_input

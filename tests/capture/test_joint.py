"""Capturing a step as one joint aten graph (capture/joint.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat3d.capture.joint import capture
from remat3d.errors import CaptureError
from remat3d.instrument.step import meta_copy
from remat3d.opgraph import OpGraph
from tests.capture.nets import ParentConcat


def test_the_parents_own_ops_are_nodes_of_the_graph():
    torch.manual_seed(0)
    graph = capture(ParentConcat(), (1, 1, 8, 8, 8)).graph
    forward_ops = [n.op for n in graph.forward]
    assert "cat" in forward_ops and "relu" in forward_ops  # run by forward itself
    assert forward_ops.count("convolution") == 5
    # one gradient per parameter, none for the input
    assert len(graph.gradients) == len(list(ParentConcat().parameters()))
    # the model's output, and BatchNorm's updated statistics (copied into its buffers)
    out = [graph[n] for n in graph.outputs if graph[n].op == "convolution"]
    assert len(out) == 1 and out[0].bytes == 2 * 8**3 * 4
    cat = next(n for n in graph.forward if n.op == "cat")
    assert cat.bytes == 8 * 8**3 * 4 and cat.flops == 0
    assert all(n.bytes == 0 for n in graph.nodes if n.base is not None)  # views own nothing


def test_each_node_names_the_module_whose_forward_ran_it():
    # capture/joint.py NOTE rule 10
    import torch.fx.traceback as fx_traceback

    model = ParentConcat()
    graph = capture(model, (1, 1, 8, 8, 8)).graph
    module = {n.op: n.module for n in graph.forward}
    assert module["cat"] == "" and module["relu"] == ""  # the model's own forward
    assert module["_prelu_kernel"] == "enc.2"
    assert [n.module for n in graph.forward if n.op == "convolution"] == [
        "enc.0", "down", "up", "dec.0", "head"]
    backward = {n.op: n.module for n in graph.backward}
    assert backward["_prelu_kernel_backward"] == "enc.2"  # its forward node's
    # the annotations went with the traced copy, even where its forward raised
    with pytest.raises(CaptureError):
        capture(_ValueDependent(), (1, 1, 8, 8, 8))
    assert "custom" not in fx_traceback.current_meta
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_a_meta_model_is_traced_without_memory_and_with_every_gradient():
    # PReLU traced from meta tensors lost its backward (capture/joint.py NOTE rule 3)
    torch.manual_seed(0)
    model = meta_copy(ParentConcat(norm="instance"))
    graph = capture(model, (1, 1, 64, 64, 64)).graph  # 64³: traced, never allocated
    assert len(graph.gradients) == len(list(model.parameters()))
    assert sum(n.op == "_prelu_kernel_backward" for n in graph.backward) == 1
    assert all(p.device.type == "meta" for p in model.parameters())  # not changed


def test_the_graph_round_trips_through_json():
    graph = capture(ParentConcat(), (1, 1, 8, 8, 8)).graph
    again = OpGraph.from_dict(__import__("json").loads(graph.to_json()))
    assert again.to_dict() == graph.to_dict()


class _ValueDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y * 2 if y.sum().item() > 0 else y  # control flow on a tensor's value


def test_a_forward_that_cannot_be_traced_is_one_clear_error():
    with pytest.raises(CaptureError) as err:
        capture(_ValueDependent(), (1, 1, 8, 8, 8))
    message = str(err.value)
    assert message.startswith("_ValueDependent's step could not be traced as one graph")
    assert "module plans" in message


def test_functionalization_copies_of_an_in_place_activation_are_elided():
    # the decoder's in-place LeakyReLU: its functionalized backward copied the gradient
    # three times (copy of a new_empty_strided, clone, copy back); eager makes none
    # (after an InstanceNorm; after a BatchNorm torch makes no copies)
    torch.manual_seed(0)
    graph = capture(ParentConcat("instance"), (1, 1, 8, 8, 8)).graph
    assert "leaky_relu_backward" in [n.op for n in graph.backward]
    assert not [n.name for n in graph.nodes if n.op in ("copy", "clone", "new_empty_strided")]

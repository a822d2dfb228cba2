"""Exact liveness of graph plans on hand-made graphs (planner/liveness.py)."""

from __future__ import annotations

from remat3d.opgraph import OpGraph, OpNode
from remat3d.planner.liveness import closed_recompute, simulate

KB = 1024


def chain() -> OpGraph:
    """x -> a = conv(x) -> b = relu(a) -> out = conv(b); backward reads x, a (relu's mask
    through its output b) and b."""
    nodes = [
        OpNode("x", "input", "input", bytes=KB),
        OpNode("w", "input", "input", bytes=10),
        OpNode("a", "convolution", "forward", ["x", "w"], bytes=4 * KB, flops=1000),
        OpNode("b", "relu", "forward", ["a"], bytes=4 * KB),
        OpNode("bv", "detach", "forward", ["b"], base="b"),
        OpNode("out", "convolution", "forward", ["b", "w"], bytes=2 * KB, flops=500),
        OpNode("tangents_1", "tangent", "tangent", bytes=2 * KB),
        OpNode("cb", "convolution_backward", "backward", ["tangents_1", "b", "w"]),
        OpNode("gb", "getitem", "backward", ["cb"], bytes=4 * KB),
        OpNode("gw", "getitem", "backward", ["cb"], bytes=10),
        OpNode("tb", "threshold_backward", "backward", ["gb", "bv"], bytes=4 * KB),
        OpNode("cb2", "convolution_backward", "backward", ["tb", "x", "w"]),
        OpNode("gw2", "getitem", "backward", ["cb2"], bytes=10),
    ]
    return OpGraph("chain", [[1]], nodes, outputs=["out"], gradients=["gw", "gw2"])


def test_saving_everything_backward_needs():
    live = simulate(chain())
    # forward: x, w, a (freed after b), b (saved), out (held): peak at b's op, a still
    # alive. backward: + tangent, + conv's input grad and weight grad (the tangent freed
    # after it), then threshold's output beside them
    assert live.forward_peak_bytes == KB + 10 + 4 * KB + 4 * KB
    assert live.saved_bytes == 4 * KB  # b; a is not read by backward
    resident = KB + 10 + 2 * KB  # x, w, out
    assert live.backward_peak_bytes == resident + 4 * KB + (4 * KB + 10) + 4 * KB
    assert live.recompute_flops == 0 and live.peak_bytes == live.backward_peak_bytes


def test_recomputing_pulls_the_op_in_just_before_backward_needs_it():
    graph = chain()
    live = simulate(graph, ["b"])
    # b and its view are recomputed from a, which is now saved instead
    assert live.saved_bytes == 4 * KB and live.recompute_ops == 2
    names = [n for n, _ in live.timeline]
    backward = names[names.index("out") + 1:]
    assert backward[:3] == ["b", "cb", "bv"]  # each recomputed right before its first reader
    # recomputing the convolution too: its inputs are saved, its flops counted
    both = simulate(graph, ["a", "b"])
    assert both.recompute_flops == 1000 and both.saved_bytes == 0


def test_views_and_picks_go_with_their_storage():
    graph = chain()
    assert closed_recompute(graph, ["b"]) == {"b", "bv"}
    assert closed_recompute(graph, ["cb"]) == set()  # not a forward node
    graph["b"].recomputable = False
    assert closed_recompute(graph, ["b"]) == set()

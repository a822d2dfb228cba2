"""Exact liveness of graph plans on hand-made graphs (planner/liveness.py)."""

from __future__ import annotations

import dataclasses
import itertools

from remat3d.opgraph import OpGraph, OpNode
from remat3d.planner.liveness import closed_recompute, recompute_floor, simulate

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
    # (a graph is not changed once made: its indexes are built with it)
    nodes = [dataclasses.replace(n, recomputable=n.name != "b") for n in graph.nodes]
    fixed = OpGraph("chain", [[1]], nodes, outputs=["out"], gradients=["gw", "gw2"])
    assert closed_recompute(fixed, ["b"]) == set()


def skip() -> OpGraph:
    """An encoder output ``s`` read by the decoder's first backward op and by the
    encoder's last: recomputed once, it lives across the backward's middle."""
    nodes = [
        OpNode("x", "input", "input", bytes=KB),
        OpNode("w", "input", "input", bytes=10),
        OpNode("s", "relu", "forward", ["x"], bytes=8 * KB),
        OpNode("d", "convolution", "forward", ["s", "w"], bytes=KB, flops=100),
        OpNode("u", "cat", "forward", ["d", "s"], bytes=9 * KB),
        OpNode("out", "convolution", "forward", ["u", "w"], bytes=KB, flops=100),
        OpNode("tangents_1", "tangent", "tangent", bytes=KB),
        OpNode("c1", "convolution_backward", "backward", ["tangents_1", "u", "w"]),
        OpNode("g1", "getitem", "backward", ["c1"], bytes=9 * KB),
        OpNode("m", "mul", "backward", ["g1"], bytes=9 * KB),  # the backward's middle
        OpNode("big", "mul", "backward", ["m"], bytes=16 * KB),
        OpNode("small", "sum", "backward", ["big"], bytes=KB),
        OpNode("c2", "convolution_backward", "backward", ["small", "s", "w"]),
        OpNode("g2", "getitem", "backward", ["c2"], bytes=10),
    ]
    return OpGraph("skip", [[1]], nodes, outputs=["out"], gradients=["g2"])


def test_late_copies_are_placed_before_the_first_late_reader():
    from remat3d.planner.liveness import AGAIN, late_copies

    order = [("a", ["x"]), ("b", ["a"]), ("r1", ["b"]), ("mid", []), ("mid2", []),
             ("r2", ["b", "a"]), ("r3", ["b"])]
    steps = late_copies(order, {"a", "b"})
    names = [n for n, _, _ in steps]
    # b's readers split after r1 (the largest gap); the copy of a reads nothing new
    assert names == ["a", "b", "r1", "mid", "mid2", "a" + AGAIN, "b" + AGAIN, "r2", "r3"]
    by_name = {n: (src, ins) for n, src, ins in steps}
    assert by_name["b" + AGAIN] == ("b", ["a" + AGAIN])
    assert by_name["r2"][1] == ["b" + AGAIN, "a" + AGAIN]
    assert by_name["r3"][1] == ["b" + AGAIN] and by_name["r1"][1] == ["b"]
    # adjacent readers are never split; a node outside `again` never is
    assert late_copies([("a", []), ("r1", ["a"]), ("r2", ["a"])], {"a"}) == \
        [("a", "a", []), ("r1", "r1", ["a"]), ("r2", "r2", ["a"])]
    assert [n for n, _, _ in late_copies(order, {"b"})].count("a" + AGAIN) == 0


def test_recomputing_twice_frees_the_skip_across_the_middle():
    graph = skip()
    once = simulate(graph, ["s", "u"])
    twice = simulate(graph, ["s", "u"], twice=["s"])
    # once: s (8 KB) lives from u's recomputation to c2, over `big`; twice: it does not
    assert once.peak_bytes - twice.peak_bytes == 8 * KB
    assert twice.recomputed.count("s") == 2 and once.recomputed.count("s") == 1
    # a node recomputed twice must be recomputed: twice alone changes nothing
    assert simulate(graph, [], twice=["s"]).peak_bytes == simulate(graph).peak_bytes


def _every_plan(graph: OpGraph):
    """Every recompute set of the graph's forward nodes, each with every twice set."""
    names = [n.name for n in graph.forward if n.op != "getitem" and n.base is None]
    for k in range(len(names) + 1):
        for chosen in itertools.combinations(names, k):
            for j in range(len(chosen) + 1):
                for twice in itertools.combinations(chosen, j):
                    yield set(chosen), set(twice)


def test_the_recompute_floor_is_at_or_below_every_plans_peak():
    for graph in (chain(), skip()):
        floor = recompute_floor(graph)
        peaks = [simulate(graph, chosen, twice=twice).peak_bytes
                 for chosen, twice in _every_plan(graph)]
        assert floor.bytes <= min(peaks), graph.model
    # the chain's floor is the backward's peak saving everything: at threshold's backward
    # its saved input b, its output, the conv's input gradient and weight gradient live
    # beside the inputs and the output whatever is recomputed
    floor = recompute_floor(chain())
    assert floor.node == "tb"
    assert floor.bytes == simulate(chain()).backward_peak_bytes == (
        (KB + 10 + 2 * KB) + 3 * 4 * KB + 10)
    # the skip network's at the backward's middle: `big` beside `m` it is made from
    floor = recompute_floor(skip())
    assert (floor.node, floor.bytes) == ("big", (KB + 10 + KB) + 16 * KB + 9 * KB)

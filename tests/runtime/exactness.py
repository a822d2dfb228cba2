"""Shared helpers: run one training step and compare two models bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import remat3d
from remat3d import Plan, Region
from remat3d.runtime.spans import spanned_copy, spans_for


def train_step(model: nn.Module, x: torch.Tensor, amp: str | None = None, seed: int = 0):
    """One step; returns (outputs, {param: grad}, {buffer: value}) as detached copies."""
    torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = None
    model.train()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp == "bf16" else _null()
    with ctx:
        out = model(x)
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        loss = sum((t.float() ** 2).mean() for t in leaves)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return [t.detach().clone() for t in leaves], grads, buffers


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def assert_exact(model: nn.Module, x: torch.Tensor, plan: Plan, amp: str | None = None) -> Any:
    """The planned model's outputs, gradients and buffers equal the unplanned model's."""
    reference = copy.deepcopy(model)
    planned = copy.deepcopy(model)
    remat3d.apply(planned, plan)
    try:
        want = train_step(reference, x, amp)
        got = train_step(planned, x, amp)
        report = remat3d.report(planned)
    finally:
        remat3d.remove(planned)
    _same(want, got)
    return report


def _same(want, got) -> None:
    outs_w, grads_w, bufs_w = want
    outs_g, grads_g, bufs_g = got
    assert len(outs_w) == len(outs_g)
    for a, b in zip(outs_w, outs_g):
        assert torch.equal(a, b), "outputs differ"
    assert grads_w.keys() == grads_g.keys(), set(grads_w) ^ set(grads_g)
    for name in grads_w:
        assert torch.equal(grads_w[name], grads_g[name]), f"gradient of {name} differs"
    for name in bufs_w:
        assert torch.equal(bufs_w[name], bufs_g[name]), f"buffer {name} differs"


def inplace_modules(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if getattr(m, "inplace", False)}


def plans_for(model: nn.Module, x: torch.Tensor) -> dict[str, Plan]:
    """The plan families the acceptance asks for: every node, every block, nested, each
    op policy, offload. Modules that write in place into their input (in-place
    activations) cannot be a region on their own and are left out of 'every node'."""
    graph = remat3d.profile(model, tuple(x.shape)).graph
    spans = spans_for(model, graph)  # a parent's own ops as units, as plan() makes them
    if spans:
        graph = remat3d.profile(spanned_copy(model, spans), tuple(x.shape)).graph
    skip = inplace_modules(model)
    leaves = _unique(n.name for n in graph.leaves() if n.name not in skip)
    blocks = _unique(n.name for n in graph.blocks())
    inner = _unique(graph.nodes[c].name for b in graph.blocks() for c in b.children
                    if graph.nodes[c].name not in skip)

    def regions(names, **kw):
        return [Region(n, **kw) for n in names]

    return {
        "every-node": Plan(regions=regions(leaves), spans=spans),
        "every-block": Plan(regions=regions(blocks), spans=spans),
        "nested": Plan(regions=regions(blocks) + regions(inner), spans=spans),
        "save-compute-heavy": Plan(regions=regions(blocks, policy="save-compute-heavy"),
                                   spans=spans),
        "save-norm-and-pool": Plan(regions=regions(blocks, policy="save-norm-and-pool"),
                                   spans=spans),
        "offload": Plan(regions=regions(blocks, decision="offload"), offload_min_bytes=0,
                        spans=spans),
    }


def _unique(names) -> list[str]:
    return list(dict.fromkeys(n for n in names if n))

"""Property test: random plans over random small conv/norm/activation/skip models stay exact."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from remat3d import Plan, Region

from .exactness import assert_exact

C = 4
LAYERS = ["conv", "bn", "in", "gn", "relu", "lrelu", "gelu", "drop"]


def make_layer(kind: str, inplace: bool) -> nn.Module:
    return {
        "conv": lambda: nn.Conv3d(C, C, 3, padding=1),
        "bn": lambda: nn.BatchNorm3d(C),
        "in": lambda: nn.InstanceNorm3d(C, affine=True),
        "gn": lambda: nn.GroupNorm(2, C),
        "relu": lambda: nn.ReLU(inplace=inplace),
        "lrelu": lambda: nn.LeakyReLU(0.1, inplace=inplace),
        "gelu": lambda: nn.GELU(),
        "drop": lambda: nn.Dropout3d(0.3),
    }[kind]()


class RandomNet(nn.Module):
    def __init__(self, blocks: list[list[tuple[str, bool]]], skips: list[int | None]) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, C, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(*[make_layer(k, inplace) for k, inplace in layers])
            for layers in blocks)
        self.skips = skips
        self.head = nn.Conv3d(C, 1, 1)

    def forward(self, x):
        h = self.stem(x)
        outs = [h]
        for block, skip in zip(self.blocks, self.skips):
            h = block(h)
            if skip is not None:
                h = h + outs[skip % len(outs)]  # a skip connection
            outs.append(h)
        return self.head(h)


# An in-place activation is valid only where its input is not needed for backward: after
# a conv, a norm or dropout, and never as a block's first layer (that would overwrite the
# previous block's output, which a skip connection still reads).
_SAFE_BEFORE_INPLACE = {"conv", "bn", "in", "gn", "drop"}


def _legal(layers: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    return [(kind, inplace and i > 0 and layers[i - 1][0] in _SAFE_BEFORE_INPLACE
             and kind in ("relu", "lrelu"))
            for i, (kind, inplace) in enumerate(layers)]


layer = st.tuples(st.sampled_from(LAYERS), st.booleans())
architecture = st.lists(st.lists(layer, min_size=1, max_size=4).map(_legal),
                        min_size=1, max_size=4)


@st.composite
def model_and_plan(draw):
    blocks = draw(architecture)
    skips = [draw(st.none() | st.integers(0, 8)) for _ in blocks]
    model = RandomNet(blocks, skips)
    regions = []
    for b, layers in enumerate(blocks):
        choice = draw(st.sampled_from(["none", "block", "layers", "nested", "segment"]))
        decision = draw(st.sampled_from(["recompute", "recompute", "offload"]))
        policy = draw(st.sampled_from([None, "save-compute-heavy", "save-norm-and-pool"]))
        kw = {"decision": decision, "policy": policy if decision == "recompute" else None}
        lone = [str(i) for i, (kind, inplace) in enumerate(layers) if not inplace]
        if choice in ("block", "nested"):
            regions.append(Region(f"blocks.{b}", **kw))
        if choice in ("layers", "nested"):
            picked = draw(st.lists(st.sampled_from(lone), unique=True, max_size=len(lone)))
            regions += [Region(f"blocks.{b}.{i}") for i in picked]
        if choice == "segment" and len(layers) >= 2:
            start = draw(st.integers(0, len(layers) - 2))
            stop = draw(st.integers(start + 2, len(layers)))
            names = [str(i) for i in range(start, stop)]
            if names[0] in lone:
                regions.append(Region(f"blocks.{b}", segment=names, **kw))
    return model, Plan(regions=regions, offload_min_bytes=0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_plan(), st.integers(0, 2**16))
def test_random_plans_are_exact(case, seed):
    model, plan = case
    torch.manual_seed(seed)
    x = torch.randn(2, 1, 6, 6, 6)
    assert_exact(model, x, plan)

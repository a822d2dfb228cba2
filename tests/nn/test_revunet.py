"""The partially reversible U-Net and its ``revunet`` preset."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import remat3d
from remat3d import zoo
from remat3d.errors import ModelSpecError
from remat3d.nn import ReversibleError, ReversibleSequence, RevUNet
from tests.nn.nets import max_relative_error, step


def tiny(**kwargs) -> RevUNet:
    return RevUNet(channels=(4, 8, 16), blocks=1, **kwargs)


def test_preset_builds_with_reversible_levels():
    model = zoo.build_model("revunet")
    sequences = [m for m in model.modules() if isinstance(m, ReversibleSequence)]
    assert len(sequences) == 7  # 4 encoder levels (bottleneck included) + 3 decoder levels
    assert all(s.reversible and len(s) == 2 for s in sequences)
    with pytest.raises(ModelSpecError, match="even"):
        zoo.build_model("revunet", {"channels": [16, 33]})


def test_gradients_match_the_same_network_with_ordinary_backward():
    torch.manual_seed(0)
    model = tiny()
    twin = tiny(reversible=False)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(1, 1, 16, 16, 16)
    y_ref, dx_ref, grads_ref = step(twin, x)
    y, dx, grads = step(model, x)
    assert torch.equal(y, y_ref)
    assert max_relative_error(grads_ref, grads) <= 1e-4
    assert max_relative_error(dx_ref, dx) <= 1e-4


def test_loss_falls_on_a_synthetic_segmentation_task():
    torch.manual_seed(0)
    model = tiny()
    grid = torch.stack(torch.meshgrid(*[torch.linspace(-1, 1, 16)] * 3, indexing="ij"))
    images, labels = [], []
    for _ in range(4):  # a bright ball at a random place in noise: segment the ball
        centre = torch.rand(3, 1, 1, 1) - 0.5
        ball = ((grid - centre).square().sum(0) < 0.25).long()
        images.append(ball.float() + 0.3 * torch.randn(16, 16, 16))
        labels.append(ball)
    x, target = torch.stack(images)[:, None], torch.stack(labels)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_saved_bytes_do_not_grow_with_blocks_per_level():
    shape = (1, 1, 32, 32, 32)
    one = remat3d.measure(RevUNet(channels=(8, 16), blocks=1), shape, device="meta")
    four = remat3d.measure(RevUNet(channels=(8, 16), blocks=4), shape, device="meta")
    ordinary = remat3d.measure(RevUNet(channels=(8, 16), blocks=4, reversible=False), shape,
                               device="meta")
    assert four.saved_bytes == one.saved_bytes
    assert ordinary.saved_bytes > 3 * four.saved_bytes
    assert four.recompute_flops > 0


def test_constructor_errors_are_clear():
    with pytest.raises(ReversibleError, match=r"positive and even .*\(5 is not\)"):
        RevUNet(channels=(4, 5))
    with pytest.raises(ReversibleError, match="one positive int per level"):
        RevUNet(channels=(4, 8), blocks=(1, 2, 3))

"""remat3d.checkpoint: the guarantees beyond torch.utils.checkpoint."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat3d
from remat3d.runtime.region import InPlaceInputError


def test_batchnorm_statistics_update_once():
    torch.manual_seed(0)
    bn_plain = nn.Sequential(nn.Conv3d(1, 3, 3), nn.BatchNorm3d(3, momentum=None))
    bn_ckpt = __import__("copy").deepcopy(bn_plain)
    x = torch.randn(2, 1, 8, 8, 8, requires_grad=True)
    bn_plain(x).sum().backward()
    remat3d.checkpoint(bn_ckpt, x).sum().backward()
    for a, b in zip(bn_plain.buffers(), bn_ckpt.buffers()):
        assert torch.equal(a, b)
    assert int(bn_ckpt[1].num_batches_tracked) == 1


def test_batchnorm_as_the_region_module_itself():
    bn = nn.BatchNorm3d(2)
    x = torch.randn(2, 2, 4, 4, 4, requires_grad=True)
    remat3d.checkpoint(bn, x).sum().backward()
    assert int(bn.num_batches_tracked) == 1


def test_is_recomputing_only_inside_recomputation():
    seen = []

    def fn(x):
        seen.append(remat3d.is_recomputing())
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    remat3d.checkpoint(fn, x).sum().backward()
    assert seen == [False, True]
    assert not remat3d.is_recomputing()


def test_dropout_mask_is_replayed():
    drop = nn.Dropout(0.5)
    x = torch.randn(1000, requires_grad=True)
    torch.manual_seed(3)
    y = remat3d.checkpoint(drop, x)
    y.sum().backward()
    torch.manual_seed(3)
    x2 = x.detach().clone().requires_grad_()
    drop(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_frozen_parameters_and_inputs_without_grad():
    torch.manual_seed(0)
    frozen = nn.Conv3d(1, 2, 3)
    frozen.requires_grad_(False)
    head = nn.Conv3d(2, 1, 1)
    x = torch.randn(1, 1, 6, 6, 6)  # no requires_grad anywhere before `head`

    def block(t):
        return head(torch.relu(frozen(t)))

    block(x).sum().backward()
    want = head.weight.grad.clone()
    head.weight.grad = None
    remat3d.checkpoint(block, x).sum().backward()
    assert torch.equal(head.weight.grad, want)
    assert frozen.weight.grad is None


def test_inplace_op_on_region_input_is_refused_with_the_region_name():
    act = nn.LeakyReLU(0.01, inplace=True)
    x = torch.randn(8, requires_grad=True) * 1
    with pytest.raises(InPlaceInputError, match="writes in place into its own input"):
        remat3d.checkpoint(act, x, name="encoder.act")


def test_inplace_op_at_region_output_is_fine():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv3d(1, 2, 3), nn.InstanceNorm3d(2, affine=True))
    act = nn.LeakyReLU(0.01, inplace=True)
    x = torch.randn(1, 1, 6, 6, 6)
    (act(block(x)) ** 2).sum().backward()
    want = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    (act(remat3d.checkpoint(block, x)) ** 2).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(want, block.parameters()))


def test_policies_keep_what_they_say():
    from remat3d.runtime.policies import resolve_policy

    keep_conv = resolve_policy("save-compute-heavy")
    assert torch.ops.aten.convolution in keep_conv.kept_ops
    assert torch.ops.aten.native_batch_norm in resolve_policy("save-norm-and-pool").kept_ops
    assert resolve_policy(["convolution", "aten.mm"]).kept_ops == {
        torch.ops.aten.convolution, torch.ops.aten.mm}
    assert resolve_policy("recompute-all") is None
    with pytest.raises(remat3d.Remat3dError, match="Unknown op policy"):
        resolve_policy("save-everything")
    with pytest.raises(remat3d.Remat3dError, match="Unknown aten op"):
        resolve_policy(["not_an_op"])


def test_policy_reduces_recomputed_flops():
    block = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.InstanceNorm3d(4), nn.ReLU(),
                          nn.Conv3d(4, 4, 3, padding=1))
    x = (1, 1, 8, 8, 8)

    class Wrap(nn.Module):
        def __init__(self, policy):
            super().__init__()
            self.block, self.policy = block, policy

        def forward(self, t):
            return remat3d.checkpoint(self.block, t, policy=self.policy)

    all_ = remat3d.measure(Wrap(None), x, device="meta")
    heavy = remat3d.measure(Wrap("save-compute-heavy"), x, device="meta")
    assert all_.recompute_flops > 0 and heavy.recompute_flops == 0
    assert heavy.saved_bytes > all_.saved_bytes


def test_checkpoint_offload_inputs_on_cpu_is_exact():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 2, 1))
    x = torch.randn(1, 2, 16, 16, 16, requires_grad=True)
    (block(x) ** 2).sum().backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad(set_to_none=True)
    y = remat3d.checkpoint(block, x, offload=True)
    (y ** 2).sum().backward()
    got = [x.grad] + [p.grad for p in block.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(want, got))

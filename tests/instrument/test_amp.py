"""CUDA autocast reproduced on meta tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat3d.errors import Remat3dError
from remat3d.instrument import amp as amp_mod
from remat3d.instrument.amp import MetaAutocast, amp_dtype


def test_dtypes_follow_cuda_autocast():
    conv = nn.Conv3d(2, 4, 3, padding=1).to("meta")
    x = torch.empty(1, 2, 8, 8, 8, device="meta")
    with MetaAutocast(torch.bfloat16):
        y = conv(x)
        assert y.dtype == torch.bfloat16                      # lower-precision list
        assert F.instance_norm(y).dtype == torch.bfloat16     # not listed: input dtype
        assert F.leaky_relu(y).dtype == torch.bfloat16
        assert F.group_norm(y, 2).dtype == torch.float32      # fp32 list
        assert F.interpolate(y, scale_factor=2).dtype == torch.float32  # upsampling: fp32
        assert y.sum().dtype == torch.float32                 # fp32 unless dtype given
        assert y.sum(dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.softmax(y, 1).dtype == torch.float32
        assert (y @ y.transpose(-1, -2)).dtype == torch.bfloat16
        assert torch.cat([y, conv.weight.new_empty(y.shape)]).dtype == torch.float32  # promotion
        lin = nn.Linear(8, 8).to("meta")
        assert lin(x).dtype == torch.bfloat16
        assert F.layer_norm(lin(x), (8,)).dtype == torch.float32
    assert conv(x).dtype == torch.float32                     # outside: untouched


def test_weight_casts_are_cached_within_the_context():
    conv = nn.Conv3d(2, 2, 3).to("meta")
    x = torch.empty(1, 2, 8, 8, 8, device="meta")
    mode = MetaAutocast(torch.float16)
    with mode:
        conv(x)
        conv(x)
        assert len(mode._cache) == 2  # weight and bias, cast once each

def test_a_cast_made_on_fake_tensors_is_not_kept_for_the_real_step():
    # a tiled run is traced on fake tensors inside the step's autocast; its weight casts
    # must not be cached, or every later op of the step runs on fake tensors (slowly)
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    conv = nn.Conv3d(2, 2, 3).to("meta")
    x = torch.empty(1, 2, 8, 8, 8, device="meta")
    mode = MetaAutocast(torch.bfloat16)
    with mode:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            assert isinstance(conv(fake.from_tensor(x)), FakeTensor)
        assert not mode._cache
        y = conv(x)
        assert not isinstance(y, FakeTensor) and y.dtype == torch.bfloat16
        assert len(mode._cache) == 2

    assert not mode._cache


def test_backward_runs_in_cast_dtypes():
    conv = nn.Conv3d(1, 2, 3).to("meta")
    x = torch.empty(1, 1, 8, 8, 8, device="meta")
    with MetaAutocast(torch.bfloat16):
        loss = conv(x).float().mean()
    loss.backward()
    assert conv.weight.grad.dtype == torch.float32  # grads flow back through the cast


def test_lists_match_the_installed_autocast_header():
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        pytest.skip("this torch build ships no ATen headers")
    text = header.read_text()

    def block(macro):
        start = text.index(f"#define {macro}(_)")
        end = text.index("\n\n", start)
        return {line.split("(")[1].split(")")[0].split(",")[0].strip()
                for line in text[start:end].splitlines()[1:] if "_(" in line}

    assert block("AT_FORALL_LOWER_PRECISION_FP") == amp_mod.LOWER_PRECISION_OPS
    assert block("AT_FORALL_FP32") == amp_mod.FP32_OPS
    assert block("AT_FORALL_FP32_SET_OPT_DTYPE") <= amp_mod.FP32_SET_OPT_DTYPE_OPS
    assert block("AT_FORALL_PROMOTE") == amp_mod.PROMOTE_OPS


@pytest.mark.parametrize("text, dtype", [(None, None), ("none", None), ("bf16", torch.bfloat16),
                                         ("fp16", torch.float16)])
def test_amp_dtype(text, dtype):
    assert amp_dtype(text) == dtype


def test_amp_dtype_rejects_unknown():
    with pytest.raises(Remat3dError, match="none, bf16, fp16"):
        amp_dtype("fp8")

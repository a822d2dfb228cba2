"""Tests of remat3d.zoo: presets build and run at their documented shapes, specs fail clearly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat3d import zoo
from remat3d.errors import InputShapeError, ModelSpecError

# MONAI's TransformerBlock always creates a cross-attention norm, used only with cross-attention.
# nnU-Net v2's networks keep a segmentation head per decoder stage for deep supervision;
# without it only the last one is used
_DEEP_SUPERVISION_HEADS = tuple(f"decoder.seg_layers.{i}." for i in range(4))
UNUSED_PARAMETERS = {"unetr": ("norm_cross_attn",), "nnunetv2": _DEEP_SUPERVISION_HEADS,
                     "resenc-l": _DEEP_SUPERVISION_HEADS}
# More than a few seconds for a CPU forward+backward at the smallest legal size on 2 cores.
SLOW_ON_CPU = {"nnunet", "swinunetr"}


def expected_output_shape(preset: zoo.Preset) -> tuple[int, ...]:
    batch, _, *spatial = zoo.smallest_input_shape(preset)
    if preset.task == "classification":
        return (batch, preset.out_channels)
    return (batch, preset.out_channels, *spatial)


def meta_forward(model: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    with torch.device("meta"):
        return model(torch.zeros(shape))


@pytest.mark.parametrize("name", zoo.preset_names())
def test_preset_builds_and_runs_on_meta_at_smallest_shape(name: str) -> None:
    preset = zoo.get_preset(name)
    shape = zoo.smallest_input_shape(preset)
    model = zoo.build_model(name, spatial_size=shape[2:], device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())
    zoo.check_input_shape(preset, shape)
    assert tuple(meta_forward(model, shape).shape) == expected_output_shape(preset)


def runs_correctly(name: str, size: tuple[int, int, int]) -> bool:
    """Whether the preset runs at ``size`` on meta and (if dense) returns that size."""
    model = zoo.build_model(name, spatial_size=size, device="meta")
    try:
        out = meta_forward(model, (1, 1, *size))
    except (RuntimeError, ValueError):
        return False
    return zoo.get_preset(name).task == "classification" or tuple(out.shape[2:]) == size


@pytest.mark.parametrize("name", zoo.preset_names())
def test_documented_minimum_is_tight_and_divisor_is_needed(name: str) -> None:
    preset = zoo.get_preset(name)
    below = preset.min_size - preset.divisor
    if below > 0:
        with pytest.raises(InputShapeError, match="at least"):
            zoo.check_input_shape(preset, (1, 1, below, below, below))
        assert not runs_correctly(name, (below,) * 3)
    if preset.divisor > 1:
        ragged = preset.min_size + preset.divisor // 2
        with pytest.raises(InputShapeError, match="divisible by"):
            zoo.check_input_shape(preset, (1, 1, ragged, ragged, ragged))
        assert not runs_correctly(name, (ragged,) * 3)


@pytest.mark.parametrize("name", ["basicunet", "resnet3d"])
def test_divisor_one_presets_accept_any_size_from_the_minimum(name: str) -> None:
    preset = zoo.get_preset(name)
    shape = (1, 1, preset.min_size, preset.min_size + 13, preset.min_size + 5)
    zoo.check_input_shape(preset, shape)
    model = zoo.build_model(name, device="meta")
    out = meta_forward(model, shape)
    assert tuple(out.shape) == ((1, 2, *shape[2:]) if preset.task == "segmentation" else (1, 2))


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_ON_CPU else n for n in zoo.PRESETS],
)
def test_preset_trains_on_cpu_at_smallest_shape(name: str) -> None:
    torch.manual_seed(0)
    preset = zoo.get_preset(name)
    shape = zoo.smallest_input_shape(preset)
    model = zoo.build_model(name, spatial_size=shape[2:], device="cpu")
    out = model(torch.randn(shape))
    assert tuple(out.shape) == expected_output_shape(preset)
    out.float().square().mean().backward()
    unused = UNUSED_PARAMETERS.get(name, ())
    for param_name, param in model.named_parameters():
        if any(part in param_name for part in unused):
            continue
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name


def test_kwargs_override_preset_defaults() -> None:
    model = zoo.build_model("unet", {"out_channels": 3, "channels": (4, 8), "strides": (2,)})
    assert model(torch.randn(2, 1, 8, 8, 8)).shape == (2, 3, 8, 8, 8)
    resnet = zoo.build_model("resnet3d", {"in_channels": 2, "out_channels": 5}, device="meta")
    assert tuple(meta_forward(resnet, (1, 2, 17, 17, 17)).shape) == (1, 5)
    zoo.check_input_shape("resnet3d", (1, 2, 17, 17, 17), {"in_channels": 2})


def test_nnunet_strides_override_keeps_the_nnunet_rule() -> None:
    model = zoo.build_model("nnunet", {"strides": [1, 2, 2]}, device="meta")
    assert tuple(meta_forward(model, (1, 1, 8, 8, 8)).shape) == (1, 2, 8, 8, 8)


def test_unetr_needs_a_spatial_size() -> None:
    with pytest.raises(ModelSpecError, match="spatial_size"):
        zoo.build_model("unetr", device="meta")
    model = zoo.build_model("unetr", {"img_size": [32, 16, 16]}, device="meta")
    assert tuple(meta_forward(model, (1, 1, 32, 16, 16)).shape) == (1, 2, 32, 16, 16)


def test_unknown_preset_suggests_the_closest_name() -> None:
    with pytest.raises(ModelSpecError, match="Did you mean 'swinunetr'") as info:
        zoo.get_preset("swinunet")
    assert "nnunet, unet" in str(info.value)
    with pytest.raises(ModelSpecError, match="Did you mean 'nnunet'"):
        zoo.build_model("nnunte")
    assert zoo.get_preset(" NNUNet ") is zoo.PRESETS["nnunet"]


def test_class_spec_builds_with_kwargs() -> None:
    kwargs = {"in_channels": 1, "out_channels": 2, "kernel_size": 3}
    model = zoo.build_model("torch.nn:Conv3d", kwargs)
    assert isinstance(model, nn.Conv3d) and model.weight.shape == (2, 1, 3, 3, 3)
    meta = zoo.build_model(
        "torch.nn:Conv3d", '{"in_channels": 1, "out_channels": 2, "kernel_size": 3}', device="meta"
    )
    assert meta.weight.device.type == "meta"


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        ("torchx.nn:Conv3d", None, "Cannot import module 'torchx.nn'.*No module named 'torchx'"),
        ("torch.nn:Conv4d", None, "has no attribute 'Conv4d'"),
        ("torch.nn:Conv3d", {"in_channels": 1}, "'torch.nn:Conv3d' with model kwargs .*TypeError"),
        ("torch.nn:Conv3d", {"chanels": 1}, "chanels"),
        ("math:pi", None, "'math:pi' is a float that is not a subclass of torch.nn.Module"),
        ("builtins:dict", None, "is a class that is not a subclass of torch.nn.Module"),
        # issue 19 point 5: any other callable would be called with the user's kwargs
        ("os:system", {"command": "echo never"}, "must name an nn.Module class.*build_model"),
        ("monai.networks.nets:SegResNet.__init__", None, "is a function that is not"),
        (":Conv3d", None, "package.module:Class"),
    ],
)
def test_class_spec_failures_are_clear(spec: str, kwargs: dict | None, message: str) -> None:
    with pytest.raises(ModelSpecError, match=message):
        zoo.build_model(spec, kwargs)


def test_model_file_spec(tmp_path) -> None:
    path = tmp_path / "my_model.py"
    path.write_text(
        "import torch\n"
        "def build_model(width=4, **kwargs):\n"
        "    return torch.nn.Conv3d(1, width, 3)\n"
    )
    model = zoo.build_model(str(path), {"width": 6}, device="meta")
    assert model.weight.shape == (6, 1, 3, 3, 3) and model.weight.device.type == "meta"
    assert zoo.build_model(path).weight.shape[0] == 4


def test_model_file_failures_are_clear(tmp_path) -> None:
    empty = tmp_path / "empty.py"
    empty.write_text("WIDTH = 4\n")
    with pytest.raises(ModelSpecError, match="defines no build_model"):
        zoo.build_model(str(empty))
    with pytest.raises(ModelSpecError, match="does not exist"):
        zoo.build_model(str(tmp_path / "missing.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_package_xyz\n")
    with pytest.raises(ModelSpecError, match="broken.py.*not_a_real_package_xyz"):
        zoo.build_model(str(broken))


def test_parse_model_kwargs_from_strings_and_mappings() -> None:
    assert zoo.parse_model_kwargs(None) == {}
    assert zoo.parse_model_kwargs("") == {}
    assert zoo.parse_model_kwargs({"a": 1}) == {"a": 1}
    assert zoo.parse_model_kwargs('{"out_channels": 3, "lr": 1e-5}') == {
        "out_channels": 3,
        "lr": 1e-5,
    }
    assert zoo.parse_model_kwargs("out_channels: 3\nchannels: [8, 16]") == {
        "out_channels": 3,
        "channels": [8, 16],
    }
    assert zoo.parse_model_kwargs("{out_channels: 3}") == {"out_channels": 3}


def test_parse_model_kwargs_from_files(tmp_path) -> None:
    (tmp_path / "k.json").write_text('{"out_channels": 3}')
    (tmp_path / "k.yaml").write_text("out_channels: 4\n")
    (tmp_path / "k.yml").write_text("out_channels: 5\n")
    assert zoo.parse_model_kwargs(str(tmp_path / "k.json")) == {"out_channels": 3}
    assert zoo.parse_model_kwargs(str(tmp_path / "k.yaml")) == {"out_channels": 4}
    assert zoo.parse_model_kwargs(tmp_path / "k.yml") == {"out_channels": 5}
    with pytest.raises(ModelSpecError, match="does not exist"):
        zoo.parse_model_kwargs(str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize("text", ["[1, 2]", "3", "just words", "- a\n- b"])
def test_parse_model_kwargs_rejects_non_mappings_with_an_example(text: str) -> None:
    with pytest.raises(ModelSpecError, match="must be a mapping.*e.g."):
        zoo.parse_model_kwargs(text)


def test_parse_model_kwargs_rejects_malformed_yaml() -> None:
    with pytest.raises(ModelSpecError, match="Cannot parse"):
        zoo.parse_model_kwargs("a: [1, 2")


def test_check_input_shape_non_divisible_names_rule_dims_and_padding() -> None:
    with pytest.raises(InputShapeError) as info:
        zoo.check_input_shape("nnunet", (1, 1, 100, 128, 128))
    assert str(info.value) == (
        "nnunet needs every spatial size divisible by 32 (2^5 downsamplings); got "
        "1x1x100x128x128 (D=100 is not). Pad to 1x1x128x128x128."
    )


def test_check_input_shape_too_small() -> None:
    with pytest.raises(InputShapeError, match=r"at least 64 .*D=32, W=32 are not.*1x1x64x64x64"):
        zoo.check_input_shape("swinunetr", (1, 1, 32, 64, 32))


def test_check_input_shape_ndim_and_channels() -> None:
    with pytest.raises(InputShapeError, match="5-D input.*got 4 dims: 1x64x64x64"):
        zoo.check_input_shape("unet", (1, 64, 64, 64))
    with pytest.raises(InputShapeError, match="1 input channel.*got 3.*in_channels=3"):
        zoo.check_input_shape("unet", (1, 3, 64, 64, 64))
    zoo.check_input_shape("unet", (1, 3, 64, 64, 64), {"in_channels": 3})


def test_legal_and_smallest_shapes() -> None:
    assert zoo.legal_shape("nnunet", (2, 1, 100, 128, 1)) == (2, 1, 128, 128, 64)
    assert zoo.legal_shape("basicunet", (1, 1, 33, 47, 8)) == (1, 1, 33, 47, 32)
    assert zoo.smallest_input_shape("nnunet") == (1, 1, 64, 64, 64)
    assert zoo.smallest_input_shape("resnet3d") == (1, 1, 17, 17, 17)
    for preset in zoo.PRESETS.values():
        shape = zoo.smallest_input_shape(preset)
        assert zoo.legal_shape(preset, shape) == shape

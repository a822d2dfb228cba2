import numpy as np
import pytest
import torch

from remat3d import zoo
from remat3d.data import Geometry, Preprocessing, VolumeDataset, read_datalist
from remat3d.data.padding import crop_back, pad_to_divisor, probe_geometry
from remat3d.errors import DataError, InputShapeError
from tests.data.volumes import blob_case, write_dataset, write_volume


def test_pad_then_crop_is_identity_and_pads_with_zeros():
    x = torch.randn(2, 3, 9, 16, 17)
    padded, shape = pad_to_divisor(x, 8)
    assert padded.shape == (2, 3, 16, 16, 24) and shape == (9, 16, 17)
    assert torch.equal(crop_back(padded, shape), x)
    assert float(padded[..., 9:, :, :].abs().sum()) == 0
    small, _ = pad_to_divisor(torch.ones(1, 1, 4, 4, 4), 8, min_size=16)
    assert small.shape[-3:] == (16, 16, 16)


@pytest.mark.parametrize("spec, kwargs, divisor", [
    ("monai.networks.nets:UNet", {"spatial_dims": 3, "in_channels": 2, "out_channels": 3,
                                  "channels": [4, 8, 16], "strides": [2, 2]}, 4),
    ("monai.networks.nets:BasicUNet", {"spatial_dims": 3, "in_channels": 1, "out_channels": 2,
                                       "features": [4, 4, 8, 8, 16, 4]}, 1),
    ("unet", {}, 16),
])
def test_probe_finds_channels_and_divisor(spec, kwargs, divisor):
    model = zoo.build_model(spec, kwargs, device="meta")
    geometry = probe_geometry(model)
    assert geometry.divisor == divisor
    assert geometry.in_channels == kwargs.get("in_channels", 1)
    assert geometry.out_channels == kwargs.get("out_channels", 2)


def test_probe_refuses_a_classifier():
    model = zoo.build_model("resnet3d", device="meta")
    with pytest.raises(InputShapeError, match="no output of its input's spatial shape"):
        probe_geometry(model)


def dataset(tmp_path, geometry, **kwargs):
    path = write_dataset(tmp_path, cases=2, validation=0, shape=(20, 18, 12))
    return VolumeDataset(read_datalist(path).training, Preprocessing(), geometry, **kwargs)


def test_samples_are_padded_whole_volumes(tmp_path):
    ds = dataset(tmp_path, Geometry(1, 3, 8, 8))
    assert ds.check() == [(24, 24, 16), (24, 24, 16)]
    sample = ds.sample(0)
    assert sample.image.shape == (1, 1, 24, 24, 16) and sample.label.dtype == torch.long
    assert sample.shape == (20, 18, 12)


def test_patches_are_reproducible_per_epoch(tmp_path):
    ds = dataset(tmp_path, Geometry(1, 3, 8, 8), patch_size=(8, 8, 8), seed=1)
    a, b = ds.sample(0, epoch=0), ds.sample(0, epoch=0)
    assert a.image.shape == (1, 1, 8, 8, 8) and torch.equal(a.image, b.image)
    assert any(not torch.equal(ds.sample(0, epoch=e).image, a.image) for e in range(1, 6))
    with pytest.raises(DataError, match="patch_size"):
        dataset(tmp_path, Geometry(1, 3, 8, 8), patch_size=(12, 8, 8))


def test_wrong_channel_count(tmp_path):
    with pytest.raises(DataError, match=r"case0.*has 1 channel\(s\) but the model takes 2"):
        dataset(tmp_path, Geometry(2, 3, 8, 8)).check()


def test_too_many_classes_for_the_head(tmp_path):
    with pytest.raises(DataError, match=r"has class 2 but the model predicts 2 classes.*"
                                        r"out_channels=3"):
        dataset(tmp_path, Geometry(1, 2, 8, 8)).check()


def test_volume_too_small_for_the_model(tmp_path):
    image, label = blob_case((10, 10, 6), 0)
    write_volume(tmp_path / "imagesTr" / "tiny.nii.gz", image)
    write_volume(tmp_path / "labelsTr" / "tiny.nii.gz", label)
    cases = read_datalist(tmp_path).training
    geometry = Geometry(1, 3, 16, 16, reason="2^4 downsamplings")
    with pytest.raises(DataError, match=r"tiny.*10x10x6 voxels.*at least 16 \(2\^4"):
        VolumeDataset(cases, Preprocessing(), geometry).check()


def test_empty_dataset():
    with pytest.raises(DataError, match="empty"):
        VolumeDataset([], Preprocessing(), Geometry(1, 2, 8, 8))


def test_cache_reads_each_file_once(tmp_path, monkeypatch):
    import remat3d.data.dataset as module

    calls = []
    real = module.load_case
    monkeypatch.setattr(module, "load_case", lambda c, p: calls.append(c.name) or real(c, p))
    ds = dataset(tmp_path, Geometry(1, 3, 8, 8))
    ds.check()
    ds.sample(0)
    ds.sample(1)
    assert calls == ["case0", "case1"]
    np.testing.assert_equal(len(ds), 2)

import json

import numpy as np
import pytest

from remat3d.data import read_datalist, split_validation
from remat3d.data.datalist import Case, case_name
from remat3d.errors import DataError
from tests.data.volumes import write_dataset, write_volume


def test_msd_datalist_paths_are_relative_to_the_file(tmp_path):
    path = write_dataset(tmp_path, cases=2, validation=1)
    datalist = read_datalist(path)
    assert [c.name for c in datalist.training] == ["case0", "case1"]
    assert [c.name for c in datalist.validation] == ["case2"]
    assert datalist.training[0].images == (tmp_path / "imagesTr" / "case0.nii.gz",)
    assert datalist.labels["1"] == "bright"
    assert read_datalist(tmp_path).training == datalist.training  # the folder finds the json


def test_folders_pair_images_and_labels_and_group_channels(tmp_path):
    volume = np.zeros((8, 8, 8), np.float32)
    for name in ("a_0000", "a_0001", "b_0000", "b_0001"):
        write_volume(tmp_path / "imagesTr" / f"{name}.nii.gz", volume)
    for name in ("a", "b"):
        write_volume(tmp_path / "labelsTr" / f"{name}.nii.gz", volume.astype(np.uint8))
    datalist = read_datalist(tmp_path)
    assert [(c.name, len(c.images)) for c in datalist.training] == [("a", 2), ("b", 2)]


def test_case_names_strip_suffixes():
    from pathlib import Path

    assert case_name(Path("liver_12_0000.nii.gz")) == "liver_12_0000"
    assert case_name(Path("scan.nii")) == "scan"
    assert case_name(Path("ct_2020")) == "ct_2020"  # a DICOM series folder


def test_a_label_of_the_full_name_wins_over_the_channel_reading(tmp_path):
    volume = np.zeros((8, 8, 8), np.float32)
    write_volume(tmp_path / "images" / "ct_2020.nii.gz", volume)
    write_volume(tmp_path / "labels" / "ct_2020.nii.gz", volume.astype(np.uint8))
    assert [c.name for c in read_datalist(tmp_path).training] == ["ct_2020"]


def test_missing_file_names_the_file_and_the_entry(tmp_path):
    (tmp_path / "dataset.json").write_text(json.dumps(
        {"training": [{"image": "./imagesTr/nope.nii.gz", "label": "./labelsTr/nope.nii.gz"}]}))
    with pytest.raises(DataError, match=r"nope\.nii\.gz.*training\[0\].*does not exist"):
        read_datalist(tmp_path / "dataset.json")


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"test": []}), "no 'training' list"),
    (json.dumps({"training": []}), "no training cases"),
    (json.dumps({"training": [{"image": "x.nii.gz"}]}), "has no 'label'"),
])
def test_bad_datalists(tmp_path, content, message):
    (tmp_path / "dataset.json").write_text(content)
    with pytest.raises(DataError, match=message):
        read_datalist(tmp_path / "dataset.json")


def test_bad_folders(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_datalist(tmp_path / "missing")
    with pytest.raises(DataError, match="no dataset.json, imagesTr/ or images/"):
        read_datalist(tmp_path)
    (tmp_path / "imagesTr").mkdir()
    (tmp_path / "labelsTr").mkdir()
    with pytest.raises(DataError, match="empty"):
        read_datalist(tmp_path)
    write_volume(tmp_path / "imagesTr" / "a.nii.gz", np.zeros((4, 4, 4), np.float32))
    with pytest.raises(DataError, match="a in .* no label map"):
        read_datalist(tmp_path)


def test_validation_split_is_seeded_and_keeps_a_training_case():
    cases = [Case(f"c{i}", ()) for i in range(10)]
    train, val = split_validation(cases, 0.2, seed=3)
    assert len(val) == 2 and len(train) == 8
    assert split_validation(cases, 0.2, seed=3) == (train, val)
    assert split_validation(cases[:1], 0.5, seed=0) == (cases[:1], [])
    with pytest.raises(DataError, match="val_fraction"):
        split_validation(cases, 1.0, seed=0)

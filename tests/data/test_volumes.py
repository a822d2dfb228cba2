import gzip

import numpy as np
import pytest
import torch

from remat3d.data import Preprocessing, load_case, read_datalist
from remat3d.data.datalist import Case
from remat3d.errors import DataError
from tests.data.volumes import blob_case, write_volume


def case_files(tmp_path, image, label, image_affine=None, label_affine=None, name="c"):
    ipath = write_volume(tmp_path / f"{name}_img.nii.gz", image, image_affine)
    lpath = write_volume(tmp_path / f"{name}_lab.nii.gz", label, label_affine)
    return Case(name, (ipath,), lpath)


def test_loads_channel_first_in_ras_with_uint8_labels(tmp_path):
    image, label = blob_case((10, 12, 14), 0)
    lps = np.diag([-2.0, -2.0, 2.0, 1.0])  # LPS-oriented file: flipped to RAS on load
    volume = load_case(case_files(tmp_path, image, label, lps, lps), Preprocessing())
    assert volume.image.shape == (1, 10, 12, 14) and volume.image.dtype == torch.float32
    assert volume.label.dtype == torch.uint8
    assert np.allclose(np.diag(volume.affine)[:3], [2, 2, 2])
    assert torch.equal(volume.image[0], torch.from_numpy(image[::-1, ::-1, :].copy()))
    assert torch.equal(volume.label[0], torch.from_numpy(label[::-1, ::-1, :].copy()))


def test_spacing_and_intensity(tmp_path):
    image, label = blob_case((10, 12, 14), 1)
    ct = image * 10 - 500  # values around -700..+500 HU
    volume = load_case(case_files(tmp_path, ct, label),
                       Preprocessing(spacing=(4.0, 4.0, 4.0), intensity="ct",
                                     ct_window=(-200.0, 300.0)))
    # MONAI keeps the field of view: (n - 1) * 2 mm / 4 mm + 1 voxels, rounded up
    assert volume.image.shape[1:] == (6, 6, 8) and volume.label.shape[1:] == (6, 6, 8)
    assert float(volume.image.min()) >= 0 and float(volume.image.max()) <= 1
    mr = load_case(case_files(tmp_path, image + 1000, label, name="mr"),
                   Preprocessing(intensity="mr"))
    assert abs(float(mr.image.mean())) < 1e-4 and abs(float(mr.image.std()) - 1) < 1e-2


def test_multichannel_cases_stack_channels(tmp_path):
    image, label = blob_case((8, 8, 8), 2)
    a = write_volume(tmp_path / "x_0000.nii.gz", image)
    b = write_volume(tmp_path / "x_0001.nii.gz", image * 2)
    lab = write_volume(tmp_path / "x.nii.gz", label)
    volume = load_case(Case("x", (a, b), lab), Preprocessing())
    assert volume.image.shape == (2, 8, 8, 8)
    assert torch.equal(volume.image[1], volume.image[0] * 2)


def test_truncated_file_is_named(tmp_path):
    image, label = blob_case((16, 16, 16), 3)
    case = case_files(tmp_path, image, label)
    raw = case.images[0].read_bytes()
    case.images[0].write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=r"Cannot read .*c_img\.nii\.gz.*truncated"):
        load_case(case, Preprocessing())


def test_not_a_volume_is_named(tmp_path):
    path = tmp_path / "notes.nii.gz"
    path.write_bytes(gzip.compress(b"hello"))
    label = write_volume(tmp_path / "l.nii.gz", np.zeros((4, 4, 4), np.uint8))
    with pytest.raises(DataError, match="notes.nii.gz"):
        load_case(Case("n", (path,), label), Preprocessing())


def test_shape_mismatch(tmp_path):
    image, label = blob_case((8, 8, 8), 4)
    with pytest.raises(DataError, match=r"label .* has shape \(8, 8, 6\) but its image .* has "
                                        r"\(8, 8, 8\)"):
        load_case(case_files(tmp_path, image, label[:, :, :6]), Preprocessing())


def test_affine_mismatch(tmp_path):
    image, label = blob_case((8, 8, 8), 5)
    shifted = np.diag([2.0, 2.0, 2.0, 1.0])
    shifted[0, 3] = 5.0
    with pytest.raises(DataError, match="different affines .* 5 mm"):
        load_case(case_files(tmp_path, image, label, label_affine=shifted), Preprocessing())


def test_nan_voxels_are_counted(tmp_path):
    image, label = blob_case((8, 8, 8), 6)
    image[1, 2, 3] = np.nan
    image[2, 2, 2] = np.inf
    with pytest.raises(DataError, match=r"c_img.nii.gz' has 2 NaN/Inf voxel"):
        load_case(case_files(tmp_path, image, label), Preprocessing())


def test_probability_map_as_label(tmp_path):
    image, _ = blob_case((8, 8, 8), 7)
    with pytest.raises(DataError, match="non-integer or negative"):
        load_case(case_files(tmp_path, image, np.full((8, 8, 8), 0.5, np.float32)),
                  Preprocessing())


def test_bad_preprocessing_settings():
    with pytest.raises(DataError, match="intensity"):
        Preprocessing(intensity="pet")
    with pytest.raises(DataError, match="ct_window"):
        Preprocessing(ct_window=(100.0, -100.0))
    with pytest.raises(DataError, match="spacing"):
        Preprocessing(spacing=(1.0, 0.0, 1.0))


def write_dicom_series(folder, volume: np.ndarray, spacing=(1.5, 1.5, 3.0)) -> None:
    """A CT series, one slice per file, the way scanners write them."""
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    folder.mkdir(parents=True)
    series, study, frame = generate_uid(), generate_uid(), generate_uid()
    for k in range(volume.shape[2]):
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID = CTImageStorage
        meta.MediaStorageSOPInstanceUID = generate_uid()
        meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds = FileDataset(str(folder / f"s{k:03d}.dcm"), {}, file_meta=meta, preamble=b"\0" * 128)
        ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, meta.MediaStorageSOPInstanceUID
        ds.SeriesInstanceUID, ds.StudyInstanceUID, ds.FrameOfReferenceUID = series, study, frame
        ds.Modality, ds.PatientID = "CT", "phantom"
        ds.Rows, ds.Columns = volume.shape[1], volume.shape[0]
        ds.PixelSpacing = [spacing[1], spacing[0]]
        ds.SliceThickness = spacing[2]
        ds.ImagePositionPatient = [0.0, 0.0, k * spacing[2]]
        ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
        ds.InstanceNumber = k + 1
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
        ds.RescaleIntercept, ds.RescaleSlope = -1024, 1
        ds.PixelData = (volume[:, :, k].T + 1024).astype(np.int16).tobytes()
        ds.save_as(folder / f"s{k:03d}.dcm", enforce_file_format=True)


def test_dicom_series_folder(tmp_path):
    hu = np.full((12, 10, 6), -1000, np.int16)
    hu[3:9, 2:8, 1:5] = 40
    write_dicom_series(tmp_path / "imagesTr" / "ct1", hu)
    label = (hu > -500).astype(np.uint8)
    # the label map on the series' grid: LPS in DICOM -> the affine nibabel writes is RAS
    write_volume(tmp_path / "labelsTr" / "ct1.nii.gz", label[::-1, ::-1, :].copy(),
                 np.array([[-1.5, 0, 0, 0], [0, -1.5, 0, 0], [0, 0, 3.0, 0], [0, 0, 0, 1]]))
    case = read_datalist(tmp_path).training[0]
    volume = load_case(case, Preprocessing())
    assert volume.image.shape == (1, 12, 10, 6)
    assert float(volume.image.min()) == -1000 and float(volume.image.max()) == 40
    assert torch.equal(volume.label[0].bool(), volume.image[0] > -500)

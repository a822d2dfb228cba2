"""Full-volume datasets: datalists, reading and checking volumes, padding to the model's
divisor, and example data that needs no download."""

from remat3d.data.datalist import Case, Datalist, read_datalist, split_validation
from remat3d.data.dataset import Sample, VolumeDataset
from remat3d.data.padding import Geometry, crop_back, pad_to_divisor, probe_geometry
from remat3d.data.volumes import Preprocessing, Volume, load_case

__all__ = [
    "Case",
    "Datalist",
    "Geometry",
    "Preprocessing",
    "Sample",
    "Volume",
    "VolumeDataset",
    "crop_back",
    "load_case",
    "pad_to_divisor",
    "probe_geometry",
    "read_datalist",
    "split_validation",
]

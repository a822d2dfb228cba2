"""Fine-tuning on whole volumes: settings, pretrained weights, the training loop."""

from remat3d.train.settings import TrainSettings, load_settings
from remat3d.train.trainer import Interrupted, Trainer, TrainResult, train
from remat3d.train.weights import LoadReport, apply_freeze, load_pretrained, read_state_dict

__all__ = [
    "Interrupted",
    "LoadReport",
    "TrainResult",
    "TrainSettings",
    "Trainer",
    "apply_freeze",
    "load_pretrained",
    "load_settings",
    "read_state_dict",
    "train",
]

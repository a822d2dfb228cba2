"""The settings of a training run: one dataclass, loaded from YAML, overridden by
``--key=value``; unknown keys are refused. The settings are stored in every training-state
file, so a run can be resumed and audited.

>>> s = load_settings(None, ["model=unet", "data=/tmp/ds", "epochs=3",
...                          "model_kwargs.out_channels=4"])
>>> s.model, s.epochs, s.model_kwargs
('unet', 3, {'out_channels': 4})
>>> load_settings(None, ["data=/tmp/ds", "epoch=3"])
Traceback (most recent call last):
...
remat3d.errors.SettingsError: Unknown setting 'epoch' (from --epoch=3). Did you mean 'epochs'? ...
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from remat3d.errors import SettingsError
from remat3d.planspec import OBJECTIVES

if TYPE_CHECKING:
    from remat3d.data.volumes import Preprocessing

__all__ = ["TrainSettings", "load_settings", "parse_overrides"]


@dataclass
class TrainSettings:
    """Everything a training run depends on. Paths are resolved relative to the config file."""

    # --- model and weights
    model: str = "nnunet"                      # zoo preset, package.module:Class or a .py file
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None              # .pt/.pth/.ckpt/.safetensors
    freeze: list[str] = field(default_factory=list)    # fnmatch patterns of parameter names
    unfreeze: list[str] = field(default_factory=list)  # applied after freeze
    # --- data
    data: str = ""                             # dataset.json or a folder (imagesTr/labelsTr)
    val_fraction: float = 0.2                  # when the datalist has no "validation" list
    intensity: str = "none"                    # ct (window -> [0, 1]) | mr (z-score) | none
    ct_window: list[float] = field(default_factory=lambda: [-1000.0, 1000.0])
    spacing: list[float] | None = None         # resample to this spacing (mm); None: keep
    orientation: str | None = "RAS"
    divisible_by: int | None = None            # None: the preset's rule, or probed on meta
    patch_size: list[int] | None = None        # None: whole volumes (patches only to compare)
    cache: bool = True                         # keep prepared volumes in memory
    # --- memory
    memory_budget: str = "none"                # none | 12GiB | 0.25x | auto
    strategy: str = "optimal"
    objective: str = "time"                    # time | flops: what the plan minimises
    offload: bool = False
    amp: str = "none"                          # none | bf16 | fp16
    # --- optimisation
    epochs: int = 10
    batch_size: int = 1                        # volumes per step (same shapes only)
    accumulate: int = 1                        # micro-batches per optimizer step
    optimizer: str = "adamw"                   # adamw | sgd
    lr: float = 1e-3
    pretrained_lr: float | None = None         # lr of loaded weights; None: same as lr
    weight_decay: float = 1e-5
    # --- run
    seed: int = 0
    deterministic: bool = True
    device: str = "auto"                       # auto (cuda if present) | cpu | cuda
    distributed: str = "ddp"                   # under torchrun: ddp | fsdp (FSDP2)
    output_dir: str = "runs/exp"
    save_every: int = 10                       # optimizer steps between training-state files
    val_every: int = 1                         # epochs between validations
    progress: bool = True

    def validate(self) -> None:
        def bad(key: str, value: Any, want: str) -> SettingsError:
            return SettingsError(f"Setting {key}={value!r} is invalid: {want}.")

        if not self.data:
            raise SettingsError("Setting 'data' is required: a dataset.json or a folder "
                                "with imagesTr/ and labelsTr/.")
        if self.amp not in ("none", "bf16", "fp16"):
            raise bad("amp", self.amp, "use none, bf16 or fp16")
        if self.objective not in OBJECTIVES:
            raise bad("objective", self.objective, "use time (FLOPs and memory-bound "
                      "traffic, the default) or flops (FLOPs only)")
        if self.intensity not in ("ct", "mr", "none"):
            raise bad("intensity", self.intensity, "use ct, mr or none")
        if self.distributed not in ("ddp", "fsdp"):
            raise bad("distributed", self.distributed, "use ddp or fsdp")
        if self.optimizer not in ("adamw", "sgd"):
            raise bad("optimizer", self.optimizer, "use adamw or sgd")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise bad("device", self.device, "use auto, cpu, cuda or cuda:N")
        for key in ("epochs", "batch_size", "accumulate", "save_every", "val_every"):
            if getattr(self, key) < 1:
                raise bad(key, getattr(self, key), "must be at least 1")
        if self.lr <= 0 or (self.pretrained_lr is not None and self.pretrained_lr < 0):
            raise bad("lr", self.lr, "learning rates must be positive")
        if len(self.ct_window) != 2 or self.ct_window[0] >= self.ct_window[1]:
            raise bad("ct_window", self.ct_window, "give [low, high] with low < high")
        if self.spacing is not None and (len(self.spacing) != 3 or min(self.spacing) <= 0):
            raise bad("spacing", self.spacing, "give three positive sizes in mm, or null")
        if self.patch_size is not None and (len(self.patch_size) != 3
                                            or min(self.patch_size) < 1):
            raise bad("patch_size", self.patch_size, "give three edges, or null for whole "
                      "volumes")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def preprocessing(self) -> Preprocessing:
        """How this run prepares each volume (for training and for prediction)."""
        from remat3d.data.volumes import Preprocessing  # torch: only when asked

        return Preprocessing(
            orientation=self.orientation,
            spacing=tuple(self.spacing) if self.spacing else None,  # type: ignore[arg-type]
            intensity=self.intensity, ct_window=tuple(self.ct_window),  # type: ignore[arg-type]
        )


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["epochs=3", "model_kwargs.out_channels=4"]`` -> nested dict; values are YAML."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        text = item.removeprefix("--")
        key, sep, raw = text.partition("=")
        if not sep or not key:
            raise SettingsError(f"Override {item!r} is not key=value (e.g. --epochs=3).")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SettingsError(f"Override {item!r} sets a key inside {part!r}, which is "
                                    "not a mapping.")
        node[parts[-1]] = value
    return out


def load_settings(config: str | os.PathLike[str] | None,
                  overrides: list[str] | None = None) -> TrainSettings:
    """Settings from a YAML file (or none) with ``key=value`` overrides applied on top."""
    import yaml

    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    base = Path.cwd()
    if config is not None:
        path = Path(config)
        try:
            loaded = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise SettingsError(f"Cannot read settings file {str(path)!r}: "
                                f"{exc.strerror or exc}.") from None
        except yaml.YAMLError as exc:
            raise SettingsError(f"Settings file {str(path)!r} is not valid YAML: "
                                f"{str(exc).splitlines()[0]}.") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise SettingsError(f"Settings file {str(path)!r} must hold a mapping of "
                                f"settings, got a {type(loaded).__name__}.")
        values.update(loaded)
        origin.update({k: str(path) for k in loaded})
        base = path.resolve().parent
    for item in overrides or []:
        parsed = parse_overrides([item])
        for key, value in parsed.items():
            if isinstance(value, dict) and isinstance(values.get(key), dict):
                values[key] = {**values[key], **value}
            else:
                values[key] = value
            origin[key] = f"--{item.lstrip('-')}"
    settings = _build(values, origin)
    for key in ("data", "pretrained", "output_dir"):
        value = getattr(settings, key)
        if value and not Path(value).expanduser().is_absolute() and key in origin \
                and not origin[key].startswith("--"):
            setattr(settings, key, str(base / value))
    settings.validate()
    return settings


def _build(values: dict[str, Any], origin: dict[str, str]) -> TrainSettings:
    fields = {f.name: f for f in dataclasses.fields(TrainSettings)}
    hints = typing.get_type_hints(TrainSettings)
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise SettingsError(
                f"Unknown setting {key!r} (from {origin.get(key, 'settings')}).{hint} "
                f"Known settings: {', '.join(fields)}."
            )
        kwargs[key] = _coerce(key, value, hints[key], origin.get(key, "settings"))
    return TrainSettings(**kwargs)


def _coerce(key: str, value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against the field's type; ints become floats where floats are due."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        origin_type = typing.get_origin(option) or option
        if origin_type is float and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            return float(value)
        if origin_type is float and isinstance(value, str):
            try:  # YAML 1.1 reads 1e-3 (no dot) as text
                return float(value)
            except ValueError:
                pass
        if origin_type is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin_type is bool and isinstance(value, bool):
            return value
        if origin_type is str and isinstance(value, (str, int, float)) \
                and not isinstance(value, bool):
            return str(value)
        if origin_type is list and isinstance(value, str) and value:
            value = [value]  # one pattern/value where a list is expected
        if origin_type is list and isinstance(value, list):
            (item_type,) = typing.get_args(option) or (Any,)
            return [_coerce(key, v, item_type, where) for v in value]
        if origin_type is dict and isinstance(value, dict):
            return dict(value)
        if option is Any:
            return value
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise SettingsError(f"Setting {key}={value!r} (from {where}) should be {names}.")

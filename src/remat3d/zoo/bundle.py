"""Models from MONAI bundles: a bundle folder (or its ``.zip``) as a model spec.

A MONAI bundle holds ``configs/`` (``train``/``inference`` ``.json``/``.yaml``, with the
network as ``network_def``) and ``models/model.pt`` (its weights). The spec builds
``network_def`` through ``monai.bundle.ConfigParser``, from the first of ``train``,
``inference`` in ``configs/`` that defines it, and loads ``models/model.pt`` when the
bundle has it (tensors that do not fit the network built, a head changed by model kwargs,
are left as initialised and logged). Model kwargs override ``network_def``'s arguments
(``out_channels: 4``).

A bundle's own code (``scripts/``, named in ``network_def`` as ``scripts.networks.X``) is
importable while the network is built, as under MONAI's bundle runner: the bundle's folder
is first on ``sys.path`` then, and afterwards the path and ``sys.modules`` are as they were
(the network keeps its class; another bundle's ``scripts`` is not shadowed). A network
that fails to build in a bundle written for another MONAI release (``metadata.json``'s
``monai_version``) is reported with both versions.

What a spec may execute: a bundle's configs are code. MONAI evaluates their ``$``
expressions and calls their ``_target_`` classes and functions, so name only bundles you
trust (as with a ``.py`` file). The weights are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from remat3d.errors import ModelSpecError, WeightsError, quoted
from remat3d.zoo.fitting import load_fitting, read_state_dict

__all__ = ["build_from_bundle", "bundle_root", "is_bundle"]

_CONFIGS = ("train", "inference")
_SUFFIXES = (".json", ".yaml", ".yml")


def is_bundle(spec: str) -> bool:
    """Whether ``spec`` names a bundle folder (holding ``configs/``) or a ``.zip``."""
    path = Path(spec).expanduser()
    return (path.is_dir() and (path / "configs").is_dir()) or \
        (path.suffix.lower() == ".zip" and path.is_file())


def bundle_root(spec: str | os.PathLike[str]) -> Path:
    """The bundle's folder: ``spec`` itself, or where its ``.zip`` is unpacked (a cache
    folder named after the archive's content, so an unchanged archive unpacks once)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / f"remat3d-bundle-{digest}"
    if not target.is_dir():
        staging = Path(tempfile.mkdtemp(prefix="remat3d-bundle-"))
        try:
            with zipfile.ZipFile(path) as archive:
                for name in archive.namelist():  # no member may leave the folder
                    if Path(name).is_absolute() or ".." in Path(name).parts:
                        raise ModelSpecError(f"Bundle archive {str(path)!r} holds a path "
                                             f"outside its folder: {name!r}.")
                archive.extractall(staging)
        except zipfile.BadZipFile as exc:
            raise ModelSpecError(f"Cannot read bundle archive {str(path)!r}: {exc}.") from None
        if target.exists():  # unpacked meanwhile by another process
            shutil.rmtree(staging, ignore_errors=True)
        else:
            staging.replace(target)
    found = [p.parent for p in sorted(target.rglob("configs")) if p.is_dir()]
    if not found:
        raise ModelSpecError(f"Bundle archive {str(path)!r} holds no configs/ folder; a "
                             "MONAI bundle has configs/ and models/.")
    return found[0]


def _config_files(root: Path) -> list[Path]:
    return [root / "configs" / f"{name}{suffix}" for name in _CONFIGS for suffix in _SUFFIXES
            if (root / "configs" / f"{name}{suffix}").is_file()]


def build_from_bundle(spec: str | os.PathLike[str], **kwargs: Any) -> nn.Module:
    """The bundle's ``network_def`` (module docstring), with its weights."""
    from monai.bundle import ConfigParser

    root = bundle_root(spec)
    where = f"bundle {str(spec)!r}"
    files = _config_files(root)
    if not files:
        raise ModelSpecError(f"{where} has no configs/train or configs/inference (.json, "
                             ".yaml); a MONAI bundle defines its network_def there.")
    for file in files:
        parser = ConfigParser()
        try:
            parser.read_config(str(file))
        except Exception as exc:  # noqa: BLE001 - a user's config: report it against the file
            raise ModelSpecError(f"Cannot read {str(file)!r}: {type(exc).__name__}: "
                                 f"{quoted(exc)}") from None
        if "network_def" in parser:
            break
    else:
        raise ModelSpecError(f"{where}: none of {', '.join(f.name for f in files)} defines "
                             "network_def.")
    for key, value in kwargs.items():
        parser[f"network_def#{key}"] = value
    try:
        with _importable(root):
            model = parser.get_parsed_content("network_def", instantiate=True)
    except Exception as exc:  # noqa: BLE001 - the bundle's own code failed
        raise ModelSpecError(f"{where}: building network_def from {file.name} failed: "
                             f"{type(exc).__name__}: {quoted(exc)}{_versions(root)}") from None
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{where}: network_def built a {type(model).__name__}, not a "
                             "torch.nn.Module.")
    weights = root / "models" / "model.pt"
    if weights.is_file() and not any(p.is_meta for p in model.parameters()):
        _load(model, weights, where)  # (on meta, for planning: no values to read)
    return model


@contextlib.contextmanager
def _importable(root: Path) -> Iterator[None]:
    """The bundle's folder first on ``sys.path`` while its network is built; the modules
    imported from it are then forgotten and any it shadowed put back (module docstring)."""
    names = {p.stem if p.suffix == ".py" else p.name for p in root.iterdir()
             if p.suffix == ".py" or (p.is_dir() and p.name.isidentifier())}

    def ours(name: str) -> bool:
        return name.split(".")[0] in names

    shadowed = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in shadowed:
        del sys.modules[name]
    path = list(sys.path)
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path[:] = path
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        sys.modules.update(shadowed)


def _versions(root: Path) -> str:
    """The bundle's MONAI release beside the installed one, where they differ."""
    import monai

    try:
        wanted = json.loads((root / "configs" / "metadata.json").read_text())["monai_version"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    if str(wanted) == monai.__version__:
        return ""
    return (f" The bundle was written for MONAI {wanted} (configs/metadata.json's "
            f"monai_version) and MONAI {monai.__version__} is installed: use the bundle's "
            f"release for MONAI {monai.__version__}, or install monai=={wanted}.")


def _load(model: nn.Module, path: Path, where: str) -> None:
    try:
        tensors = read_state_dict(path)
    except WeightsError as exc:
        raise ModelSpecError(f"{where}: {exc}") from None
    load_fitting(model, tensors, where)

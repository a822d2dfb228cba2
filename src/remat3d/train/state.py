"""Training-state files: everything needed to continue a run bit-identically.

NOTE [ Exact resume ]
  1. A state file is written only at an optimizer-step boundary (gradients are zero), so no
     partial accumulation has to be stored.
  2. It holds the model and optimizer (and GradScaler) state, the position in the epoch, and
     every RNG the step consumes (torch CPU and CUDA, numpy, random); the epoch's data order is
     a function of (seed, epoch), so it is recomputed, not stored.
  3. It is written to a temporary file in the same folder and renamed over the old one: a
     kill at any moment leaves either the previous state or the new one, never half of one.
  4. The settings travel inside, and a resume refuses settings that would change the
     arithmetic (see ``RESUMABLE_CHANGES`` for the ones that may change).
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from remat3d.errors import SettingsError, quoted

__all__ = ["RESUMABLE_CHANGES", "check_resumable", "load_state", "rng_state", "save_state",
           "set_rng_state"]

STATE_FILE = "state.pt"
# settings that may differ between the interrupted run and its resume
# settings that may differ between the interrupted run and its resume (ddp and fsdp compute
# the same steps; the world size itself is not a setting: see train/distributed.py)
# objective: a plan changes memory and time, never the step's numbers; and a run saved
# before the setting existed resumes with its default
RESUMABLE_CHANGES = frozenset({"epochs", "save_every", "val_every", "progress", "output_dir",
                               "device", "cache", "distributed", "objective"})


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": _numpy_state(),
        "python": random.getstate(),
    }


def _numpy_state() -> tuple:
    # as a tensor, so the state file loads with torch.load(weights_only=True)
    state: Any = np.random.get_state()
    name, keys, pos, has_gauss, cached = state
    return (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
            float(cached))


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])


def save_state(output_dir: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``output_dir/state.pt`` atomically; return the path."""
    output_dir.mkdir(parents=True, exist_ok=True)
    target = output_dir / STATE_FILE
    fd, tmp = tempfile.mkstemp(prefix=".state-", suffix=".tmp", dir=output_dir)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load_state(output_dir: Path) -> dict[str, Any]:
    path = output_dir / STATE_FILE
    if not path.is_file():
        raise SettingsError(
            f"Nothing to resume: {str(path)!r} does not exist. Start without --resume, or "
            "point output_dir at the interrupted run."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged file: say which and what to do
        raise SettingsError(f"Cannot read training state {str(path)!r}: "
                            f"{type(exc).__name__}: {quoted(exc)}") from None


def check_resumable(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a resume whose settings would change the computation."""
    changed = sorted(k for k in set(saved) | set(current)
                     if k not in RESUMABLE_CHANGES and saved.get(k) != current.get(k))
    if changed:
        detail = "; ".join(f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}"
                           for k in changed[:5])
        raise SettingsError(
            f"Cannot resume with different settings ({detail}). Resume with the settings of "
            f"the interrupted run (they are stored in its state file), or start a new run in "
            f"another output_dir. Only {', '.join(sorted(RESUMABLE_CHANGES))} may change."
        )

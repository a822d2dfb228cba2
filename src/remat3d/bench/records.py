"""Bench records and ``results.json``: a documented, versioned schema (``docs/bench.md``).

One :class:`Record` per run (model × input shape × precision × method × setting). The file
is ``{"schema": "remat3d.bench/1", "suite", "created", "command", "machine", "versions",
"records": [...]}``; every record repeats ``machine``, ``date`` and ``versions`` so it
stands alone when records from several files are merged.

Adding a field is a compatible change (readers ignore unknown fields); renaming or
changing the meaning of one bumps the version.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from remat3d.errors import Remat3dError
from remat3d.graph import atomic_write_text

__all__ = [
    "BENCH_SCHEMA",
    "STATUSES",
    "Record",
    "load_results",
    "machine_info",
    "validate_results",
    "versions_info",
    "write_results",
]

BENCH_SCHEMA = "remat3d.bench/1"
STATUSES = ("ok", "infeasible", "not-applicable", "error")
TIERS = ("meta", "cpu")


@dataclass
class Record:
    """One run. Byte and FLOP figures are for one training step at batch size 1.

    ``recompute_flops`` is the method's FLOPs minus the unplanned step's (same model, input
    and precision); ``None`` where not measured (``status`` other than ``"ok"``).
    """

    model: str
    input_shape: list[int]
    amp: str  # "none", "bf16" or "fp16"
    method: str  # "none", "torch-blocks", "checkpoint-sequential", "compile", "remat3d:<s>"
    tier: str  # "meta": tracker on the meta device; "cpu": a real CPU step
    setting: str = ""  # e.g. "segments=2", "memory_budget=0.5", "budget=0.8x"
    status: str = "ok"
    budget_bytes: int | None = None
    peak_bytes: int | None = None
    saved_bytes: int | None = None
    flops: int | None = None
    recompute_flops: int | None = None
    recompute_ratio: float | None = None  # recompute_flops / the unplanned step's flops
    step_time_ratio: float | None = None  # cpu tier: median time / unplanned median
    step_seconds: float | None = None  # cpu tier: median seconds of one step
    plan_seconds: float | None = None  # remat3d: plan(); compile: compilation + first step
    grads_equal: bool | None = None  # cpu tier: every gradient bitwise equal to unplanned
    buffers_equal: bool | None = None  # cpu tier: BatchNorm statistics etc. bitwise equal
    note: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    date: str = ""
    versions: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        """Raise ``Remat3dError`` unless the record is well formed."""
        where = f"record {self.model} {self.method} {self.setting}".strip()
        if self.status not in STATUSES:
            raise Remat3dError(f"{where}: status {self.status!r} is not one of {STATUSES}.")
        if self.tier not in TIERS:
            raise Remat3dError(f"{where}: tier {self.tier!r} is not one of {TIERS}.")
        if len(self.input_shape) != 5 or not all(isinstance(s, int) and s > 0
                                                 for s in self.input_shape):
            raise Remat3dError(f"{where}: input_shape {self.input_shape!r} is not BxCxDxHxW.")
        if self.status == "ok":
            for name in ("peak_bytes", "saved_bytes", "flops", "recompute_flops"):
                value = getattr(self, name)
                if not isinstance(value, int) or value < 0 and name != "recompute_flops":
                    raise Remat3dError(f"{where}: {name} must be a non-negative int, "
                                       f"got {value!r}.")
        if not self.date or not self.machine or not self.versions:
            raise Remat3dError(f"{where}: machine, date and versions are required.")


def machine_info() -> dict[str, Any]:
    """Where the bench ran (no host names or user names)."""
    import torch

    info: dict[str, Any] = {
        "system": platform.system(),
        "arch": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def versions_info() -> dict[str, str]:
    import remat3d

    out = {"remat3d": remat3d.__version__}
    for name in ("torch", "monai", "scipy", "numpy"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:  # pragma: no cover - every one is a dependency
            continue
    try:
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                check=False, text=True, timeout=5, cwd=Path(__file__).parent)
        if commit.returncode == 0:
            out["git"] = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_results(path: str | os.PathLike[str], records: list[Record], *, suite: str,
                  command: str) -> None:
    """Validate and write ``results.json`` atomically (temp file + rename)."""
    data = {
        "schema": BENCH_SCHEMA,
        "suite": suite,
        "created": now(),
        "command": command,
        "machine": machine_info(),
        "versions": versions_info(),
        "records": [asdict(r) for r in records],
    }
    validate_results(data)
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def validate_results(data: Any) -> list[Record]:
    """Check a ``results.json`` document against the schema; return its records."""
    if not isinstance(data, dict) or data.get("schema") != BENCH_SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise Remat3dError(f"Not a {BENCH_SCHEMA} results file (schema {got!r}).")
    for key in ("suite", "created", "machine", "versions", "records"):
        if key not in data:
            raise Remat3dError(f"results.json lacks the top-level field {key!r}.")
    known = {f.name for f in fields(Record)}
    records = []
    for raw in data["records"]:
        missing = {f.name for f in fields(Record) if f.name not in raw} - {"note"}
        if missing:
            raise Remat3dError(f"A record lacks the fields {sorted(missing)}: {raw!r}.")
        record = Record(**{k: v for k, v in raw.items() if k in known})
        record.check()
        records.append(record)
    return records


def load_results(path: str | os.PathLike[str]) -> list[Record]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise Remat3dError(f"Cannot read bench results {str(path)!r}: {exc}.") from None
    return validate_results(data)

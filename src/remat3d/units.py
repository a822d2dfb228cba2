"""Parsing and formatting of byte sizes and input shapes.

>>> parse_bytes("12GiB")
12884901888
>>> parse_bytes("500MB")
500000000
>>> format_bytes(3 * 2**30)
'3.00 GiB'
>>> parse_shape("1x1x64x64x64")
(1, 1, 64, 64, 64)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from remat3d.errors import BudgetError, InputShapeError, Remat3dError

__all__ = ["format_bytes", "format_shape", "parse_amp", "parse_bytes", "parse_shape"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_LARGEST = 2**60  # an exbibyte: anything larger is a typo
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """Parse ``"12GiB"``, ``"500MB"``, ``"1.5G"`` (binary) or an int of bytes into bytes."""
    if isinstance(text, bool):
        raise BudgetError(f"A byte size must be a number or a string like '12GiB', not {text!r}.")
    if isinstance(text, int):
        if text < 0:
            raise BudgetError(f"A byte size cannot be negative, got {text}.")
        return text
    match = _SIZE_RE.match(str(text))
    if match is None or match.group(2).lower() not in _UNITS:
        raise BudgetError(
            f"Cannot read {text!r} as a byte size. Use a number with a unit, e.g. '12GiB', "
            "'500MB', '1.5G', or a plain integer of bytes."
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    value = number * _UNITS[unit]
    if not math.isfinite(value) or value > _LARGEST:
        raise BudgetError(f"{text!r} is larger than any memory ({format_bytes(_LARGEST)} at "
                          "most). Give a size like '12GiB'.")
    if unit in ("", "b") and number != int(number):
        hint = (f" For a budget, did you mean '{match.group(1)}x' (a fraction of the "
                "unplanned peak)?" if number < 1 else "")
        raise BudgetError(f"{text!r} reads as a fraction of a byte.{hint} A size needs a "
                          "unit ('12GiB', '500MB') or a whole number of bytes.")
    return round(value)


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``'3.00 GiB'``, ``'512.0 MiB'``, ``'12 B'``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            digits = 2 if unit in ("TiB", "GiB") else 1
            return f"{sign}{n / scale:.{digits}f} {unit}"
    return f"{sign}{int(n)} B"


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse an input shape ``"1x1x64x64x64"`` (also ``,`` or ``*`` separated)."""
    parts = [p for p in re.split(r"[x×,*\s]+", str(text).strip().lower()) if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(s <= 0 for s in shape):
        raise InputShapeError(
            f"Cannot read {text!r} as an input shape. Write batch x channels x D x H x W, "
            "e.g. '1x1x128x128x128'."
        )
    return shape


def format_shape(shape: Sequence[int]) -> str:
    """``'1x1x64x64x64'``: a shape (or a tile) as the CLI and messages write it."""
    return "x".join(str(int(s)) for s in shape)


_AMP = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
        "none": None, "fp32": None, "no": None, "off": None, "": None}


def parse_amp(amp: str | None) -> str | None:
    """Autocast setting: ``"bf16"``, ``"fp16"``, or ``None`` (no autocast: ``None``,
    ``"none"``, ``"fp32"``, ...).

    >>> parse_amp("BF16"), parse_amp("none"), parse_amp(None)
    ('bf16', None, None)
    """
    if amp is None:
        return None
    key = str(amp).strip().lower()
    if key not in _AMP:
        raise Remat3dError(f"Unknown amp setting {amp!r}. Use one of: none, bf16, fp16.")
    return _AMP[key]

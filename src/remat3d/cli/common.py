"""What every command shares: the consoles, one-line errors, building the model.

The CLI owns the terminal: the library logs, the commands print (rich tables, progress).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from remat3d.errors import Remat3dError

__all__ = ["build", "console", "err_console", "progress", "quiet_native_stdout",
           "user_errors"]

console = Console()
err_console = Console(stderr=True)


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a Remat3dError into one red line and exit status 2.

    The message is printed as text, not rich markup: ``pip install 'remat3d[demo]'`` keeps
    its brackets, and a path holding ``[/...]`` cannot break the printing."""

    @wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except Remat3dError as exc:
            # one logical line: the terminal wraps it, so file paths stay whole for copying
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False,
                              soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


@contextlib.contextmanager
def quiet_native_stdout() -> Iterator[None]:
    """File descriptor 1 pointed at /dev/null while the block runs.

    HiGHS (the MILP solver behind ``scipy.optimize.milp``) prints some diagnostics
    straight to fd 1 whatever its output options say (HiGHS issue 2734); a command whose
    stdout is machine-read (``--json``) wraps its planning in this. Only the CLI does: a
    library must not redirect its caller's file descriptors."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no real stdout (some embedded interpreters)
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


class _StatusHandler(logging.Handler):
    """The library's INFO records as the spinner's text: what it is doing, and since when."""

    def __init__(self, status: Any, title: str) -> None:
        super().__init__(logging.INFO)
        self.status, self.title, self.start = status, title, time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = (record.getMessage().splitlines() or [""])[0]
        except (TypeError, ValueError):  # a record that cannot be formatted is no progress
            return
        width = max(20, console.width - len(self.title) - 16)
        if len(message) > width:
            message = message[:width - 1] + "…"
        elapsed = time.monotonic() - self.start
        self.status.update(f"{self.title} · {elapsed:.0f} s · {escape(message)}")


@contextlib.contextmanager
def progress(title: str) -> Iterator[None]:
    """A spinner titled ``title`` that shows the library's progress (its INFO log records,
    from the ``remat3d`` logger) while the block runs; the logger is as it was after."""
    logger = logging.getLogger("remat3d")
    with console.status(title, spinner="dots") as status:
        handler = _StatusHandler(status, title)
        level = logger.level
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)


def build(model: str, input: str | None, model_kwargs: str | None) -> tuple[Any, tuple]:
    """The model (on meta) and the input shape a command was given."""
    from remat3d import zoo
    from remat3d.units import parse_shape

    kwargs = zoo.parse_model_kwargs(model_kwargs)
    preset = zoo.PRESETS.get(model)
    if input is None:
        channels = int(kwargs.get("in_channels", preset.in_channels if preset else 1))
        shape: tuple[int, ...] = (1, channels, 128, 128, 128)
    else:
        shape = parse_shape(input)
    geometry_kwargs = set(kwargs) - zoo.SIZE_NEUTRAL_KWARGS
    if preset is not None:
        # the preset's divisibility rule is that of its default geometry; other strides,
        # depths or kernels are checked on the model built from them (below)
        zoo.check_input_shape(preset, shape, kwargs, divisibility=not geometry_kwargs)
    if len(shape) < 3:
        raise Remat3dError(f"Input shape {input!r} needs batch, channels and spatial sizes.")
    net = zoo.build_model(model, kwargs, spatial_size=tuple(shape[2:]), device="meta")
    if preset is not None and geometry_kwargs and preset.task == "segmentation":
        _check_probed_shape(net, shape, model)
    return net, shape


def _check_probed_shape(net: Any, shape: tuple[int, ...], model: str) -> None:
    """``shape`` against the divisor and smallest edge of the network actually built
    (``data.padding.probe_geometry``: found on meta)."""
    from remat3d.data.padding import padded_shape, probe_geometry
    from remat3d.errors import InputShapeError
    from remat3d.units import format_shape

    geometry = probe_geometry(net, shape[1])
    k, smallest = geometry.divisor, geometry.min_size
    fixed = (*shape[:2], *padded_shape(tuple(shape[2:]), k, smallest))
    if fixed == tuple(shape):
        return
    raise InputShapeError(
        f"{model} with these model kwargs needs every spatial size divisible by {k} and at "
        f"least {smallest} (found by probing the network they build); got "
        f"{format_shape(shape)}. Pad to {format_shape(fixed)}."
    )

"""The ``remat3d`` command line: one module per command, registered here.

Heavy modules (torch, MONAI) are imported inside commands so ``--help`` answers at once.
Every error a user can cause is a ``Remat3dError``: printed as one line, no traceback,
exit status 2 (``common.user_errors``).
"""

from __future__ import annotations

import typer

from remat3d.cli.bench import bench_app
from remat3d.cli.common import user_errors
from remat3d.cli.demo import demo_command
from remat3d.cli.nnunet import nnunet_app
from remat3d.cli.plan import plan_command
from remat3d.cli.predict import predict_command
from remat3d.cli.profile import profile_command
from remat3d.cli.train import train_command

__all__ = ["app", "main"]

app = typer.Typer(
    name="remat3d",
    help="Measure and plan gradient checkpointing so 3D networks train on whole volumes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """remat3d: whole-volume training of 3D networks within a memory budget."""


app.command("profile")(user_errors(profile_command))
app.command("plan")(user_errors(plan_command))
app.command("predict")(user_errors(predict_command))
app.add_typer(bench_app, name="bench")
app.command("train", context_settings={"allow_extra_args": True,
                                       "ignore_unknown_options": True})(
    user_errors(train_command))
app.command("demo")(user_errors(demo_command))
app.add_typer(nnunet_app, name="nnunet")


def main() -> None:
    app()

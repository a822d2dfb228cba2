"""``python -m remat3d``: the command line (same as the ``remat3d`` script)."""

from remat3d.cli import main

main()

"""``python -m remat3d.cli``: the command line."""

from remat3d.cli import main

main()

"""``python -m fedkit`` runs the command line."""

from fedkit.cli import main

main()

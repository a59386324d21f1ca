"""``python -m fedkit`` runs the command line."""

from fedkit.cli.app import main

main()

"""The ``fedkit`` command line and what only it uses: progress, reports, comparisons, the
new-plugin template, the reference pages."""

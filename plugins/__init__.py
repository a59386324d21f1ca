"""fedkit's built-in plugins, each registered through the ``fedkit`` entry-point group."""

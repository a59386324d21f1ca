"""fedkit: federated representation learning and clustered FL, composed from plugins."""

import pluggy

__version__ = "0.1.0"

PROJECT = "fedkit"
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Decorator marking a plugin method as the implementation of a fedkit hook."""

__all__ = ["PROJECT", "hookimpl", "__version__"]

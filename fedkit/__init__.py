"""fedkit: federated representation learning and clustered FL, composed from plugins."""

import pluggy

from fedkit.options import PluginOptions

__version__ = "0.2.0"

PROJECT = "fedkit"
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Decorator marking a plugin method as the implementation of a fedkit hook."""

__all__ = ["PROJECT", "PluginOptions", "hookimpl", "__version__"]

"""fedkit: federated representation learning and clustered FL, composed from plugins."""

from fedkit.plugin.markers import PROJECT, hookimpl
from fedkit.plugin.options import PluginOptions

__version__ = "0.2.0"

__all__ = ["PROJECT", "PluginOptions", "hookimpl", "__version__"]

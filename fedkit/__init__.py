"""fedkit: federated representation learning and clustered FL, composed from plugins.

What a plugin author imports is here: ``hookimpl``, ``PluginOptions``, ``DROP``, the
objects hooks receive (``ClientContext``, ``Server``, ``Upload``, ``ClientInfo``), the
``Objective`` local training minimises, ``Recipe`` and its errors, ``derive`` for seeds,
and ``run`` to run a recipe from Python. The heavier names load on first use, so
``import fedkit`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from fedkit.plugin import migration
from fedkit.plugin.markers import DROP, PROJECT, hookimpl
from fedkit.plugin.options import PluginOptions

__version__ = "0.3.0"

PUBLIC = {
    "ClientContext": "fedkit.plugin.context",
    "Server": "fedkit.core.server",
    "Upload": "fedkit.core.server",
    "ClientInfo": "fedkit.core.server",
    "Objective": "fedkit.training.loop",
    "Recipe": "fedkit.config.schema",
    "load_recipe": "fedkit.config.schema",
    "RecipeError": "fedkit.errors",
    "FedkitError": "fedkit.errors",
    "derive": "fedkit.seeding",
    "run": "fedkit.core.runs",
}
"""The names loaded on first use, and their homes."""

migration.install()


def __getattr__(name: str) -> Any:
    if name in PUBLIC:
        value = getattr(importlib.import_module(PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fedkit' has no attribute {name!r}")


__all__ = ["DROP", "PROJECT", "PluginOptions", "__version__", "hookimpl", *PUBLIC]

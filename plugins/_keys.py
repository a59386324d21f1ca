"""Where a plugin's options sit in the recipe, for the errors built-in plugins raise."""

from __future__ import annotations

from fedkit import Server


def option_key(server: Server, name: str) -> str:
    """``plugins.N.<name>``: plugin ``name``'s entry in the recipe (``plugins.<name>`` when
    the recipe does not list it by that name)."""
    names = [spec.name for spec in server.recipe.plugins]
    return f"plugins.{names.index(name)}.{name}" if name in names else f"plugins.{name}"

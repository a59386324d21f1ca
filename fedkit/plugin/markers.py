"""The pluggy project name and the decorator that marks a hook implementation."""

from __future__ import annotations

import pluggy

PROJECT = "fedkit"
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Decorator marking a plugin method as the implementation of a fedkit hook."""
hookspec = pluggy.HookspecMarker(PROJECT)
"""Decorator marking a function in ``fedkit.plugin.hookspecs`` as a hook specification."""


class _Drop:
    """The one ``DROP`` value (a singleton that survives pickling)."""

    _instance: _Drop | None = None

    def __new__(cls) -> _Drop:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> str:
        return "DROP"

    def __repr__(self) -> str:
        return "fedkit.DROP"


DROP = _Drop()
"""A claim's value that removes its key: withheld from an upload (``upload_selection``),
removed from the cluster state (``aggregate``)."""

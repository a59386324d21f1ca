"""The pluggy project name and the decorator that marks a hook implementation."""

from __future__ import annotations

import pluggy

PROJECT = "fedkit"
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Decorator marking a plugin method as the implementation of a fedkit hook."""
hookspec = pluggy.HookspecMarker(PROJECT)
"""Decorator marking a function in ``fedkit.plugin.hookspecs`` as a hook specification."""

"""What changed for plugin authors between contract v2 (fedkit 0.2) and v3 (fedkit 0.3),
and the adapters that keep a v2 plugin working where that is possible.

Every adapter tells the author once per process, in one line, what to write instead
(``notice``); decision 0012 has the whole table. Old import paths are served by
``fedkit.plugin.moved``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

DECISION = "docs/decisions/0012-fedkit-1-architecture.md"


class FedkitDeprecationWarning(FutureWarning):
    """Something written for an older plugin contract that still works, for now."""


_told: set[str] = set()


def notice(message: str) -> None:
    """Warn once per process with ``message`` and where the migration table is."""
    if message in _told:
        return
    _told.add(message)
    warnings.warn(f"{message} (see {DECISION})", FedkitDeprecationWarning, stacklevel=3)


class LegacyRow(dict):
    """What a v2 ``round_end(server, metrics)`` receives: the row so far, whose new
    entries go to ``server.log``."""

    def __init__(self, server: Any, plugin: str) -> None:
        super().__init__(server._row)
        self._server, self._plugin = server, plugin

    def __setitem__(self, key: str, value: Any) -> None:
        notice(
            f"plugin {self._plugin!r}: round_end no longer receives the metrics row to "
            "change; report with server.log(name=value)"
        )
        super().__setitem__(key, value)
        self._server.log(**{key: value})

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


def _recipe(kwargs: dict[str, Any], plugin: str, hook: str) -> Any:
    notice(f"plugin {plugin!r}: hook {hook!r} no longer takes 'recipe'; use server.recipe")
    return kwargs["server"].recipe


def _row(kwargs: dict[str, Any], plugin: str, hook: str) -> Any:
    return LegacyRow(kwargs["server"], plugin)


LEGACY_ARGUMENTS: dict[str, dict[str, Callable[[dict[str, Any], str, str], Any]]] = {
    "configure": {"recipe": _recipe},
    "private_keys": {"recipe": _recipe},
    "kept_keys": {"recipe": _recipe},
    "auxiliary_keys": {"recipe": _recipe},
    "round_end": {"metrics": _row},
}
"""Per hook, the v2 arguments a v3 call can still give a plugin, and how."""

RETURNED_METRICS = {
    "local_train": "ctx.log",
    "after_local_train": "ctx.log",
    "evaluate": "server.log",
}
"""Hooks whose v2 implementations returned metrics; v3 reports them with one call."""


def returned_metrics(plugin: str, hook: str) -> None:
    notice(
        f"plugin {plugin!r}: {hook} returned metrics; report them with "
        f"{RETURNED_METRICS[hook]}(name=value) (logged this time)"
    )


def claimed_none(plugin: str, hook: str, key: str) -> None:
    notice(
        f"plugin {plugin!r}: {hook} claimed {key!r} with None; claim it with fedkit.DROP "
        "to remove a key (removed this time)"
    )


REMOVED_ATTRIBUTES = {
    "defers": "'defers' is gone: two plugins answering one firstresult hook is an error",
}
"""Plugin attributes v3 no longer reads, and what to do instead."""

"""What changed for plugin authors between contract v2 (fedkit 0.2) and v3 (fedkit 0.3),
and what keeps a v2 plugin working where that is possible: adapters for hooks whose
arguments or results changed, and old import paths served from the new homes (fedkit 0.3
arranged ``fedkit/`` in packages by layer).

Each tells the author once per process, in one line, what to write instead (``notice``);
decision 0012 has the whole table.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
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


MOVED: dict[str, tuple[str, dict[str, str]]] = {
    "fedkit.client": (
        "fedkit.plugin.context",
        {"ClientData": "fedkit.data.federated", "ClientMemory": "fedkit.rundir.store"},
    ),
    "fedkit.server": ("fedkit.core.server", {}),
    "fedkit.fit": ("fedkit.training.loop", {}),
    "fedkit.keys": ("fedkit.plugin.keys", {}),
    "fedkit.recipe": ("fedkit.config.schema", {}),
    "fedkit.recipes": ("fedkit.config.shipped", {}),
    "fedkit.options": ("fedkit.plugin.options", {}),
    "fedkit.hookspecs": ("fedkit.plugin.hookspecs", {}),
    "fedkit.plugins": ("fedkit.plugin.registry", {"Plugins": "fedkit.plugin.manager"}),
    "fedkit.precision": ("fedkit.training.precision", {}),
    "fedkit.checkpoint": ("fedkit.rundir.checkpoint", {}),
    "fedkit.logs": ("fedkit.rundir.logs", {}),
    "fedkit.engine": ("fedkit.core.engine", {}),
    "fedkit.messages": ("fedkit.core.messages", {}),
    "fedkit.ledger": ("fedkit.core.ledger", {}),
    "fedkit.state_store": ("fedkit.rundir.store", {}),
    "fedkit.aggregation": ("fedkit.core.aggregation", {}),
    "fedkit.evaluation.runner": ("fedkit.evaluation.scoring", {}),
    "fedkit.evaluation.offline": ("fedkit.cli.offline_eval", {}),
    "fedkit.diagnostics": ("fedkit.plugin.authoring", {"dry_round": "fedkit.core.runs"}),
    "fedkit.newplugin": ("fedkit.cli.newplugin", {}),
}
"""Old module → (new module, names that went elsewhere: name → their module)."""


class _Moved(types.ModuleType):
    """An old module path: every name is looked up in its new home."""

    def __init__(self, old: str, new: str, elsewhere: dict[str, str]) -> None:
        super().__init__(old, f"moved to {new} (fedkit 0.3)")
        self._new, self._elsewhere = new, elsewhere

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        home = self._elsewhere.get(name, self._new)
        public = getattr(sys.modules.get("fedkit"), "PUBLIC", {})
        where = "fedkit" if public.get(name) == home else home
        notice(f"{self.__name__}.{name} moved: import it from {where}")
        return getattr(importlib.import_module(home), name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new, elsewhere = MOVED[spec.name]
        return _Moved(spec.name, new, elsewhere)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: names resolve on access."""


def install() -> None:
    """Serve the old paths (once per process)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())

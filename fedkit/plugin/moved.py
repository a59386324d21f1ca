"""Old import paths (fedkit 0.2) that still work, with a one-line notice naming the new one.

fedkit 0.3 arranged ``fedkit/`` in packages by layer (decision 0012). A plugin written for
0.2 imports, say, ``fedkit.client``; this finder answers such an import with a module
whose names come from their new homes, and tells the author once where they are now.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

from fedkit.plugin.migration import notice

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

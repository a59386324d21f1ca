"""Plugin discovery and activation.

Plugins are found through the ``fedkit`` entry-point group, built-in ones included. An
entry point names a class or a module. A class is constructed once per run with the
plugin's options from the recipe (validated by its nested pydantic ``Options`` model, if
it has one), so plugin state never outlives a run; a module is registered as it is.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError

from fedkit import PROJECT, hookspecs
from fedkit.errors import (
    ClaimConflict,
    FedkitError,
    PluginError,
    RecipeError,
    did_you_mean,
    unknown_hint,
)
from fedkit.recipe import Recipe, expected_from

GROUP = "fedkit"


def discover() -> dict[str, EntryPoint]:
    """Every installed plugin by name, from the ``fedkit`` entry-point group."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def hook_names() -> list[str]:
    """Hook names in the order a run calls them (the order of ``hookspecs.py``)."""
    return [
        name
        for name, fn in vars(hookspecs).items()
        if callable(fn) and hasattr(fn, f"{PROJECT}_spec")
    ]


def implemented_hooks(obj: Any) -> list[str]:
    """Which hooks a plugin class or module implements."""
    return [name for name in hook_names() if hasattr(getattr(obj, name, None), f"{PROJECT}_impl")]


@dataclass
class PluginInfo:
    """What ``fedkit plugins`` shows about one installed plugin."""

    name: str
    package: str
    version: str
    hooks: list[str]
    uploads_data_derived: bool
    summary: str


def describe(ep: EntryPoint) -> PluginInfo:
    """Load one entry point and summarise it."""
    obj = ep.load()
    dist = ep.dist
    doc = inspect.getdoc(obj) or ""
    return PluginInfo(
        name=ep.name,
        package=dist.name if dist else "?",
        version=dist.version if dist else "?",
        hooks=implemented_hooks(obj),
        uploads_data_derived=bool(getattr(obj, "uploads_data_derived", False)),
        summary=doc.splitlines()[0] if doc else "",
    )


def _instantiate(name: str, obj: Any, options: dict[str, Any], index: int) -> Any:
    where = f"plugins.{index}.{name}"
    if not inspect.isclass(obj):
        if options:
            raise RecipeError(where, "no options (this plugin takes none)", options)
        return obj
    schema = getattr(obj, "Options", None)
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        try:
            options = schema.model_validate(options)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                known = list(schema.model_fields)
                expected = "one of the options " + ", ".join(known) if known else "no options"
                hint = unknown_hint(key, known, "option")
                raise RecipeError(f"{where}.{key}", expected, hint=hint) from None
            expected = expected_from(err["msg"])
            raise RecipeError(f"{where}.{key}", expected, err.get("input")) from None
    elif options:
        raise RecipeError(where, "no options (this plugin declares none)", options)
    return obj(options) if schema is not None else obj()


class Plugins:
    """The plugins active in one run, wrapped around a ``pluggy.PluginManager``."""

    def __init__(self, recipe: Recipe, available: dict[str, EntryPoint] | None = None) -> None:
        available = discover() if available is None else available
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.names: list[str] = []
        self.objects: dict[str, Any] = {}
        loaded = []
        for index, spec in enumerate(recipe.plugins):
            if spec.name not in available:
                raise RecipeError(
                    f"plugins.{index}",
                    "an installed plugin (see `fedkit plugins`)",
                    spec.name,
                    hint=did_you_mean(spec.name, available),
                )
            if spec.name in self.objects:
                raise RecipeError(f"plugins.{index}", "each plugin once", spec.name)
            obj = _instantiate(spec.name, available[spec.name].load(), spec.options, index)
            self.objects[spec.name] = obj
            loaded.append((spec.name, obj))
        for name, obj in reversed(loaded):  # pluggy calls last-registered first
            self.pm.register(obj, name=name)
            self._wrap_errors(obj, name)
        self.names = [name for name, _ in loaded]
        if os.environ.get("FEDKIT_TRACE_PLUGINS") == "1":
            self.pm.add_hookcall_monitoring(self._trace_before, lambda *a: None)

    def _wrap_errors(self, obj: Any, name: str) -> None:
        """Re-raise any non-fedkit exception from this plugin's hooks as a ``PluginError``."""
        for caller in self.pm.get_hookcallers(obj) or []:
            for impl in caller.get_hookimpls():
                if impl.plugin is obj:
                    impl.function = _guard(impl.function, name, caller.name)

    @staticmethod
    def _trace_before(hook_name: str, impls: list, kwargs: dict) -> None:
        names = ", ".join(impl.plugin_name for impl in impls) or "(none)"
        print(f"[fedkit] {hook_name} -> {names}", file=sys.stderr)

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def uploads_data_derived(self) -> list[str]:
        """Active plugins that declare data-derived uploads."""
        return [n for n, o in self.objects.items() if getattr(o, "uploads_data_derived", False)]

    def claims(self, hook: str, **kwargs: Any) -> dict[str, Any]:
        """Call a key-level hook on every plugin and merge the claimed keys.

        Raises ``ClaimConflict`` when two plugins claim one key.
        """
        caller = getattr(self.pm.hook, hook)
        owners: dict[str, str] = {}
        merged: dict[str, Any] = {}
        impls = caller.get_hookimpls()
        if os.environ.get("FEDKIT_TRACE_PLUGINS") == "1":
            self._trace_before(hook, impls, kwargs)
        for impl in reversed(impls):  # recipe order
            result = impl.function(*[kwargs[arg] for arg in impl.argnames])
            for key, value in (result or {}).items():
                if key in owners:
                    raise ClaimConflict(hook, key, owners[key], impl.plugin_name)
                owners[key] = impl.plugin_name
                merged[key] = value
        return merged


def _guard(fn: Any, plugin: str, hook: str) -> Any:
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (FedkitError, PluginError):
            raise
        except Exception as exc:
            raise PluginError(plugin, hook, exc) from exc

    return guarded

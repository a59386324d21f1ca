"""Plugin discovery and activation, one plugin manager per side of a run.

Plugins are found through the ``fedkit`` entry-point group, built-in ones included. An
entry point names a class or a module. Each side of a run (the server, and every place
clients run) builds its own ``Plugins`` from the recipe: a class is constructed with its
options (validated by its nested ``Options`` model; unknown keys are errors), so the two
sides never share an instance. A module is registered as it is and takes no options.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError
from torch import Tensor

from fedkit.config.schema import Recipe, expected_from
from fedkit.errors import (
    ClaimConflict,
    ClaimMismatch,
    FedkitError,
    PluginError,
    RecipeError,
    did_you_mean,
    unknown_hint,
)
from fedkit.plugin import hookspecs
from fedkit.plugin.markers import PROJECT

GROUP = "fedkit"
SIDES = (hookspecs.SERVER, hookspecs.CLIENT)


def discover() -> dict[str, EntryPoint]:
    """Every installed plugin by name, from the ``fedkit`` entry-point group."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def hook_names(side: str | None = None) -> list[str]:
    """Hook names in the order a round calls them (the order of ``hookspecs.py``)."""
    return [
        name
        for name, fn in vars(hookspecs).items()
        if callable(fn) and hasattr(fn, f"{PROJECT}_spec") and (side is None or fn.side == side)
    ]


def hook_side(name: str) -> str:
    return getattr(hookspecs, name).side


def hook_kind(name: str) -> str:
    return getattr(hookspecs, name).kind


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

    def hooks_by_side(self) -> dict[str, list[str]]:
        return {side: [h for h in self.hooks if hook_side(h) == side] for side in SIDES}


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


def _validate_options(schema: type[BaseModel], options: dict[str, Any], where: str) -> BaseModel:
    known = list(schema.model_fields)
    for key in options:
        if key not in known:
            expected = "one of the options " + ", ".join(known) if known else "no options"
            raise RecipeError(f"{where}.{key}", expected, hint=unknown_hint(key, known, "option"))
    try:
        return schema.model_validate(options)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise RecipeError(
                f"{where}.{key}", "a known option", hint=" (unknown option)"
            ) from None
        raise RecipeError(f"{where}.{key}", expected_from(err["msg"]), err.get("input")) from None


def load(name: str, entry_point: Any, index: int) -> Any:
    """An entry point's target, or a clear error when it cannot be imported."""
    try:
        return entry_point.load()
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to see
        raise RecipeError(
            f"plugins.{index}",
            f"an importable plugin ({name!r} fails to import: {type(exc).__name__}: {exc})",
            name,
        ) from None


def check_authoring(name: str, obj: Any, index: int) -> None:
    """Refuse a plugin with authoring mistakes (``fedkit.plugin.authoring.check_plugin``)."""
    from fedkit.plugin.authoring import check_plugin

    found = check_plugin(name, obj)
    if found:
        raise RecipeError(
            f"plugins.{index}",
            "a plugin without authoring mistakes",
            hint=": " + "; ".join(str(f) for f in found),
        )


def instantiate(name: str, obj: Any, options: dict[str, Any], index: int) -> Any:
    """A plugin instance for one side: the class built with validated options, or the module."""
    where = f"plugins.{index}.{name}"
    if not inspect.isclass(obj):
        if options:
            raise RecipeError(where, "no options (this plugin takes none)", options)
        return obj
    schema = getattr(obj, "Options", None)
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return obj(_validate_options(schema, options, where))
    if options:
        raise RecipeError(where, "no options (this plugin declares none)", options)
    return obj()


class Plugins:
    """The plugins active on one side of a run, around a ``pluggy.PluginManager``.

    ``side`` is ``"server"`` or ``"client"``; calling a hook of the other side is a bug
    in the core and raises. ``available`` maps plugin names to entry points (or objects
    with ``load()``); by default the installed ones.
    """

    def __init__(
        self,
        recipe: Recipe,
        available: dict[str, Any] | None = None,
        side: str = hookspecs.SERVER,
    ) -> None:
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        self.side, self.recipe = side, recipe
        self.custom = available is not None
        self.available = discover() if available is None else available
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.objects: dict[str, Any] = {}
        for index, spec in enumerate(recipe.plugins):
            if spec.name not in self.available:
                raise RecipeError(
                    f"plugins.{index}",
                    "an installed plugin (see `fedkit plugins`)",
                    spec.name,
                    hint=did_you_mean(spec.name, self.available),
                )
            if spec.name in self.objects:
                raise RecipeError(f"plugins.{index}", "each plugin once", spec.name)
            loaded = load(spec.name, self.available[spec.name], index)
            if side == hookspecs.SERVER:
                check_authoring(spec.name, loaded, index)
            self.objects[spec.name] = instantiate(spec.name, loaded, spec.options, index)
        for name, obj in reversed(self.objects.items()):  # pluggy calls last-registered first
            self.pm.register(obj, name=name)
            self._check_impls(obj, name)
        self.names = list(self.objects)
        if side == hookspecs.SERVER:
            self._check_shadowing()
        self.observers: list[Callable[[str, list[str], dict[str, Any]], None]] = []
        if os.environ.get("FEDKIT_TRACE_PLUGINS") == "1":
            self.observe(self._trace)

    def _check_impls(self, obj: Any, name: str) -> None:
        """Reject wrappers on hooks fedkit calls itself; name plugin errors by plugin and hook."""
        for caller in self.pm.get_hookcallers(obj) or []:
            for impl in caller.get_hookimpls():
                if impl.plugin is not obj:
                    continue
                if (impl.wrapper or impl.hookwrapper) and hook_kind(caller.name) in (
                    "claims",
                    "chain",
                ):
                    raise RecipeError(
                        f"plugins ({name})",
                        f"a plain implementation of {hook_kind(caller.name)} hook "
                        f"{caller.name!r} (wrapper=True/hookwrapper=True cannot claim keys)",
                        "a wrapper",
                    )
                impl.function = _guard(impl.function, name, caller.name)

    def _check_shadowing(self) -> None:
        """A firstresult hook answered by two plugins: the second never runs — an error,
        unless the first declares it may pass (``defers = ("hook", ...)``)."""
        for hook in hook_names():
            if hook_kind(hook) != "firstresult":
                continue
            names = [n for n, o in self.objects.items() if hook in implemented_hooks(o)]
            for first, second in zip(names, names[1:], strict=False):
                if hook not in getattr(self.objects[first], "defers", ()):
                    raise RecipeError(
                        "plugins",
                        f"one plugin answering {hook!r}: {first!r} answers it first, so "
                        f"{second!r}'s {hook} would never run — remove one of them (a "
                        f"plugin that passes some calls on declares defers = ({hook!r},))",
                        [first, second],
                    )

    def observe(self, observer: Callable[[str, list[str], dict[str, Any]], None]) -> None:
        """Call ``observer(hook, plugin_names, kwargs)`` before every hook call on this
        side (``FEDKIT_TRACE_PLUGINS=1`` prints them this way)."""
        self.observers.append(observer)

    @staticmethod
    def _trace(hook: str, names: list[str], kwargs: dict[str, Any]) -> None:
        print(f"[fedkit] {hook} -> {', '.join(names) or '(none)'}", file=sys.stderr)

    def _caller(self, hook: str) -> Any:
        if hook_side(hook) != self.side:
            raise RuntimeError(f"hook {hook!r} runs on the {hook_side(hook)} side, not {self.side}")
        return getattr(self.pm.hook, hook)

    def _impls(self, hook: str, kwargs: dict[str, Any]) -> list[Any]:
        """Implementations in recipe order (observers are told about the call)."""
        impls = list(reversed(self._caller(hook).get_hookimpls()))
        for observer in self.observers:
            observer(hook, [impl.plugin_name for impl in impls], kwargs)
        return impls

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call an ``all`` hook (list of results) or a ``firstresult`` one (one result)."""
        if self.observers:
            self._impls(hook, kwargs)
        return self._caller(hook)(**kwargs)

    def implementers(self, hook: str) -> list[str]:
        """Names of the active plugins implementing ``hook``, in recipe order."""
        return [impl.plugin_name for impl in reversed(self._caller(hook).get_hookimpls())]

    def wants(self, hook: str, argument: str) -> bool:
        """Whether any active implementation of ``hook`` takes ``argument`` (so a costly
        argument is computed only for plugins that read it)."""
        return any(argument in impl.argnames for impl in self._caller(hook).get_hookimpls())

    def claims(
        self, hook: str, reference: dict[str, Any] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """Call a claims hook on every plugin and merge the claimed keys.

        Raises ``ClaimConflict`` when two plugins claim one key, and ``ClaimMismatch``
        when a claimed tensor differs in shape or dtype from ``reference[key]``.
        """
        owners: dict[str, str] = {}
        merged: dict[str, Any] = {}
        for impl in self._impls(hook, kwargs):
            result = impl.function(*[kwargs[arg] for arg in impl.argnames])
            for key, value in (result or {}).items():
                if key in owners:
                    raise ClaimConflict(hook, key, owners[key], impl.plugin_name)
                owners[key] = impl.plugin_name
                merged[key] = value
                if reference is not None and key in reference and isinstance(value, Tensor):
                    expected = reference[key]
                    if value.shape != expected.shape or value.dtype != expected.dtype:
                        raise ClaimMismatch(hook, key, impl.plugin_name, value, expected)
        return merged

    def chain(self, hook: str, value_arg: str, **kwargs: Any) -> Any:
        """Call a chain hook: each plugin in recipe order may replace ``kwargs[value_arg]``."""
        for impl in self._impls(hook, kwargs):
            result = impl.function(*[kwargs[arg] for arg in impl.argnames])
            if result is not None:
                kwargs[value_arg] = result
        return kwargs[value_arg]

    def uploads_data_derived(self) -> list[str]:
        """Active plugins that declare data-derived uploads."""
        return [n for n, o in self.objects.items() if getattr(o, "uploads_data_derived", False)]


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

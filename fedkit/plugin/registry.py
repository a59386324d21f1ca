"""Installed plugins and what they register: the one way to extend fedkit.

Every plugin, built-in or not, is an entry point in the ``fedkit`` group. Method plugins
are activated by a recipe (``plugins:``); the *registry* hooks (``register_datasets``,
``register_partitioners``, ``register_executors``, ``register_stores``) run once per
process on every installed plugin, and fill the registries a recipe's names are looked up
in. fedkit's own data sets, partitioners, executors and stores come from its default
plugins the same way.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from typing import Any, Generic, TypeVar

import pluggy

from fedkit.data.datasets import Dataset
from fedkit.errors import FedkitError, RecipeError, did_you_mean
from fedkit.plugin import hookspecs
from fedkit.plugin.entrypoints import RegistryWarning, discover
from fedkit.plugin.markers import PROJECT

T = TypeVar("T")


def installed(plugin: Any) -> bool:
    """Whether a plugin is an installed entry point (any process with the same packages
    can load it) rather than an object given in-process. Duck-typed: once a package
    imports the ``importlib_metadata`` backport (MLflow does), ``importlib.metadata``
    hands out the backport's ``EntryPoint`` objects."""
    return isinstance(plugin, EntryPoint) or (
        isinstance(getattr(plugin, "value", None), str)
        and isinstance(getattr(plugin, "group", None), str)
        and callable(getattr(plugin, "load", None))
    )


def hook_names(side: str | None = None) -> list[str]:
    """Hook names in the order a run calls them (the order of ``hookspecs.py``)."""
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


def registers_only(obj: Any) -> bool:
    """Whether a plugin implements registry hooks and nothing else (it is active without
    being named in a recipe)."""
    hooks = implemented_hooks(obj)
    return bool(hooks) and all(hook_side(h) == hookspecs.REGISTRY for h in hooks)


@dataclass(frozen=True)
class HookFailure:
    """A registry hook that raised: which plugin, its package, the hook and the error."""

    plugin: str
    package: str
    hook: str
    error: str

    def __str__(self) -> str:
        where = f" (package {self.package})" if self.package else ""
        return f"plugin {self.plugin!r}{where} failed in {self.hook}: {self.error}"


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered thing: its name, the value (a loader, a factory) and the plugin that
    registered it."""

    name: str
    value: T
    plugin: str


@dataclass
class Registry(Generic[T]):
    """Registered things of one kind, by name (``kind``: "dataset", ...; ``key``: the recipe
    key that names one)."""

    kind: str
    key: str
    entries: dict[str, Entry[T]] = field(default_factory=dict)
    failed: list[HookFailure] = field(default_factory=list)

    def add(self, name: str, value: T, plugin: str) -> None:
        if not isinstance(name, str) or not name:
            raise FedkitError(f"plugin {plugin!r} registered a {self.kind} without a name")
        if name in self.entries:
            first = self.entries[name].plugin
            raise FedkitError(
                f"plugins {first!r} and {plugin!r} both register a {self.kind} named {name!r}; "
                "uninstall one of them"
            )
        self.entries[name] = Entry(name, value, plugin)

    def get(self, name: str) -> T:
        """The value registered under ``name``, or a ``RecipeError`` with a did-you-mean."""
        if name not in self.entries:
            broken = "".join(
                f"; {failure} (it may be the one that registers {name!r})"
                for failure in self.failed
            )
            raise RecipeError(
                self.key,
                f"a registered {self.kind}: one of {', '.join(sorted(self.entries))}",
                name,
                hint=did_you_mean(name, self.entries) + broken,
            )
        return self.entries[name].value

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.entries))


@dataclass
class Registries:
    """Everything the registry hooks added, one ``Registry`` per kind, and the hooks that
    raised (each kind's ``failed``; all of them, in hook order: ``failures``)."""

    datasets: Registry[Any]
    partitioners: Registry[Any]
    executors: Registry[Any]
    stores: Registry[Any]

    @property
    def failures(self) -> list[HookFailure]:
        return [failure for kind in self.kinds().values() for failure in kind.failed]

    def kinds(self) -> dict[str, Registry[Any]]:
        return {
            "register_datasets": self.datasets,
            "register_partitioners": self.partitioners,
            "register_executors": self.executors,
            "register_stores": self.stores,
        }


def _registrar(staged: list[tuple[str, Any, str]], hook: str) -> Callable[..., None]:
    """The ``register`` callable a registry hook receives (told the plugin's name): it
    stages each entry, added once the hook returns (a hook that raises adds none)."""
    if hook == "register_datasets":

        def add_dataset(name: str, load: Callable[..., Any], *, plugin: str, **facts: Any) -> None:
            staged.append((name, Dataset(load, **facts), plugin))

        return add_dataset

    def add(name: str, value: Any, *, plugin: str) -> None:
        staged.append((name, value, plugin))

    return add


def _bound(function: Callable[..., Any], plugin: str) -> Callable[..., Any]:
    """A registry hook whose ``register`` knows which plugin calls it."""

    def hook(register: Callable[..., None]) -> Any:
        return function(functools.partial(register, plugin=plugin))

    hook.__dict__.update(getattr(function, "__dict__", {}))  # the @hookimpl marker
    return hook


class _RegistryFacade:
    """The registry hooks of one plugin, registered with a plugin manager of their own."""


def collect(plugins: dict[str, Any], packages: dict[str, str] | None = None) -> Registries:
    """Call every registry hook of ``plugins`` (name → loaded class or module), in name
    order. A hook that raises registers nothing and is recorded (``failures``, with the
    plugin's package from ``packages``) and warned about once (``RegistryWarning``), so
    that it breaks only the recipes that name what it would have registered."""
    found = Registries(
        Registry("dataset", "data.dataset"),
        Registry("partitioner", "data.partition.name"),
        Registry("executor", "engine.executor"),
        Registry("store", "engine.store"),
    )
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in sorted(plugins, reverse=True):  # pluggy calls the last registered first
        obj = plugins[name]
        hooks = [h for h in implemented_hooks(obj) if hook_side(h) == hookspecs.REGISTRY]
        if not hooks:
            continue
        facade = _RegistryFacade()
        for hook in hooks:
            if inspect.isclass(obj) and not isinstance(
                inspect.getattr_static(obj, hook), staticmethod
            ):
                raise FedkitError(
                    f"plugin {name!r}: {hook} must be a @staticmethod (registry hooks run "
                    "before any recipe, so there are no options to build the plugin with)"
                )
            setattr(facade, hook, _bound(getattr(obj, hook), name))
        pm.register(facade, name=name)
    for hook, kind in found.kinds().items():
        for impl in reversed(getattr(pm.hook, hook).get_hookimpls()):  # in call order
            staged: list[tuple[str, Any, str]] = []
            try:
                impl.function(register=_registrar(staged, hook))
            except Exception as exc:  # noqa: BLE001 - a package's bug, kept to what it adds
                name = impl.plugin_name
                failure = HookFailure(
                    name, (packages or {}).get(name, ""), hook, f"{type(exc).__name__}: {exc}"
                )
                kind.failed.append(failure)
                warnings.warn(
                    f"{failure}; recipes that name what it registers cannot run",
                    RegistryWarning,
                    stacklevel=2,
                )
                continue
            for entry in staged:
                kind.add(*entry)
    return found


def loaded_plugins(available: dict[str, Any]) -> dict[str, Any]:
    """Load every entry point (or object with ``load()``) of ``available``; a plugin that
    fails to import is left out here (``fedkit plugins`` lists it as broken)."""
    out = {}
    for name, ep in available.items():
        try:
            out[name] = ep.load()
        except Exception:  # noqa: BLE001 - listed as broken elsewhere
            continue
    return out


def packages_of(available: dict[str, Any]) -> dict[str, str]:
    """Each installed plugin's package name (for messages); in-process ones are left out."""
    return {
        name: getattr(getattr(ep, "dist", None), "name", None) or ""
        for name, ep in available.items()
        if installed(ep)
    }


@functools.cache
def _installed() -> Registries:
    available = discover()
    return collect(loaded_plugins(available), packages_of(available))


def registries(available: dict[str, Any] | None = None) -> Registries:
    """What the installed plugins register (computed once per process), or what the
    plugins of ``available`` register (tests, in-process plugins not installed)."""
    if available is None:
        return _installed()
    return collect(loaded_plugins(available), packages_of(available))


def refresh() -> None:
    """Forget the installed plugins' registrations (after installing a package in-process)."""
    _installed.cache_clear()


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
        return {side: [h for h in self.hooks if hook_side(h) == side] for side in hookspecs.SIDES}


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

"""The plugins active on one side of a run, around a ``pluggy.PluginManager``.

Each side of a run (the server, and every place clients run) builds its own ``Plugins``
from the recipe: a plugin class is constructed with its options (validated by its nested
``Options``; unknown keys are errors), so the two sides never share an instance.

Every hook is called through pluggy (``pm.hook.<name>(...)``), so wrappers, tracing
(``add_hookcall_monitoring``) and pluggy's ordering work for every hook. A plugin is
registered through an *adapter*: an object whose hook functions call the plugin's own,
name its exceptions (``PluginError``), tag what it claims with its name (claims hooks)
or pass the previous plugin's result on (chain hooks), and give a v2 plugin the arguments
it still asks for (``fedkit.plugin.migration``). pluggy's objects are never changed.
Plugins are registered in reverse recipe order, so pluggy, which calls the last
registered first, calls them in recipe order; ``tryfirst``/``trylast`` are refused.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError
from torch import Tensor

from fedkit.config.schema import Recipe, expected_from
from fedkit.errors import (
    ClaimConflict,
    ClaimMismatch,
    FedkitError,
    MissingOffer,
    PluginError,
    RecipeError,
    did_you_mean,
    unknown_hint,
)
from fedkit.plugin import hookspecs, migration
from fedkit.plugin.authoring import check_plugin, impl_args
from fedkit.plugin.markers import DROP, PROJECT
from fedkit.plugin.registry import (
    discover,
    hook_kind,
    hook_names,
    hook_side,
    implemented_hooks,
    registers_only,
)
from fedkit.plugin.reported import MetricError

SIDES = (hookspecs.SERVER, hookspecs.CLIENT)
DROPPING = ("upload_selection", "aggregate", "server_update")
"""The claims hooks where ``DROP`` removes a key (from an upload, from a cluster state)."""
SPEC_ARGS = {
    name: tuple(inspect.signature(getattr(hookspecs, name)).parameters) for name in hook_names()
}


@dataclass(frozen=True)
class Claim:
    """What one plugin returned from a claims hook: its name and ``{key: value}``. A
    wrapper on a claims hook sees the list of these."""

    plugin: str
    values: Mapping[str, Any]


class Chained:
    """The value a chain hook passes from plugin to plugin (a wrapper sees this)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


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


def _signature_function(hook: str, call: Callable[[tuple[Any, ...]], Any]) -> Callable[..., Any]:
    """A function whose parameters are exactly ``hook``'s arguments (pluggy reads them
    from the code object), forwarding them as one tuple to ``call``."""
    args = ", ".join(SPEC_ARGS[hook])
    namespace: dict[str, Any] = {"call": call}
    exec(f"def {hook}({args}):\n    return call(({args},))\n", namespace)  # noqa: S102
    return namespace[hook]


class _Adapter:
    """The object pluggy registers for one plugin: its hooks, adapted (see the module
    docstring)."""

    def __init__(self, name: str, obj: Any, side: str) -> None:
        self._plugin_name, self._wanted = name, {}
        for attr, message in migration.REMOVED_ATTRIBUTES.items():
            if hasattr(obj, attr):
                migration.notice(f"plugin {name!r}: {message}")
        for hook in implemented_hooks(obj):
            if hook_side(hook) != side:
                continue
            method = getattr(obj, hook)
            opts = getattr(method, f"{PROJECT}_impl")
            if opts.get("tryfirst") or opts.get("trylast"):
                raise RecipeError(
                    f"plugins ({name})",
                    f"a plain implementation of {hook!r}: the recipe's order of plugins is "
                    "the call order (list the plugin earlier or later instead)",
                    "tryfirst" if opts.get("tryfirst") else "trylast",
                )
            if opts.get("wrapper") or opts.get("hookwrapper"):
                setattr(self, hook, method)  # pluggy runs wrappers as they are
                continue
            adapted = self._adapt(hook, method)
            setattr(adapted, f"{PROJECT}_impl", dict(opts))
            setattr(self, hook, adapted)

    def _adapt(self, hook: str, method: Callable[..., Any]) -> Callable[..., Any]:
        plugin, spec = self._plugin_name, SPEC_ARGS[hook]
        wanted = impl_args(method)
        legacy = migration.LEGACY_ARGUMENTS.get(hook, {})
        self._wanted[hook] = frozenset(wanted)
        picks = [(spec.index(a), None) if a in spec else (None, legacy[a]) for a in wanted]
        kind = hook_kind(hook)
        chain_at = spec.index("upload") if kind == "chain" else None
        metrics = hook in migration.RETURNED_METRICS

        def call(values: tuple[Any, ...]) -> Any:
            kwargs = None
            args = []
            for position, provide in picks:
                if provide is None:
                    value = values[position]
                    args.append(value.value if position == chain_at else value)
                else:
                    kwargs = kwargs if kwargs is not None else dict(zip(spec, values, strict=True))
                    args.append(provide(kwargs, plugin, hook))
            try:
                result = method(*args)
            except MetricError as exc:  # ctx.log refused a value: name who reported it
                raise exc.by(plugin, hook) from None
            except (FedkitError, PluginError, MissingOffer):
                raise
            except Exception as exc:
                raise PluginError(plugin, hook, exc) from exc
            if kind == "claims":
                return Claim(plugin, result) if result else None
            if kind == "chain":
                if result is not None:
                    values[chain_at].value = result
                return None
            if metrics and isinstance(result, Mapping):
                return _returned_metrics(plugin, hook, result, values[0])
            return result

        return _signature_function(hook, call)


def _returned_metrics(plugin: str, hook: str, result: Mapping[str, Any], owner: Any) -> Any:
    """A v2 hook returned metrics: log them through the one channel (saying so when they
    add something), and keep ``local_train``'s answer."""
    logged = owner.logged if hook != "evaluate" else {}
    new = {k: v for k, v in result.items() if k not in logged or logged[k] != v}
    if new:
        migration.returned_metrics(plugin, hook)
        try:
            owner.log(**new)
        except MetricError as exc:
            raise exc.by(plugin, hook) from None
    return True if hook == "local_train" else None


class Plugins:
    """The plugins active on one side of a run (see the module docstring).

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
        self._adapters: dict[str, _Adapter] = {}
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
            if registers_only(loaded):
                raise RecipeError(
                    f"plugins.{index}",
                    "a method plugin (this one only registers data sets, partitioners, "
                    "executors or stores, which any recipe can name without listing it)",
                    spec.name,
                )
            if side == hookspecs.SERVER:
                check_authoring(spec.name, loaded, index)
            self.objects[spec.name] = instantiate(spec.name, loaded, spec.options, index)
        for name, obj in reversed(self.objects.items()):
            self.add(obj, name)
        self.names = list(self.objects)
        if side == hookspecs.SERVER:
            self._check_shadowing()
        self._observers: list[Callable[[str, list[str], dict[str, Any]], None]] = []
        self._undo_monitoring: Callable[[], None] | None = None
        if os.environ.get("FEDKIT_TRACE_PLUGINS") == "1":
            self.observe(_trace)

    def add(self, obj: Any, name: str) -> None:
        """Register a plugin object on this side, called after the plugins registered so
        far (tests add spies this way)."""
        adapter = _Adapter(name, obj, self.side)
        self.pm.register(adapter, name=name)
        self._adapters[name] = adapter
        self.objects.setdefault(name, obj)

    def _check_shadowing(self) -> None:
        """A firstresult hook answered by two plugins: the second never runs — an error."""
        for hook in hook_names():
            if hook_kind(hook) != "firstresult" or hook_side(hook) == hookspecs.REGISTRY:
                continue
            names = [n for n, o in self.objects.items() if hook in implemented_hooks(o)]
            if len(names) > 1:
                raise RecipeError(
                    "plugins",
                    f"one plugin answering {hook!r}: {names[0]!r} answers it first, so "
                    f"{names[1]!r}'s {hook} would never run — remove one of them",
                    names[:2],
                )

    def observe(self, observer: Callable[[str, list[str], dict[str, Any]], None]) -> None:
        """Call ``observer(hook, plugin_names, kwargs)`` before every hook call on this
        side, through pluggy's hook-call monitoring (``FEDKIT_TRACE_PLUGINS=1`` prints
        them this way)."""
        self._observers.append(observer)
        if self._undo_monitoring is None:

            def before(hook: str, impls: list[Any], kwargs: dict[str, Any]) -> None:
                names = [impl.plugin_name for impl in reversed(impls)]
                for seen in self._observers:
                    seen(hook, names, kwargs)

            self._undo_monitoring = self.pm.add_hookcall_monitoring(before, lambda *_: None)

    def _caller(self, hook: str) -> Any:
        if hook_side(hook) != self.side:
            raise RuntimeError(f"hook {hook!r} runs on the {hook_side(hook)} side, not {self.side}")
        return getattr(self.pm.hook, hook)

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call an ``all`` hook (list of results) or a ``firstresult`` one (one result)."""
        return self._caller(hook)(**kwargs)

    def implementers(self, hook: str) -> list[str]:
        """Names of the active plugins implementing ``hook``, in recipe order."""
        return [impl.plugin_name for impl in reversed(self._caller(hook).get_hookimpls())]

    def wants(self, hook: str, argument: str) -> bool:
        """Whether any active implementation of ``hook`` takes ``argument`` (so a costly
        argument is computed only for plugins that read it)."""
        return any(argument in a._wanted.get(hook, ()) for a in self._adapters.values())

    def claims(
        self, hook: str, reference: dict[str, Any] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """Call a claims hook on every plugin and merge the claimed keys.

        Raises ``ClaimConflict`` when two plugins claim one key, ``ClaimMismatch`` when a
        claimed tensor differs in shape or dtype from ``reference[key]``, and a
        ``PluginError`` for ``DROP`` in a hook with nothing to remove. A v2 ``None``
        value counts as ``DROP`` (with a notice).
        """
        owners: dict[str, str] = {}
        merged: dict[str, Any] = {}
        for claim in self._caller(hook)(**kwargs):
            if not isinstance(claim, Claim):  # a wrapper replaced the result
                claim = Claim("?", claim)
            for key, value in claim.values.items():
                if key in owners:
                    raise ClaimConflict(hook, key, owners[key], claim.plugin)
                if value is None:
                    migration.claimed_none(claim.plugin, hook, key)
                    value = DROP
                if value is DROP and hook not in DROPPING:
                    reason = ValueError(
                        f"claimed {key!r} with fedkit.DROP, which only {', '.join(DROPPING)} "
                        "can act on (leave the key out to not claim it)"
                    )
                    raise PluginError(claim.plugin, hook, reason)
                owners[key] = claim.plugin
                merged[key] = value
                if reference is not None and key in reference and isinstance(value, Tensor):
                    expected = reference[key]
                    if value.shape != expected.shape or value.dtype != expected.dtype:
                        raise ClaimMismatch(hook, key, claim.plugin, value, expected)
        return merged

    def chain(self, hook: str, value_arg: str, **kwargs: Any) -> Any:
        """Call a chain hook: each plugin in recipe order may replace ``kwargs[value_arg]``."""
        holder = Chained(kwargs[value_arg])
        self._caller(hook)(**{**kwargs, value_arg: holder})
        return holder.value

    def uploads_data_derived(self) -> list[str]:
        """Active plugins that declare data-derived uploads."""
        return [n for n, o in self.objects.items() if getattr(o, "uploads_data_derived", False)]


def _trace(hook: str, names: list[str], kwargs: dict[str, Any]) -> None:
    print(f"[fedkit] {hook} -> {', '.join(names) or '(none)'}", file=sys.stderr)

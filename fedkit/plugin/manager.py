"""The plugins active on one side of a run, around a ``pluggy.PluginManager``.

Each side of a run (the server, and every place clients run) builds its own ``Plugins``
from the recipe: a plugin class is constructed with its options (validated by its nested
``Options``; unknown keys are errors), so the two sides never share an instance.

Every hook is called through pluggy (``pm.hook.<name>(...)``), so wrappers, tracing
(``add_hookcall_monitoring``) and pluggy's ordering work for every hook. A plugin is
registered through an *adapter*: an object whose hook functions call the plugin's own,
name its exceptions (``PluginError``; a contract v2 habit gets ``ContractChanged``, citing
the migration table), and tag what it claims with its name (claims hooks) or pass the
previous plugin's result on (chain hooks). Each adapted function is marked as wrapping the
plugin's method (``functools.wraps``), so pluggy reads the plugin's own argument names
and passes just those (decision 0020). pluggy's objects are never changed. Plugins are
registered in reverse recipe order, so pluggy, which calls the last registered first,
calls them in recipe order; ``tryfirst``/``trylast`` are refused.
"""

from __future__ import annotations

import dataclasses
import functools
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
    V2_HABITS,
    ClaimConflict,
    ClaimMismatch,
    ContractChanged,
    FedkitError,
    MissingOffer,
    PluginError,
    RecipeError,
    did_you_mean,
    since_v3,
    unknown_hint,
)
from fedkit.plugin import hookspecs
from fedkit.plugin.authoring import SPEC_ARGS, argument_problems, check_plugin, impl_args
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
from fedkit.training.loop import Objective

SIDES = (hookspecs.SERVER, hookspecs.CLIENT)
REACH = {
    hookspecs.SERVER: (hookspecs.SERVER, hookspecs.SIMULATION),
    hookspecs.CLIENT: (hookspecs.CLIENT,),
}
"""The hook sides each ``Plugins`` calls: the engine's (``server``) also calls the
simulation hooks, on the same instances, none of which may implement a server hook."""
DROPPING = ("upload_selection", "aggregate", "server_update")
"""The claims hooks where ``DROP`` removes a key (from an upload, from a cluster state)."""
LOSS_HOOKS = ("local_train", "local_objective")
"""Hooks where a v2 loss meets v3's ``(loss, outputs)``."""


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
        old = str(getattr(exc, "name", "")).split(".")  # v2's modules: fedkit.<name>
        moved = isinstance(exc, ModuleNotFoundError) and len(old) == 2 and old[0] == "fedkit"
        raise RecipeError(
            f"plugins.{index}",
            f"an importable plugin ({name!r} fails to import: {type(exc).__name__}: {exc})",
            name,
            hint=f"; {since_v3('import')}" if moved else "",
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
    schema = getattr(obj, "Options", None) if inspect.isclass(obj) else None
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return obj(_validate_options(schema, options, where))
    if options:
        key = next(iter(options))
        raise RecipeError(f"{where}.{key}", f"no options ({name!r} takes none)", options[key])
    return obj() if inspect.isclass(obj) else obj


def _named(plugin: str, hook: str, exc: Exception) -> Exception:
    """An exception raised in ``plugin``'s ``hook``, named: a v2 habit (a removed attribute,
    arithmetic on v3's ``(loss, outputs)``) as ``ContractChanged``, else ``PluginError``."""
    removed = f"{type(getattr(exc, 'obj', None)).__name__}.{getattr(exc, 'name', '')}"
    if isinstance(exc, AttributeError) and removed in V2_HABITS:
        return ContractChanged.of(plugin, f"hook {hook!r} reads {removed}", removed)
    if isinstance(exc, TypeError | AttributeError) and hook in LOSS_HOOKS and "tuple" in str(exc):
        where = f"hook {hook!r} ({type(exc).__name__}: {exc})"
        return ContractChanged.of(plugin, where, "Objective.loss")
    return PluginError(plugin, hook, exc)


def _attributed(plugin: str, objective: Objective) -> Objective:
    """``objective`` with its loss's errors named after the plugin that supplied it."""
    loss = objective.loss

    def attributed(model: Any, batch: Any) -> Any:
        try:
            result = loss(model, batch)
        except (FedkitError, MissingOffer):
            raise
        except Exception as exc:
            raise _named(plugin, "local_objective", exc) from exc
        if isinstance(result, tuple) and len(result) != 2:
            where = f"hook 'local_objective' (its loss returned a {len(result)}-tuple)"
            raise ContractChanged.of(plugin, where, "Objective.loss")
        return result

    return dataclasses.replace(objective, loss=attributed)


class _Adapter:
    """The object pluggy registers for one plugin: its hooks, adapted (see the module
    docstring)."""

    def __init__(self, name: str, obj: Any, side: str) -> None:
        self._plugin_name = name
        for hook in implemented_hooks(obj):
            if hook_side(hook) not in REACH[side]:
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
            problems = argument_problems(hook, method)  # before pluggy's own refusal
            if problems:
                raise RecipeError(
                    f"plugins ({name})", "hook arguments", hint=": " + "; ".join(problems)
                )
            setattr(self, hook, self._adapt(hook, method))

    def _adapt(self, hook: str, method: Callable[..., Any]) -> Callable[..., Any]:
        plugin, kind = self._plugin_name, hook_kind(hook)
        value = SPEC_ARGS[hook][-1]
        chain_at = impl_args(method).index(value) if kind == "chain" else -1
        returned = f"{hook} returned"

        @functools.wraps(method)  # pluggy reads the plugin's argument names through this
        def call(*args: Any, **kwargs: Any) -> Any:
            if chain_at >= 0:
                holder = args[chain_at]
                args = (*args[:chain_at], holder.value, *args[chain_at + 1 :])
            try:
                result = method(*args, **kwargs)
            except MetricError as exc:  # ctx.log refused a value: name who reported it
                raise exc.by(plugin, hook) from None
            except (FedkitError, PluginError, MissingOffer):
                raise
            except Exception as exc:
                raise _named(plugin, hook, exc) from exc
            if kind == "claims":
                return Claim(plugin, result) if result else None
            if chain_at >= 0:
                if result is not None:
                    holder.value = result
                return None
            if isinstance(result, Mapping) and returned in V2_HABITS:
                raise ContractChanged.of(
                    plugin, f"hook {hook!r} returned {type(result).__name__}", returned
                )
            if isinstance(result, Objective):
                return _attributed(plugin, result)
            return result

        return call


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
            self._check_simulation()
        self._observers: list[Callable[[str, list[str], dict[str, Any]], None]] = []
        self._undo_monitoring: Callable[[], None] | None = None
        if os.environ.get("FEDKIT_TRACE_PLUGINS") == "1":
            self.observe(_trace)

    def add(self, obj: Any, name: str) -> None:
        """Register a plugin object on this side, called after the plugins registered so
        far (tests add spies this way)."""
        self.pm.register(_Adapter(name, obj, self.side), name=name)
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

    def _check_simulation(self) -> None:
        """A plugin implementing a simulation hook holds simulation truth on ``self``: it
        may not implement a server-side hook too (which could read it)."""
        for name, obj in self.objects.items():
            hooks = implemented_hooks(obj)
            simulation = [h for h in hooks if hook_side(h) == hookspecs.SIMULATION]
            server = [h for h in hooks if hook_side(h) == hookspecs.SERVER]
            if simulation and server:
                raise RecipeError(
                    "plugins",
                    f"{name!r} to implement simulation hooks ({', '.join(simulation)}) or "
                    f"server hooks ({', '.join(server)}), not both: what an attack knows must "
                    "not reach the server",
                    name,
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
        if hook_side(hook) not in REACH[self.side]:
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
        impls = self._caller(hook).get_hookimpls()
        return any(argument in (*impl.argnames, *impl.kwargnames) for impl in impls)

    def claims(
        self, hook: str, reference: dict[str, Any] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """Call a claims hook on every plugin and merge the claimed keys.

        Raises ``ClaimConflict`` when two plugins claim one key, ``ClaimMismatch`` when a
        claimed tensor differs in shape or dtype from ``reference[key]``, and a
        ``PluginError`` for ``DROP`` in a hook with nothing to remove and
        ``ContractChanged`` for a v2 ``None`` value.
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
                    where = f"hook {hook!r} claimed {key!r} with None"
                    raise ContractChanged.of(claim.plugin, where, "claimed None")
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

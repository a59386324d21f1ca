"""Authoring diagnostics: the mistakes a plugin author makes that pluggy lets pass or
reports as a long traceback, found before a run and said in one line each.

``check_plugin`` looks at a plugin class (or module): methods that look like misspelt
hooks, public methods named like hooks but not marked ``@hookimpl``, ``@hookimpl``
methods that name no hook, and hook arguments the hook does not provide. ``check_entry_points``
adds entry points that cannot be imported.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from typing import Any

from fedkit.errors import V2_HABITS, since_v3
from fedkit.plugin import hookspecs
from fedkit.plugin.markers import PROJECT
from fedkit.plugin.registry import hook_kind, hook_names, hook_side

SPEC_ARGS = {
    name: [p for p in inspect.signature(getattr(hookspecs, name)).parameters]
    for name in hook_names()
}


@dataclass
class Finding:
    """One problem with one plugin."""

    plugin: str
    message: str

    def __str__(self) -> str:
        return f"{self.plugin}: {self.message}"


def _methods(obj: Any) -> dict[str, Any]:
    found = {}
    for name in dir(obj):
        if name.startswith("_"):
            continue
        value = getattr(obj, name, None)
        if callable(value) and not inspect.isclass(value):
            found[name] = value
    return found


def impl_args(fn: Any) -> list[str]:
    """The arguments a hook implementation asks for (``self`` left out)."""
    params = list(inspect.signature(fn).parameters)
    return params[1:] if params and params[0] == "self" else params


def argument_problems(hook: str, fn: Any) -> list[str]:
    """What is wrong with the arguments a hook implementation asks for: one it does not
    get (pluggy would refuse it; a v2 one cites the migration table), or a chain hook's
    that does not take the value it may replace."""
    spec = SPEC_ARGS[hook]
    wanted = impl_args(fn)
    found = [
        f"hook {hook!r} asks for argument {arg!r}, which it does not get (it gets "
        f"{', '.join(spec)})"
        + (f"; {since_v3(v2)}" if (v2 := f"{hook}({arg})") in V2_HABITS else "")
        for arg in wanted
        if arg not in spec
    ]
    if hook_kind(hook) == "chain" and spec[-1] not in wanted:
        found.append(f"hook {hook!r} must take {spec[-1]!r}, the value it may replace")
    return found


def check_plugin(name: str, obj: Any) -> list[Finding]:
    """Problems of one plugin class or module (an empty list: none found)."""
    hooks = hook_names()
    found = []
    for attr, fn in _methods(obj).items():
        marked = hasattr(fn, f"{PROJECT}_impl")
        if attr in hooks and not marked:
            message = f"{attr!r} is named like a hook but not marked @hookimpl: never called"
        elif marked and attr not in hooks:
            guess = difflib.get_close_matches(attr, hooks, n=1, cutoff=0.6)
            hint = f' (did you mean "{guess[0]}"?)' if guess else ""
            message = f"{attr!r} is marked @hookimpl but there is no such hook{hint}"
        elif not marked and (guess := difflib.get_close_matches(attr, hooks, n=1, cutoff=0.8)):
            message = f'{attr!r} looks like a misspelt hook (did you mean "{guess[0]}"?)'
        else:
            message = ""
        if message:
            found.append(Finding(name, message))
        if marked and attr in hooks and hook_side(attr) == hookspecs.REGISTRY:
            if inspect.isclass(obj) and not isinstance(
                inspect.getattr_static(obj, attr), staticmethod
            ):
                found.append(
                    Finding(name, f"registry hook {attr!r} must be a @staticmethod in a class")
                )
            continue
        if marked and attr in hooks:
            found += [Finding(name, problem) for problem in argument_problems(attr, fn)]
    return found


def check_entry_points(entry_points: dict[str, EntryPoint]) -> tuple[dict[str, Any], list[Finding]]:
    """Load every entry point: the loaded objects, and a finding for each that fails."""
    loaded, found = {}, []
    for name, ep in sorted(entry_points.items()):
        try:
            loaded[name] = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure is the finding
            found.append(
                Finding(name, f"cannot be imported ({ep.value}): {type(exc).__name__}: {exc}")
            )
    return loaded, found

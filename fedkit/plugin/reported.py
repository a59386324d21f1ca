"""What a client may report: the values of ``ctx.log`` and of its evaluation scores.

A reported value crosses from the client to the server, so it is typed like everything
else that crosses: a number (a ``bool``, an ``int`` that fits in 64 bits, a ``float``,
non-finite ones included) or a string of at most ``MAX_TEXT`` characters, under a name
of at most ``MAX_TEXT`` characters, and at most ``MAX_VALUES`` names per job. numpy
scalars (``np.float32(0.5)``, ``np.bool_(True)``) are taken as the Python number they
hold. Anything else (a tensor, even a one-element one; an array; a list; a dict; ``None``;
a longer string) is a ``MetricError``: a bug in the plugin, the same on every client, so
it stops the run (exit code 2) naming the plugin, the hook and the name, instead of
failing one client after another. The server checks the same rules again on every reply
it receives (``fedkit.core.reply_checks``) and refuses a reply that breaks them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedkit.errors import FedkitError

MAX_TEXT = 256
"""The longest string value, and the longest name, a client may report (characters)."""
MAX_VALUES = 1024
"""The most values one client may report in one job (a training round or an evaluation)."""
_INT_RANGE = (-(2**63), 2**63)
_PLAIN = (bool, int, float, str)


class MetricError(FedkitError):
    """A reported value that may not cross (see the module docstring). ``plugin`` and
    ``hook`` are filled in by the plugin adapter that called the reporting hook."""

    def __init__(self, name: str, problem: str) -> None:
        self.name, self.problem = name, problem
        self.plugin: str | None = None
        self.hook: str | None = None
        super().__init__(self._render())

    def _render(self) -> str:
        who = f"plugin {self.plugin!r} in hook {self.hook!r}" if self.plugin else "a client"
        return (
            f"{who} reported {self.name!r} with ctx.log: {self.problem}. A reported value "
            f"is a number, a bool or a string of at most {MAX_TEXT} characters (report "
            "a tensor's scalar with .item(); keep tensors in ctx.tensors)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its parts (it crosses back from a worker process or actor)."""
        return (_rebuilt, (self.name, self.problem, self.plugin, self.hook))

    def by(self, plugin: str, hook: str) -> MetricError:
        """Name the plugin and hook that reported it (the innermost adapter wins)."""
        if self.plugin is None:
            self.plugin, self.hook = plugin, hook
            self.args = (self._render(),)
        return self


def _rebuilt(name: str, problem: str, plugin: str | None, hook: str | None) -> MetricError:
    error = MetricError(name, problem)
    return error.by(plugin, hook) if plugin is not None and hook is not None else error


def describe(value: Any) -> str:
    """A short description of a value's type and size, for messages."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, (list, tuple, dict, set)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def problem(name: Any, value: Any) -> str | None:
    """Why ``name=value`` may not be reported, or ``None`` when it may (exact Python
    types: what the server receives; see ``plain`` for what a client converts)."""
    if not isinstance(name, str) or len(name) > MAX_TEXT:
        return f"the name is not a string of at most {MAX_TEXT} characters"
    kind = type(value)
    if kind is float or kind is bool:
        return None
    if kind is int:
        low, high = _INT_RANGE
        return None if low <= value < high else "the integer does not fit in 64 bits"
    if kind is str:
        return None if len(value) <= MAX_TEXT else f"found {describe(value)}"
    return f"found {describe(value)}"


def plain(name: str, value: Any) -> Any:
    """The value as it crosses: itself when it may be reported, a numpy scalar or a
    subclass of a number (``np.float64``, an ``IntEnum``) as the Python number; else
    ``MetricError``."""
    if type(value) in _PLAIN and problem(name, value) is None:
        return value
    if isinstance(value, np.generic) and value.ndim == 0 and value.dtype.kind in "biuf":
        value = value.item()
    elif isinstance(value, bool):
        value = bool(value)
    elif isinstance(value, int):
        value = int(value)
    elif isinstance(value, float):
        value = float(value)
    elif isinstance(value, str):
        value = str(value)
    found = problem(name, value)
    if found is not None:
        raise MetricError(name, found)
    return value


def checked(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` as they cross (``plain`` on each)."""
    return {name: plain(name, value) for name, value in values.items()}


def too_many(name: str) -> MetricError:
    """The error for a job that reports more than ``MAX_VALUES`` names."""
    return MetricError(name, f"one value more than the {MAX_VALUES} a job may report")


def refusal(values: Any) -> str | None:
    """Why a reply's reported values may not be accepted (the server's check), or
    ``None``."""
    if not isinstance(values, dict):
        return f"metrics: expected a mapping of names to values, found {describe(values)}"
    if len(values) > MAX_VALUES:
        return f"metrics: expected at most {MAX_VALUES} values, found {len(values)}"
    for name, value in values.items():
        found = problem(name, value)
        if found is not None:
            return f"metric {str(name)[:MAX_TEXT]!r}: {found}"
    return None

"""Shorter waits inside Flower, for fedkit's own processes.

Flower 1.42 moves every message as separate objects and pulls an object that has not
arrived yet again after 1 s, then 2 s, 4 s, up to 10 s; its SuperNode sleeps 3 s when it
finds no message. On a round trip of small messages those waits, not the work, set the
pace (7 s per message measured here on a 3-node trial). ``quick_pulls`` makes the object
pulls of this process retry after 20 ms, doubling to at most 0.2 s; fedkit calls it in
its node process (``runner``) and its ServerApp.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from flwr.supercore.inflatable import inflatable_utils

INITIAL, CAP = 0.02, 0.2


def quick_pulls() -> None:
    """Retry object pulls in this process after ``INITIAL`` s, backing off to ``CAP`` s."""

    original = inflatable_utils.pull_objects
    if getattr(original, "fedkit_quick", False):
        return

    @functools.wraps(original)
    def pull_objects(*args: Any, **kwargs: Any) -> Any:
        kwargs["initial_backoff"] = min(kwargs.get("initial_backoff", INITIAL), INITIAL)
        kwargs["backoff_cap"] = min(kwargs.get("backoff_cap", CAP), CAP)
        kwargs["max_tries_per_object"] = None  # as many as fit in the pull's max_time
        return original(*args, **kwargs)

    pull_objects.fedkit_quick = True  # type: ignore[attr-defined]
    inflatable_utils.pull_objects = pull_objects
    for name in USERS:  # modules that imported the function by name
        module = importlib.import_module(name)
        if hasattr(module, "pull_objects"):
            module.pull_objects = pull_objects


USERS = ("flwr.superlink.grid.http_grid",)

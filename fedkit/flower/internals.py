"""Every use fedkit makes of Flower beyond its public API (``flwr.app``,
``flwr.clientapp``, ``flwr.serverapp``, ``flwr.simulation``), in one place.

A deployment node is one process (``fedkit.flower.runner``): it talks to the SuperLink
over Flower's own Fleet API client, so TLS and node authentication are Flower's, and
answers each message itself instead of handing it to a ClientApp process. Flower 1.42
documents no API for that, so this module holds what it needs of Flower's internals:

* ``connect``: the Fleet API connection Flower's SuperNode uses;
* ``pull`` and ``push``: a message's objects fetched and sent the way the SuperNode does,
  with the message id Flower keeps outside a message's own objects;
* ``RunNotRunning``: what the connection raises for a run that ended;
* ``quick_pulls``: shorter retry waits for object pulls (Flower 1.42 retries a missing
  object after 1 s, 2 s, 4 s, up to 10 s; on a round trip of small messages those waits,
  not the work, set the pace: 7 s a message on a 3-node trial). Pulls in the calling
  process then retry after 20 ms, doubling to at most 0.2 s.

``tests/test_flower_internals.py`` checks each name and signature against the installed
Flower, and that no other fedkit module imports Flower's internals; the ``flower`` extra
pins the minor version they were written against. Decision 0013 says what upstream change
would remove each.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from functools import partial
from typing import Any

from flwr.app import Error, Message
from flwr.common.constant import ErrorCode
from flwr.supercore.inflatable import inflatable_utils
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    get_object_tree,
    no_object_id_recompute,
)
from flwr.supercore.run import RunNotRunningException as RunNotRunning
from flwr.supernode.fleet_http_connection import http_request_response

__all__ = ["RunNotRunning", "connect", "error_reply", "pull", "push", "quick_pulls"]

INITIAL, CAP = 0.02, 0.2
"""``quick_pulls``' first wait and longest wait (s)."""

PULL_USERS = ("flwr.superlink.grid.http_grid",)
"""Flower modules that import ``pull_objects`` by name (patched beside the original)."""


def connect(superlink: str, insecure: bool, certificates: bytes | None, keys: Any) -> Any:
    """Flower's Fleet API connection (a context manager yielding the node id, receive,
    send, get_run, get_fab, pull_object, push_object and confirm functions)."""
    return http_request_response(superlink, insecure, certificates, keys)


def pull(tree: Any, pull_object: Callable, confirm: Callable) -> Message:
    """The message whose object tree the SuperLink handed out, its objects pulled and
    their receipt confirmed."""
    message = inflatable_utils.pull_and_inflate_object_from_tree(
        tree, pull_object, confirm, return_type=Message
    )
    message.metadata.__dict__["_message_id"] = tree.object_id  # not part of its own objects
    return message


def push(reply: Message, seconds: float, send: Callable, push_object: Callable) -> None:
    """Send ``reply`` to the SuperLink: its shell and object tree, then each object the
    SuperLink does not already hold."""
    reply.metadata.__dict__["_message_id"] = reply.object_id
    with no_object_id_recompute():
        wanted, session = send(reply, get_object_tree(reply), seconds)
        objects = get_all_nested_objects(reply)
        inflatable_utils.push_objects(
            objects, partial(push_object, session), object_ids_to_push=wanted
        )


def error_reply(message: Message, reason: str) -> Message:
    """A reply saying the client app raised (the server books it as the client's failure)."""
    return Message(
        Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message
    )


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
    for name in PULL_USERS:
        module = importlib.import_module(name)
        if hasattr(module, "pull_objects"):
            module.pull_objects = pull_objects

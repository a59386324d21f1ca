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
* ``NodeLost``, ``NotConnected``, ``diagnose`` and ``describe``: what went wrong with the
  connection, in words the node can act on. Flower's connection ends its process when the
  SuperLink stops knowing the node (it signals itself SIGINT on a 401, its heartbeat
  thread dies with a traceback when the SuperLink does not recognise the node, and a
  refused activation calls ``flwr_exit``, which forces the process out 5 s later).
  ``connect`` turns each into an exception the node's reconnect loop handles
  (``fedkit.flower.runner``), so the node survives a SuperLink restart.

``tests/test_flower_internals.py`` checks each name and signature against the installed
Flower, and that no other fedkit module imports Flower's internals; the ``flower`` extra
pins the minor version they were written against. Decision 0013 says what upstream change
would remove each.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, NoReturn

import httpx
from flwr.app import Error, Message
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE, ErrorCode
from flwr.supercore.error import ApiErrorCode, FlowerError
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.inflatable import inflatable_utils
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    get_object_tree,
    no_object_id_recompute,
)
from flwr.supercore.retry import http_retry
from flwr.supercore.run import RunNotRunningException as RunNotRunning
from flwr.supernode import fleet_http_connection
from flwr.supernode.fleet_http_connection import http_request_response

__all__ = [
    "LOST", "NEEDS_KEY", "ONLINE_FOR", "REFUSED", "REJECTED", "TLS", "UNREACHABLE", "NodeLost",
    "NotConnected", "RunNotRunning", "connect", "describe", "diagnose", "error_reply", "pull",
    "push", "quick_pulls",
]  # fmt: skip

INITIAL, CAP = 0.02, 0.2
"""``quick_pulls``' first wait and longest wait (s)."""

PULL_USERS = ("flwr.superlink.grid.http_grid",)
"""Flower modules that import ``pull_objects`` by name (patched beside the original)."""


ONLINE_FOR = HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL
"""Seconds the SuperLink holds a node online after its activation or its last heartbeat
(2 × 30 s in Flower 1.42). Until then the node's key cannot be activated again, so a node
killed without leaving (kill -9, a crash) and restarted sooner is refused, with the same
reply an unregistered key gets."""

CALL_PATIENCE = 10.0
"""Seconds Flower's client retries one Fleet call (no answer, or a 502-504) before the
call raises and the node's own reconnect loop, which says what is happening, takes over."""

UNREACHABLE, LOST, REFUSED, NEEDS_KEY, TLS, REJECTED = (
    "unreachable", "lost", "refused", "needs-key", "tls", "rejected",
)  # fmt: skip
"""What ``diagnose`` finds: the SuperLink does not answer; it no longer knows this node
(it restarted); it refused to activate the node's key; it admits registered keys only and
the node has none; TLS failed (a certificate or handshake error); any other error reply."""


class NodeLost(Exception):
    """The SuperLink no longer knows this node: it refused the node's signed requests
    (401) or its heartbeat. A SuperLink that restarted without its ``--database`` does."""


class NotConnected(Exception):
    """Joining the SuperLink failed; the message is Flower's account, ``__cause__`` the
    error behind it."""


def connect(
    superlink: str, insecure: bool, certificates: bytes | None, keys: Any
) -> contextlib.AbstractContextManager[Any]:
    """Flower's Fleet API connection (a context manager yielding the node id, receive,
    send, get_run, get_fab, pull_object, push_object and confirm functions), with Flower's
    ways of ending the process turned into exceptions: joining raises ``NotConnected``,
    and ``receive`` raises ``NodeLost`` once the SuperLink stopped knowing the node (a
    401, or a heartbeat it did not recognise). Each call gives up after ``CALL_PATIENCE``
    seconds without an answer, raising Flower's (httpx's) error."""
    _quiet_exits()
    return _watched(superlink, insecure, certificates, keys)


@contextlib.contextmanager
def _watched(superlink: str, insecure: bool, certificates: bytes | None, keys: Any) -> Iterator:
    global _watching
    watch = _watching = _Watch()
    try:
        with http_request_response(
            superlink, insecure, certificates, keys, max_wait_time=CALL_PATIENCE
        ) as conn:
            node_id, receive, *rest = conn
            yield (node_id, watch.receive(receive), *rest)
    finally:
        _watching = None


def diagnose(error: BaseException) -> str | None:
    """What a failed Fleet call or join means (``UNREACHABLE``, ``LOST``, ``REFUSED``,
    ``NEEDS_KEY``, ``TLS``, ``REJECTED``), or ``None`` for an error that is not the
    connection's."""
    if isinstance(error, NodeLost):
        return LOST
    cause = error.__cause__ if isinstance(error, NotConnected) else error
    if isinstance(cause, httpx.HTTPStatusError):
        status = cause.response.status_code
        code = getattr(FlowerError.from_json(cause.response.text), "code", None)
        if status == httpx.codes.UNAUTHORIZED:
            return LOST
        if code == ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED:
            return REFUSED
        if code == ApiErrorCode.FLEET_SUPERNODE_REGISTRATION_DISABLED:
            return NEEDS_KEY
        return UNREACHABLE if status in (502, 503, 504) else REJECTED
    if isinstance(cause, httpx.TransportError):
        words = str(cause).lower()
        return TLS if any(w in words for w in ("certificate", "ssl", "tls")) else UNREACHABLE
    return REJECTED if isinstance(error, NotConnected) else None


def describe(error: BaseException) -> str:
    """A failed call or join in one line: Flower's code and public message for an error
    reply, else the error's type and text."""
    if isinstance(error, NodeLost):
        return str(error)
    cause = error.__cause__ if isinstance(error, NotConnected) and error.__cause__ else error
    if isinstance(cause, httpx.HTTPStatusError):
        reply = FlowerError.from_json(cause.response.text)
        if reply is not None:
            return f"[code: {reply.code}] {reply.message}"
        return f"HTTP {cause.response.status_code}"
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1]}" if text else type(cause).__name__


class _Watch:
    """One connection's health as its heartbeat and its retries saw it."""

    def __init__(self) -> None:
        self.lost: str | None = None
        self.retried = False  # a call needed retries: check the node is still known
        self.beat: Callable[[], bool] | None = None

    def heartbeat(self, beat: Callable[[], bool]) -> Callable[[], bool]:
        """``beat`` for Flower's heartbeat thread, noting instead of raising (which would
        end the thread with a traceback) that the SuperLink no longer knows the node."""
        self.beat = beat

        def watched() -> bool:
            try:
                return beat()
            except Exception as error:  # noqa: BLE001 - a 401 or "does not recognize"
                self.lost = describe(error)
                return True  # the main loop leaves the connection

        return watched

    def receive(self, receive: Callable[[], Any]) -> Callable[[], Any]:
        """``receive`` that raises ``NodeLost`` once the node is known to be lost, and
        after calls that needed retries asks one heartbeat whether it still is known."""

        def watched() -> Any:
            if self.lost is not None:
                raise NodeLost(self.lost)
            got = receive()
            if self.retried and self.beat is not None:
                self.retried = False
                try:
                    self.beat()  # False: no answer again; the next receive says so
                except NodeLost:
                    raise
                except Exception as error:
                    raise NodeLost(describe(error)) from error
            return got

        return watched


_watching: _Watch | None = None
"""The connection ``connect`` is opening (Flower builds its heartbeat sender inside)."""


class _WatchedHeartbeat(HeartbeatSender):
    """Flower's heartbeat sender, reporting to the connection being opened."""

    def __init__(self, heartbeat_fn: Callable[[], bool]) -> None:
        watch = _watching
        super().__init__(watch.heartbeat(heartbeat_fn) if watch else heartbeat_fn)


def _retry_invoker() -> Any:
    """Flower's HTTP retry invoker, telling the connection being opened when it retries."""
    invoker = http_retry.make_simple_http_retry_invoker()
    watch, backoff = _watching, invoker.on_backoff
    if watch is not None:

        def on_backoff(state: Any) -> None:
            watch.retried = True
            if backoff is not None:
                backoff(state)

        invoker.on_backoff = on_backoff
    return invoker


class _NoSelfInterrupt:
    """``os`` for Flower's connection modules, whose ``kill(own pid, SIGINT)`` on a 401
    raises ``NodeLost`` in the calling thread instead of interrupting the process."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def kill(pid: int, signum: int) -> None:
        if pid == os.getpid() and signum == signal.SIGINT:
            raise NodeLost("the SuperLink refused this node's requests (401)")
        os.kill(pid, signum)


def _not_connected(code: int, message: str | None = None, *args: Any, **kwargs: Any) -> NoReturn:
    """``flwr_exit`` for the connection: raise instead of leaving the process."""
    reason = (message or f"Flower exit code {code}").splitlines()[-1]
    raise NotConnected(reason) from sys.exc_info()[1]


def _quiet_exits() -> None:
    """Install the replacements above in Flower's connection modules (once)."""
    fleet_http_connection.flwr_exit = _not_connected
    fleet_http_connection.os = _NoSelfInterrupt()
    fleet_http_connection.HeartbeatSender = _WatchedHeartbeat
    fleet_http_connection.make_simple_http_retry_invoker = _retry_invoker
    http_retry.os = _NoSelfInterrupt()


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


def error_kind(code: int) -> tuple[str, str]:
    """What a Flower error reply's ``code`` says happened, as a fedkit failure kind and a
    few words: the SuperLink's own replies (``unavailable``: the node stopped sending
    heartbeats, or the message is gone; ``timeout``: the reply expired) and the node's
    (``exception``, ``crash``, ``refused``)."""
    kinds = {
        ErrorCode.NODE_UNAVAILABLE: ("unavailable", "node unavailable"),
        ErrorCode.MESSAGE_UNAVAILABLE: ("unavailable", "message unavailable"),
        ErrorCode.REPLY_MESSAGE_UNAVAILABLE: ("timeout", "reply expired"),
        ErrorCode.CLIENT_APP_RAISED_EXCEPTION: ("exception", "the client raised"),
        ErrorCode.CLIENT_APP_CRASHED: ("crash", "the client app crashed"),
        ErrorCode.LOAD_CLIENT_APP_EXCEPTION: ("exception", "the node could not load its app"),
        ErrorCode.INVALID_FAB: ("refused", "the node refused the app"),
        ErrorCode.MOD_FAILED_PRECONDITION: ("refused", "a mod refused the message"),
        ErrorCode.UNKNOWN: ("exception", "an unknown error"),
    }
    return kinds.get(code, ("exception", f"Flower error {code}"))


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

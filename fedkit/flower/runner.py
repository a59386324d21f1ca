"""A deployment node in one process: its connection to the SuperLink and its fedkit
client, so torch, the model and the client's data load once and each message crosses the
network once each way.

Flower's own SuperNode receives a message, stores it, and hands it to a ClientApp in
another process (a fresh one per message by default, or one the operator runs next to it
with ``--isolation process``), which pulls the message and the node's ``Context`` over
the SuperNode's local API and pushes the reply and the context back; the SuperNode then
sends the reply on. ``serve`` here does the SuperNode's part itself, over Flower's own
Fleet API client (``flwr.supernode.fleet_http_connection``, the same TLS and node
authentication): it pulls a message, answers it with a ``NodeHost``
(``fedkit.flower.node``) and pushes the reply. The node's ``Context.state`` stays in this
process, one per run series, as Flower's SuperNode keeps it in its own memory.

The node runs the fedkit installed next to it, never code the server sends: the app's
FAB is not fetched, and what arrives is data for the node's plugins
(``fedkit.flower.records``). The ``flower`` extra pins the Flower minor version whose
Fleet client this uses.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from flwr.app import Message, RecordDict
from flwr.app.error import Error
from flwr.common.constant import ErrorCode
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    get_object_tree,
    no_object_id_recompute,
)
from flwr.supercore.inflatable.inflatable_utils import (
    pull_and_inflate_object_from_tree,
    push_objects,
)
from flwr.supercore.run import RunNotRunningException
from flwr.supernode.fleet_http_connection import http_request_response

from fedkit.flower.node import NodeHost
from fedkit.flower.tuning import quick_pulls
from fedkit.plugin.registry import discover

TIMING = bool(os.environ.get("FEDKIT_NODE_TIMING"))
"""Print how long each message's pull, answer and push took (``FEDKIT_NODE_TIMING=1``)."""

FIRST = 0.02
"""Seconds between asks for a message right after one (the next of a round follows
soon); the wait doubles while the node stays idle, up to ``serve``'s ``poll``, so ten idle
nodes on one machine do not spend its cores asking. Flower's SuperNode waits 3 s."""


def installed_modules() -> tuple[str, ...]:
    """The top-level modules of the plugins installed here: what a setup may rebuild."""

    return tuple(sorted({ep.value.split(":")[0].split(".")[0] for ep in discover().values()}))


def serve(
    superlink: str,
    partition: int,
    folder: Path,
    *,
    certificates: bytes | None = None,
    keys: tuple[Any, Any] | None = None,
    site: Path | None = None,
    poll: float = 0.2,
    stop: Callable[[], bool] = lambda: False,
    connected: Callable[[int], None] = lambda node_id: None,
) -> None:
    """Answer the SuperLink's messages for this node until ``stop()`` is true (or the
    process ends). ``superlink`` is its Fleet API (host:port); ``certificates`` the CA
    that verifies it (``None``: no TLS); ``keys`` the node's key pair when the SuperLink
    authenticates nodes; ``partition`` the client this node holds; ``site`` a real site's
    own ImageFolder (``fedkit.data.site``); ``connected`` is told the node's Flower id."""

    quick_pulls()
    host = NodeHost(folder / "memories", installed_modules(), site, resident=True)
    with http_request_response(superlink, certificates is None, certificates, keys) as conn:
        node_id, receive, send, get_run, _fab, pull_object, push_object, confirm = conn
        connected(node_id)
        series: dict[int, str] = {}
        states: dict[str, RecordDict] = {}
        wait = FIRST
        while not stop():
            got = receive()
            if got is None:
                time.sleep(wait)
                wait = min(wait * 2, poll)
                continue
            wait = FIRST
            shell, tree = got
            run_id = shell.metadata.run_id
            try:
                if run_id not in series:
                    series[run_id] = get_run(run_id).series_id
                state = states.setdefault(series[run_id], RecordDict())
                began = time.perf_counter()
                message = pull(tree, partial(pull_object, run_id), partial(confirm, run_id))
                pulled = time.perf_counter()
                reply = answer(host, message, state, partition)
                handled = time.perf_counter()
                push(reply, handled - pulled, send, partial(push_object, run_id))
            except RunNotRunningException:
                continue  # the run ended (or was stopped) while this message was under way
            if TIMING:
                print(
                    f"fedkit-timing {message.metadata.message_type} at {time.time():.3f} "
                    f"pull {pulled - began:.3f} handle {handled - pulled:.3f} "
                    f"push {time.perf_counter() - handled:.3f} state {state_bytes(state)} B",
                    flush=True,
                )


def pull(tree: Any, pull_object: Callable, confirm: Callable) -> Message:
    """The message whose object tree the SuperLink handed out, its objects pulled and
    their receipt confirmed."""

    message = pull_and_inflate_object_from_tree(tree, pull_object, confirm, return_type=Message)
    message.metadata.__dict__["_message_id"] = tree.object_id  # not part of its own objects
    return message


def answer(host: NodeHost, message: Message, state: RecordDict, partition: int) -> Message:
    """The node's reply to one message: the host's answer, or the error it raised, which
    the server books as this client's failure."""

    try:
        content = host.handle(message.metadata.message_type, message.content, state, partition)
        return Message(content, reply_to=message)
    except Exception as exc:  # noqa: BLE001 - the server sees it as the client's failure
        reason = f"{type(exc).__name__}: {exc}"
        print(reason + "\n" + traceback.format_exc(limit=6), flush=True)
        error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason)
        return Message(error, reply_to=message)


def push(reply: Message, seconds: float, send: Callable, push_object: Callable) -> None:
    """Send ``reply`` to the SuperLink: its shell and object tree, then each object the
    SuperLink does not already hold."""

    reply.metadata.__dict__["_message_id"] = reply.object_id
    with no_object_id_recompute():
        wanted, session = send(reply, get_object_tree(reply), seconds)
        objects = get_all_nested_objects(reply)
        push_objects(objects, partial(push_object, session), object_ids_to_push=wanted)


def state_bytes(state: Any) -> int:
    """The bytes a node's ``Context.state`` holds in its config records' byte values."""
    return sum(
        len(value)
        for record in state.config_records.values()
        for value in record.values()
        if isinstance(value, bytes)
    )

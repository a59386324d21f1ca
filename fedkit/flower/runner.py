"""A deployment node in one process: its connection to the SuperLink and its fedkit
client, so torch, the model and the client's data load once and each message crosses the
network once each way.

Flower's own SuperNode receives a message, stores it, and hands it to a ClientApp in
another process (a fresh one per message by default, or one the operator runs next to it
with ``--isolation process``), which pulls the message and the node's ``Context`` over
the SuperNode's local API and pushes the reply and the context back; the SuperNode then
sends the reply on. ``serve`` here does the SuperNode's part itself, over Flower's own
Fleet API client (the same TLS and node authentication; ``fedkit.flower.internals`` holds
every use of Flower beyond its public API): it pulls a message, answers it with a ``NodeHost``
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

from fedkit.errors import FedkitError
from fedkit.flower import internals
from fedkit.flower.internals import RunNotRunning, pull, push, quick_pulls
from fedkit.flower.node import NodeHost

TIMING = bool(os.environ.get("FEDKIT_NODE_TIMING"))
"""Print how long each message's pull, answer and push took (``FEDKIT_NODE_TIMING=1``)."""

FIRST = 0.02
"""Seconds between asks for a message right after one (the next of a round follows
soon); the wait doubles while the node stays idle, up to ``serve``'s ``poll``, so ten idle
nodes on one machine do not spend its cores asking. Flower's SuperNode waits 3 s."""


def serve(
    superlink: str,
    partition: int,
    folder: Path,
    *,
    certificates: bytes | None = None,
    keys: tuple[Any, Any] | None = None,
    site: Path | None = None,
    allow: frozenset[str] | None = None,
    poll: float = 0.2,
    stop: Callable[[], bool] = lambda: False,
    connected: Callable[[int], None] = lambda node_id: None,
) -> None:
    """Answer the SuperLink's messages for this node until ``stop()`` is true (or the
    process ends). ``superlink`` is its Fleet API (host:port); ``certificates`` the CA
    that verifies it (``None``: no TLS); ``keys`` the node's key pair when the SuperLink
    authenticates nodes; ``partition`` the client this node holds; ``site`` a real site's
    own ImageFolder (``fedkit.data.site``); ``allow`` the plugins this node runs (``None``:
    every one installed here); ``connected`` is told the node's Flower id."""

    quick_pulls()
    host = NodeHost(folder / "memories", allow, site, resident=True)
    with internals.connect(superlink, certificates is None, certificates, keys) as conn:
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
            except RunNotRunning:
                continue  # the run ended (or was stopped) while this message was under way
            if TIMING:
                print(
                    f"fedkit-timing {message.metadata.message_type} at {time.time():.3f} "
                    f"pull {pulled - began:.3f} handle {handled - pulled:.3f} "
                    f"push {time.perf_counter() - handled:.3f} state {state_bytes(state)} B",
                    flush=True,
                )


def answer(host: NodeHost, message: Message, state: RecordDict, partition: int) -> Message:
    """The node's reply to one message: the host's answer, or the error it raised, which
    the server books as this client's failure."""

    try:
        content = host.handle(message.metadata.message_type, message.content, state, partition)
        return Message(content, reply_to=message)
    except Exception as exc:  # noqa: BLE001 - the server sees it as the client's failure
        reason = f"{type(exc).__name__}: {exc}"
        refused = isinstance(exc, FedkitError)  # a refusal or bad input: its line says it all
        print(reason if refused else reason + "\n" + traceback.format_exc(limit=6), flush=True)
        return internals.error_reply(message, reason)


def state_bytes(state: Any) -> int:
    """The bytes a node's ``Context.state`` holds: its arrays and its config records' byte
    values (what crosses with the state when Flower moves it)."""
    arrays = sum(
        len(array.data) for record in state.array_records.values() for array in record.values()
    )
    return arrays + sum(
        len(value)
        for record in state.config_records.values()
        for value in record.values()
        if isinstance(value, bytes)
    )

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

A node outlives its SuperLink. When the SuperLink stops answering, the node keeps asking;
when it answers again but no longer knows the node (it restarted without its database),
the node joins it again, as Flower's SuperNode joins at start (registering itself, or
activating its registered key); its runs' states and setups stay in this process. A
refused key is retried too: the SuperLink refuses a key whose previous node it still
holds online (``internals.ONLINE_FOR`` s after that node's last heartbeat) with the same
reply it gives an unregistered key. After ``reconnect`` seconds without success, or at
once when retrying cannot help (TLS, a missing key), ``serve`` raises ``NodeStopped``
saying what to check.
"""

from __future__ import annotations

import os
import socket
import ssl
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
from fedkit.flower.secagg import protocol_reply

TIMING = bool(os.environ.get("FEDKIT_NODE_TIMING"))
"""Print how long each message's pull, answer and push took (``FEDKIT_NODE_TIMING=1``)."""

RECONNECT = 300.0
"""Seconds a node keeps trying to reach or rejoin its SuperLink before it stops (exit 1);
more than the ``internals.ONLINE_FOR`` s the SuperLink holds a killed node's key."""

PAUSE = 10.0
"""Longest wait between two tries (s); the first waits 1 s, each next one twice longer."""

FIRST = 0.02
"""Seconds between asks for a message right after one (the next of a round follows
soon); the wait doubles while the node stays idle, up to ``serve``'s ``poll``, so ten idle
nodes on one machine do not spend its cores asking. Flower's SuperNode waits 3 s."""


class NodeStopped(FedkitError):
    """The node gave up on its SuperLink; the message says why and what to check.
    ``unreachable``: nothing answered at the address for the whole ``reconnect`` time."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


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
    reconnect: float = RECONNECT,
    stop: Callable[[], bool] = lambda: False,
    connected: Callable[[int], None] = lambda node_id: None,
) -> None:
    """Answer the SuperLink's messages for this node until ``stop()`` is true (or the
    process ends). ``superlink`` is its Fleet API (host:port); ``certificates`` the CA
    that verifies it (``None``: no TLS); ``keys`` the node's key pair when the SuperLink
    authenticates nodes; ``partition`` the client this node holds; ``site`` a real site's
    own ImageFolder (``fedkit.data.site``); ``allow`` the plugins this node runs (``None``:
    every one installed here); ``reconnect`` how long to keep trying to reach or rejoin
    the SuperLink (s) before raising ``NodeStopped``; ``connected`` is told the node's
    Flower id each time it joins."""

    quick_pulls()
    host = NodeHost(folder / "memories", allow, site, resident=True)
    series: dict[int, str] = {}
    states: dict[str, RecordDict] = {}
    trouble = Trouble(superlink, reconnect, insecure=certificates is None, keyed=keys is not None)
    while not stop():
        try:
            with internals.connect(superlink, certificates is None, certificates, keys) as conn:
                connected(conn[0])
                trouble.over()
                try:  # returned, not raised: Flower's connection would swallow it
                    problem = answering(conn, host, partition, series, states, poll, stop, trouble)
                except NodeStopped as stopped:
                    problem = stopped
        except internals.NotConnected as error:
            problem = error
        if problem is None:
            return
        trouble.handle(problem)


def answering(
    conn: Any,
    host: NodeHost,
    partition: int,
    series: dict[int, str],
    states: dict[str, RecordDict],
    poll: float,
    stop: Callable[[], bool],
    trouble: Trouble,
) -> Exception | None:
    """Answer messages over one connection until ``stop()`` (``None``) or until the
    connection fails in a way waiting on it cannot mend (that error): pull, answer, push,
    and wait out a SuperLink that does not answer."""
    _node_id, receive, send, get_run, _fab, pull_object, push_object, confirm = conn
    wait = FIRST
    while not stop():
        try:
            got = receive()
        except Exception as error:  # noqa: BLE001 - sorted by what it means
            if internals.diagnose(error) != internals.UNREACHABLE:
                return error
            trouble.handle(error)  # the SuperLink may come back still knowing this node
            continue
        trouble.over()
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
        except Exception as error:  # noqa: BLE001 - sorted by what it means
            kind = internals.diagnose(error)
            if kind == internals.LOST:
                return error
            print(
                f"a message of run {run_id} got no reply ({internals.describe(error)}); "
                "the server counts this client as not answering it",
                flush=True,
            )
            if kind == internals.UNREACHABLE:
                trouble.handle(error)
            continue
        if TIMING:
            print(
                f"fedkit-timing {message.metadata.message_type} at {time.time():.3f} "
                f"pull {pulled - began:.3f} handle {handled - pulled:.3f} "
                f"push {time.perf_counter() - handled:.3f} state {state_bytes(state)} B",
                flush=True,
            )
    return None


class Trouble:
    """The node's dealings with a SuperLink it lost: what to say, how long to wait before
    the next try, and when to stop (``NodeStopped``)."""

    def __init__(self, superlink: str, budget: float, *, insecure: bool, keyed: bool) -> None:
        self.superlink, self.budget, self.insecure, self.keyed = superlink, budget, insecure, keyed
        self.since: float | None = None  # when the trouble began
        self.kind: str | None = None  # the last kind reported
        self.pause = 1.0

    def over(self) -> None:
        """The SuperLink answered: say so if it had not, and start afresh."""
        if self.since is not None and self.kind == internals.UNREACHABLE:
            say(f"the SuperLink at {self.superlink} answers again")
        self.since, self.kind, self.pause = None, None, 1.0

    def handle(self, error: Exception) -> None:
        """Say what ``error`` means the first time, then wait before the next try; raise
        ``NodeStopped`` when trying again cannot help or the time is up."""
        if isinstance(error, NodeStopped):
            raise error
        kind = internals.diagnose(error)
        if kind is None:
            raise error  # not the connection: a fault of the node's own, with its traceback
        reason, link = internals.describe(error), f"the SuperLink at {self.superlink}"
        if kind == internals.REJECTED:
            raise NodeStopped(f"{link} refused this node: {reason}")
        if kind == internals.TLS:
            host = self.superlink.rpartition(":")[0].strip("[]")
            raise NodeStopped(
                f"TLS with {link} failed ({reason}): is it started with TLS, does its "
                f"certificate name {host}, and did the CA in --root-certificates sign it?"
            )
        if kind == internals.NEEDS_KEY:
            raise NodeStopped(
                f"{link} admits only registered nodes (--enable-supernode-auth): make a key "
                "(fedkit deploy keygen KEY), have KEY.pub registered (fedkit deploy "
                "register), and start this node with --auth-key KEY"
            )
        if kind == internals.UNREACHABLE and self.insecure and speaks_tls(self.superlink):
            raise NodeStopped(
                f"{link} speaks TLS, and this node was started with --insecure: start it "
                "with --root-certificates CA.pem (the CA that signed the SuperLink's "
                "certificate)"
            )
        now = time.monotonic()
        if self.since is None:
            self.since = now
        waited = now - self.since
        if waited >= self.budget:
            if kind == internals.REFUSED:
                raise NodeStopped(
                    "not admitted: is this key registered (fedkit deploy register)? "
                    f"{link} refused it for {waited:.0f} s ({reason})"
                )
            raise NodeStopped(
                f"{link} did not answer for {waited:.0f} s ({reason}); the node stops "
                "(--reconnect sets how long it tries)",
                unreachable=kind == internals.UNREACHABLE,
            )
        if kind != self.kind:
            self.kind = kind
            say(self.words(kind, reason))
        if kind == internals.LOST:
            return  # it answers: join again at once
        time.sleep(min(self.pause, self.budget - waited))
        self.pause = min(self.pause * 2, PAUSE)

    def words(self, kind: str, reason: str) -> str:
        """The line that says what the node is doing about ``kind``."""
        link, budget = f"the SuperLink at {self.superlink}", f"{self.budget:.0f} s"
        if kind == internals.LOST:
            return (
                f"{link} no longer knows this node ({reason}): it restarted; joining it "
                "again (this node's runs and their states stay here)"
            )
        if kind == internals.REFUSED:
            held = (
                f"this key was admitted less than {internals.ONLINE_FOR:.0f} s ago (a node "
                "that was killed stays online that long after its last heartbeat)"
                if self.keyed
                else "it refused this node"
            )
            return (
                f"{link} does not know this node yet: it restarted, or {held}; retrying "
                f"for up to {budget} ({reason})"
            )
        return f"{link} does not answer ({reason}); retrying for up to {budget}"


def say(line: str) -> None:
    """One line of the node's log."""
    print(line, flush=True)


def speaks_tls(address: str, timeout: float = 3.0) -> bool:
    """Whether the server at ``address`` (host:port) completes a TLS handshake (its
    certificate unchecked): tells a TLS SuperLink from one that does not answer."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=host or None):
                return True
    except (OSError, ValueError):
        return False


def answer(host: NodeHost, message: Message, state: RecordDict, partition: int) -> Message:
    """The node's reply to one message: the host's answer, or the error it raised, which
    the server books as this client's failure."""

    try:
        protocol = protocol_reply(message, state)  # a SecAgg+ stage
        if protocol is not None:
            return protocol
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

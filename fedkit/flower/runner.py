"""A deployment node's fedkit process: it lives as long as the node and runs every
ClientApp task of the node itself, so torch, the model and the client's data load once.

By default a Flower SuperNode starts a fresh process for every message it receives
(importing the app, rebuilding its state). With ``--isolation process`` it leaves that to
a process the operator runs next to it; ``fedkit deploy node`` starts the SuperNode so and
then runs ``serve`` here: it asks the SuperNode's runtime API for ClientApp tasks, pulls
each task's message and the node's ``Context``, answers with a ``NodeHost``
(``fedkit.flower.node``), and pushes the reply and the new context back, as Flower's own
``flwr-clientapp`` process does once per message.

This uses Flower's runtime client (``flwr.supercore.runtime``) and the task helpers of
``flwr.supernode.runtime.run_clientapp``: the ``flower`` extra pins the Flower minor
version they were written against.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any

from flwr.app import Message
from flwr.app.error import Error
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

from fedkit.flower.node import NodeHost
from fedkit.flower.tuning import quick_pulls
from fedkit.plugin.registry import discover

TIMING = bool(os.environ.get("FEDKIT_NODE_TIMING"))
"""Print how long each task's pull, answer and push took (``FEDKIT_NODE_TIMING=1``)."""

POLL = (0.02, 0.5)
"""Seconds between asks for a task when there is none: the first soon after a task (the
next message of a round follows soon), doubling up to the second while idle, so ten
idle nodes on one machine do not spend its cores asking."""


def installed_modules() -> tuple[str, ...]:
    """The top-level modules of the plugins installed here: what a setup may rebuild."""

    return tuple(sorted({ep.value.split(":")[0].split(".")[0] for ep in discover().values()}))


def _client(address: str, insecure: bool, certificates: bytes | None, *extra: Any) -> Any:

    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), *extra],
        retry_invoker=make_simple_http_retry_invoker(),
    )


def serve(
    address: str,
    partition: int,
    folder: Path,
    insecure: bool = True,
    certificates: bytes | None = None,
    stop: Any = None,
    site: Path | None = None,
) -> None:
    """Run the node's ClientApp tasks until ``stop()`` is true (or the process ends).
    ``address`` is the SuperNode's runtime API; ``partition`` the client it holds;
    ``site`` a real site's own ImageFolder (``fedkit.data.site``)."""

    quick_pulls()
    host = NodeHost(folder / "memories", installed_modules(), site, resident=True)
    tasks = _client(address, insecure, certificates)
    wait = POLL[0]
    try:
        while stop is None or not stop():
            found = tasks.AcquireTask(
                AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
            )
            if not (found.HasField("task") and found.token):
                time.sleep(wait)
                wait = min(wait * 2, POLL[1])
                continue
            wait = POLL[0]
            run_task(host, address, found.token, partition, insecure, certificates, SubStatus)
    finally:
        tasks.close()


def state_bytes(state: Any) -> int:
    """The bytes a node's ``Context.state`` holds in its config records' byte values."""
    return sum(
        len(value)
        for record in state.config_records.values()
        for value in record.values()
        if isinstance(value, bytes)
    )


def run_task(
    host: Any,
    address: str,
    token: str,
    partition: int,
    insecure: bool,
    certificates: bytes | None,
    status: Any,
) -> None:
    """One message: pull it and the node's context, answer it, push both back."""

    began = time.perf_counter()
    client = _client(address, insecure, certificates, RuntimeTokenHttpInterceptor(token))
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    context, outcome, details = None, status.FAILED, "the task failed"
    try:
        message, context, _run, _fab = pull_task_input(client)
        pulled = time.perf_counter()
        try:
            content = host.handle(
                message.metadata.message_type, message.content, context.state, partition
            )
            reply = Message(content, reply_to=message)
            outcome, details = status.COMPLETED, ""
        except Exception as exc:  # noqa: BLE001 - the server sees it as the client's failure
            reason = f"{type(exc).__name__}: {exc}"
            details = reason + "\n" + traceback.format_exc(limit=6)
            reply = Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message
            )
        handled = time.perf_counter()
        push_message(client, reply, context)
        if TIMING:
            print(
                f"fedkit-timing {message.metadata.message_type} at {time.time():.3f} "
                f"pull {pulled - began:.3f} "
                f"handle {handled - pulled:.3f} push {time.perf_counter() - handled:.3f} "
                f"state {state_bytes(context.state)} B",
                flush=True,
            )
    finally:
        push_task_output(client, context, outcome, details)
        if heartbeat.is_running:
            heartbeat.stop()
        client.close()

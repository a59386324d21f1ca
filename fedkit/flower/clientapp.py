"""fedkit's ClientApp (``clientapp = "fedkit.flower.clientapp:app"``): every message a
node receives answered by a ``NodeHost`` (``fedkit.flower.node``) in the process that
runs it.

Flower's simulation runs it on Ray actors. A deployment node started by
``fedkit deploy node`` does not need it (its own long-lived process answers,
``fedkit.flower.runner``); a SuperNode started by hand in Flower's default subprocess
isolation runs it once per message, rebuilding the client each time (slow, but the same
numbers). A node's folder for what its client keeps is its ``fedkit-dir`` node config,
else the one the server names (a simulation, on the server's machine); a real site's own
ImageFolder is its ``fedkit-data`` node config (``fedkit.data.site``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flwr.app import Message
from flwr.clientapp import ClientApp

from fedkit.flower.node import NodeHost
from fedkit.flower.secagg import protocol_reply


def make_app() -> ClientApp:
    """A ClientApp whose process keeps one ``NodeHost`` for every node it answers for."""

    app, hosts = ClientApp(), dict[Any, NodeHost]()

    def handle(msg: Message, context: Any) -> Message:
        protocol = protocol_reply(msg, context.state)  # a SecAgg+ stage
        if protocol is not None:
            return protocol
        folder = context.node_config.get("fedkit-dir")
        if folder not in hosts:
            site = context.node_config.get("fedkit-data")
            hosts[folder] = NodeHost(
                Path(str(folder)) / "memories" if folder else None,
                site=Path(str(site)) if site else None,
            )
        partition = int(context.node_config["partition-id"])
        kind = msg.metadata.message_type
        return Message(
            hosts[folder].handle(kind, msg.content, context.state, partition), reply_to=msg
        )

    app.train()(handle)
    app.evaluate()(handle)
    app.query()(handle)
    return app


app = make_app()

"""Sending messages over a Flower grid and collecting their replies, for the executor's
rounds and for secure aggregation's stages alike: pushed together, pulled every ``POLL``
seconds (Flower's own ``send_and_receive`` waits 3 s between pulls), each reply matched
to the message it answers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

POLL = 0.05
"""Seconds between pulls of replies from the SuperLink."""


def push(grid: Any, messages: list[Any], owners: list[int]) -> tuple[dict[str, int], list[int]]:
    """Push the messages: the id of each one the SuperLink took, mapped to its owner
    (a client, or a node id), and the owners of those it refused (Flower answers an
    id per message, in order, empty for a refused one)."""
    if not messages:
        return {}, []
    ids = list(grid.push_messages(messages))
    if len(ids) != len(messages):  # a grid that leaves refused ones out
        taken = set(ids)
        ids = [m.metadata.message_id for m in messages]
        ids = [mid if mid in taken else "" for mid in ids]
    waiting = {mid: owner for mid, owner in zip(ids, owners, strict=True) if mid}
    return waiting, [owner for mid, owner in zip(ids, owners, strict=True) if not mid]


def pull(
    grid: Any,
    waiting: dict[str, int],
    timeout: float | None,
    enough: Callable[[], bool] = lambda: False,
) -> Iterator[tuple[int, Any]]:
    """(owner, reply) for each reply to a message in ``waiting`` (which it empties as
    they come), pulling every ``POLL`` seconds until all came, ``timeout`` passed or
    ``enough()``; each reply is matched to the message it answers, whoever sent it."""
    end = None if timeout is None else time.monotonic() + timeout
    while waiting:
        for reply in grid.pull_messages(list(waiting)):
            owner = waiting.pop(reply.metadata.reply_to_message_id, None)
            if owner is not None:
                yield owner, reply
        if not waiting or enough() or (end is not None and time.monotonic() >= end):
            return
        time.sleep(POLL)

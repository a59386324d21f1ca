"""Flower's SuperNode, polling for messages at most ``FEDKIT_NODE_POLL`` seconds apart.

Flower 1.42's SuperNode sleeps a fixed 3 s whenever it finds no message (and 0.5 s while
it waits for a reply to push), which adds up to 3.5 s to every message. ``fedkit deploy
node`` starts it through this module, which shortens those sleeps (20 ms after work,
doubling while idle up to ``FEDKIT_NODE_POLL``, 0.2 s by default) and then runs Flower's
own ``flower-supernode`` entry point with the same arguments.
"""

from __future__ import annotations

import os
import time
from typing import Any

from flwr.supernode import start_client_internal
from flwr.supernode.cli import flower_supernode

from fedkit.flower.tuning import quick_pulls

FIRST = 0.02
"""Seconds of the first sleep after the loop did work: the next message of a round, or
the reply being computed, usually follows soon."""

BUSY = 0.25
"""A gap longer than this between two sleeps means the loop did work in between (an idle
poll takes milliseconds), so the next sleep is short again."""


class ShortSleeps:
    """``time`` as Flower's SuperNode loop uses it: each sleep ``FIRST`` seconds after work,
    doubling while the loop stays idle, never more than ``limit`` (nor than Flower asked),
    so ten idle nodes on one machine do not spend its cores asking for messages."""

    def __init__(self, limit: float) -> None:
        self.limit, self.wait, self.woke = limit, FIRST, 0.0

    def sleep(self, seconds: float) -> None:
        if time.monotonic() - self.woke > BUSY:
            self.wait = FIRST
        time.sleep(min(seconds, self.wait, self.limit))
        self.wait = min(self.wait * 2, self.limit)
        self.woke = time.monotonic()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def main() -> Any:

    quick_pulls()
    start_client_internal.time = ShortSleeps(float(os.environ.get("FEDKIT_NODE_POLL", "0.2")))
    return flower_supernode()


if __name__ == "__main__":
    raise SystemExit(main())

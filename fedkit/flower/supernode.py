"""Flower's SuperNode, polling for messages every ``FEDKIT_NODE_POLL`` seconds.

Flower 1.42's SuperNode sleeps a fixed 3 s whenever it finds no message (and 0.5 s while
it waits for a reply to push), which adds up to 3.5 s to every message. ``fedkit deploy
node`` starts it through this module, which caps those sleeps (default 0.2 s) and then
runs Flower's own ``flower-supernode`` entry point with the same arguments.
"""

from __future__ import annotations

import os
import time
from typing import Any

from flwr.supernode import start_client_internal
from flwr.supernode.cli import flower_supernode

from fedkit.flower.tuning import quick_pulls


class ShortSleeps:
    """``time`` as Flower's SuperNode loop uses it, with sleeps capped at ``limit``."""

    def __init__(self, limit: float) -> None:
        self.limit = limit

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.limit))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def main() -> Any:

    quick_pulls()
    start_client_internal.time = ShortSleeps(float(os.environ.get("FEDKIT_NODE_POLL", "0.2")))
    return flower_supernode()


if __name__ == "__main__":
    raise SystemExit(main())

"""What every client keeps between rounds (``ClientMemory``), by client id.

Executors talk to the ``StateStore`` protocol only, so a store that spills to disk can
replace the in-memory one without touching the round loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from fedkit.client import ClientMemory


class StateStore(Protocol):
    def get(self, client: int) -> ClientMemory | None: ...
    def put(self, client: int, memory: ClientMemory) -> None: ...
    def items(self) -> Iterator[tuple[int, ClientMemory]]: ...


class MemoryStore:
    """Client memories kept in a dict (tensors on the CPU)."""

    def __init__(self) -> None:
        self._memories: dict[int, ClientMemory] = {}

    def get(self, client: int) -> ClientMemory | None:
        return self._memories.get(client)

    def put(self, client: int, memory: ClientMemory) -> None:
        self._memories[client] = memory

    def items(self) -> Iterator[tuple[int, ClientMemory]]:
        return iter(sorted(self._memories.items()))

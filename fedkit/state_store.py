"""Per-client persistent tensors (a client's full model state from its last round).

The engine talks to the ``StateStore`` protocol only, so a store that spills to disk can
replace the in-memory one without touching the round loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from torch import Tensor


class StateStore(Protocol):
    def get(self, client: int) -> dict[str, Tensor] | None: ...
    def put(self, client: int, state: dict[str, Tensor]) -> None: ...
    def items(self) -> Iterator[tuple[int, dict[str, Tensor]]]: ...


class MemoryStore:
    """Client states kept in a dict, on the CPU."""

    def __init__(self) -> None:
        self._states: dict[int, dict[str, Tensor]] = {}

    def get(self, client: int) -> dict[str, Tensor] | None:
        return self._states.get(client)

    def put(self, client: int, state: dict[str, Tensor]) -> None:
        self._states[client] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def items(self) -> Iterator[tuple[int, dict[str, Tensor]]]:
        return iter(sorted(self._states.items()))

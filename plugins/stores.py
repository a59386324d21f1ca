"""fedkit's client stores: ``memory`` (every client's memory in a dict) and ``disk`` (one
file per client and round, a bounded cache in memory). Registered the way an outside
package registers its own."""

from __future__ import annotations

from collections.abc import Callable

from fedkit import hookimpl
from fedkit.rundir.store import disk_store, memory_store


@hookimpl
def register_stores(register: Callable[..., None]) -> None:
    register("memory", memory_store)
    register("disk", disk_store)

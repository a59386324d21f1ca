"""fedkit's executors: ``sequential`` (clients one after another in this process),
``isolated`` (each job as a fresh worker process would run it, for checking plugins) and
``ray`` (long-lived actors on a Ray cluster; the ``ray`` extra). Registered the way an
outside package registers its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedkit import hookimpl
from fedkit.core.executor import IsolatedExecutor, SequentialExecutor


def ray_executor(*args: Any) -> Any:
    """The Ray executor, imported when a recipe asks for it (Ray is an optional extra)."""
    from fedkit.core.ray_executor import RayExecutor

    return RayExecutor(*args)


@hookimpl
def register_executors(register: Callable[..., None]) -> None:
    register("sequential", SequentialExecutor)
    register("isolated", IsolatedExecutor)
    register("ray", ray_executor)

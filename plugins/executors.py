"""fedkit's executors: ``sequential`` (clients one after another in this process),
``isolated`` (each job as a fresh worker process would run it, for checking plugins),
``ray`` (long-lived actors on a Ray cluster; the ``ray`` extra) and ``flower`` (Flower
nodes, simulated or deployed; the ``flower`` extra). Registered the way an
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


def flower_executor(*args: Any) -> Any:
    """The Flower executor, imported when a recipe asks for it (the ``flower`` extra)."""
    from fedkit.flower import import_flwr

    import_flwr()  # a clear error naming the extra, before anything imports Flower
    from fedkit.flower.flower_executor import FlowerExecutor

    return FlowerExecutor(*args)


@hookimpl
def register_executors(register: Callable[..., None]) -> None:
    register("sequential", SequentialExecutor)
    register("isolated", IsolatedExecutor)
    register("ray", ray_executor)
    register("flower", flower_executor)

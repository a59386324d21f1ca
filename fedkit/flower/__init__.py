"""fedkit on Flower: the ``flower`` executor (``flower_executor.py``), the simulation
runtime (``simulation.py``), a node's client side (``node.py``), fedkit's messages as
Flower records (``records.py``), and what a deployment runs: the apps (``serverapp.py``,
``clientapp.py``), a node in one long-lived process (``runner.py``), its key pair for node
authentication (``node_keys.py``) and what it uses of Flower beyond its public API
(``internals.py``). Needs the ``flower`` extra."""

from __future__ import annotations

from typing import Any

from fedkit.errors import RecipeError


def import_flwr() -> Any:
    """Flower, or a clear error naming the extra that installs it (before anything in
    this package, which imports Flower, is loaded)."""
    try:
        import flwr
    except ImportError:
        raise RecipeError(
            "engine.executor",
            "the flower extra installed (pip install 'fedkit-fl[flower]')",
            "flower",
        ) from None
    return flwr

"""fedkit's ServerApp for a Flower deployment (``serverapp = "fedkit.flower.serverapp:app"``).

It runs fedkit's server side (engine, server hooks, ledger, checkpoints) in the process
Flower's SuperLink starts for a run, with the ``flower`` executor talking to the
deployment's nodes through the run's grid. The run config names the recipe (a path, a
shipped name, or YAML text), the run directory, and ``--set`` overrides; an ``out``
that already holds a checkpoint is resumed (the nodes adopt their own files).
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedkit.config.schema import load_recipe
from fedkit.config.shipped import resolve
from fedkit.core import runs
from fedkit.flower.flower_executor import use_link
from fedkit.flower.tuning import quick_pulls
from fedkit.rundir import checkpoint
from fedkit.rundir.logs import RECIPE

app = ServerApp()
quick_pulls()

NODE_WAIT = 300.0
"""Seconds to wait for the recipe's clients' nodes to connect."""


class DeploymentLink:
    """The run's grid, once every client's node has connected; memories stay on nodes."""

    remote = True

    def __init__(self, grid: Grid, nodes: int, wait: float = NODE_WAIT) -> None:
        self.grid = grid
        deadline = time.monotonic() + wait
        while len(list(grid.get_node_ids())) < nodes:
            if time.monotonic() > deadline:
                found = len(list(grid.get_node_ids()))
                raise RuntimeError(
                    f"{found} of the recipe's {nodes} nodes connected within {wait:g} s: "
                    "start one `fedkit deploy node` per client"
                )
            time.sleep(0.5)

    def close(self) -> None: ...


@app.main()
def main(grid: Grid, context: Context) -> None:

    config: dict[str, Any] = dict(context.run_config)
    out = Path(str(config["out"])).expanduser().resolve()
    overrides = [s.strip() for s in str(config.get("set", "")).split(";") if s.strip()]
    resuming = checkpoint.latest_round(out) is not None
    if resuming:
        nodes = load_recipe(out / RECIPE).data.num_clients
    else:
        source = str(config["recipe"])
        path = Path(source) if Path(source).is_file() else resolve(source)
        recipe = load_recipe(path, [*overrides, "engine.executor=flower"])
        nodes = recipe.data.num_clients
    use_link(DeploymentLink(grid, nodes))
    try:
        run, done = runs.resume(out, overrides) if resuming else (runs.start(recipe, out), 0)
        summary = runs.execute(run, out, done)
    except Exception:
        traceback.print_exc()  # into the run's log stream (flwr run --stream, flwr log)
        raise
    finally:
        use_link(None)
    print(f"fedkit: {out} done after round {summary['rounds']}: {summary['final']}")

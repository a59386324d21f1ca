"""fedkit's ServerApp for a Flower deployment (``serverapp = "fedkit.flower.serverapp:app"``).

It runs fedkit's server side (engine, server hooks, ledger, checkpoints) in the process
Flower's SuperLink starts for a run, with the ``flower`` executor talking to the
deployment's nodes through the run's grid. The run config carries the recipe (its YAML
text, or a shipped recipe's name), the run directory (a name under the operator's
``FEDKIT_SERVER_ROOT``) and ``--set`` overrides; ``fedkit.flower.server_root`` checks
them, and a refusal is one line in the run's log naming the key. An ``out`` that already
holds a checkpoint is resumed (the nodes adopt their own files). The ServerApp works in
the run directory, so a relative path a plugin writes (a TensorBoard logdir) lands there.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedkit.core import runs
from fedkit.errors import FedkitError
from fedkit.flower.flower_executor import use_link
from fedkit.flower.internals import quick_pulls
from fedkit.flower.server_root import submission

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


@contextlib.contextmanager
def working_in(folder: Path) -> Iterator[None]:
    """Work in ``folder`` (created), then back where the process was."""
    folder.mkdir(parents=True, exist_ok=True)
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run (or resume) the submitted recipe inside the operator's folder."""
    try:
        sent = submission(dict(context.run_config))
    except FedkitError as error:
        print(f"fedkit: refused the run: {error}", flush=True)  # the run's log (flwr log)
        raise
    out = sent.out
    use_link(DeploymentLink(grid, sent.clients))
    try:
        with working_in(out):
            if sent.recipe is None:
                run, done = runs.resume(out, sent.overrides)
            else:
                run, done = runs.start(sent.recipe, out), 0
            summary = runs.execute(run, out, done)
    except Exception:
        traceback.print_exc()  # into the run's log stream (flwr run --stream, flwr log)
        raise
    finally:
        use_link(None)
    print(f"fedkit: {out} done after round {summary['rounds']}: {summary['final']}")

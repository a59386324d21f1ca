"""fedkit's ServerApp for a Flower deployment (``serverapp = "fedkit.flower.serverapp:app"``).

It runs fedkit's server side (engine, server hooks, ledger, checkpoints) in the process
Flower's SuperLink starts for a run, with the ``flower`` executor talking to the
deployment's nodes through the run's grid. The run config carries the recipe (its YAML
text, or a shipped recipe's name), the run directory (a name under the operator's
``FEDKIT_SERVER_ROOT``) and ``--set`` overrides; ``fedkit.flower.server_root`` checks
them, and a refusal is one line in the run's log naming the key. An ``out`` that already
holds a checkpoint is resumed (the nodes adopt their own files). The ServerApp works in
the run directory, so a relative path a plugin writes (a TensorBoard logdir) lands there.
It prints a line per round as ``fedkit run`` does, writes ``report.html`` at the end,
and, when the run fails, one last ``fedkit: ...`` line saying why, which
``fedkit deploy run`` repeats as it exits non-zero.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedkit.cli.progress import CHECKPOINTED, LineReporter
from fedkit.cli.report import write_report as write_page
from fedkit.core import runs, truth
from fedkit.errors import FedkitError
from fedkit.flower.flower_executor import FlowerExecutor
from fedkit.flower.internals import quick_pulls
from fedkit.flower.server_root import submission

app = ServerApp()
quick_pulls()

NODE_WAIT = 300.0
"""Seconds to wait for the recipe's clients' nodes to connect."""


class DeploymentLink:
    """The run's grid, once every client's node has connected; memories stay on nodes."""

    remote = True

    def __init__(self, grid: Grid, nodes: int, wait: float | None = None) -> None:
        self.grid = grid
        wait = NODE_WAIT if wait is None else wait
        deadline = time.monotonic() + wait
        while len(list(grid.get_node_ids())) < nodes:
            if time.monotonic() > deadline:
                found = len(list(grid.get_node_ids()))
                raise FedkitError(
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
        if sent.recipe is not None:
            truth.refuse_deployed(sent.recipe)
    except FedkitError as error:
        print(f"fedkit: refused the run: {error}", flush=True)  # the run's log (flwr log)
        raise
    out = sent.out
    if sent.recipe is None:
        print(f"{CHECKPOINTED}{out}: resuming its newest checkpoint", flush=True)
    try:
        nodes = functools.partial(FlowerExecutor, link=DeploymentLink(grid, sent.clients))
        with working_in(out):
            if sent.recipe is None:
                run, done = runs.resume(out, sent.overrides, nodes)
            else:
                run, done = runs.start(sent.recipe, out, executor=nodes), 0
                print(f"{CHECKPOINTED}{out}: started", flush=True)
            rounds = run.recipe.federation.rounds
            summary = runs.execute(run, out, done, LineReporter(rounds))
    except Exception as error:
        if not isinstance(error, FedkitError):  # a bug: its traceback, into the run's log
            traceback.print_exc()  # (flwr run --stream, flwr log)
        print(f"fedkit: {failure(error)}", flush=True)  # the line `fedkit deploy run` shows
        raise
    write_report(out)
    print(f"{CHECKPOINTED}{out}: done, {summary['rounds']} rounds", flush=True)


def failure(error: Exception) -> str:
    """One line saying why the run stopped: fedkit's own message, or the exception's type
    and first line (a bug's ``KeyError: 1`` says little without its type)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if isinstance(error, FedkitError):
        return text or type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def write_report(out: Path) -> None:
    """``report.html`` in the run directory, as ``fedkit run`` writes it (unless
    ``FEDKIT_REPORT=0`` in the SuperLink's environment, as for ``fedkit run``); a server
    without matplotlib, or a report that fails, gets one line instead: the run is done."""
    if os.environ.get("FEDKIT_REPORT", "").strip().lower() in ("0", "false", "no", "off"):
        return
    try:
        page = write_page(out)
    except FedkitError as error:  # matplotlib is not installed here
        print(f"no report: {error}", flush=True)
    except Exception as error:  # noqa: BLE001 - the run's files are whole; only the page fails
        print(f"no report: {failure(error)} (fedkit report {out} retries)", flush=True)
    else:
        print(f"report: {page}", flush=True)

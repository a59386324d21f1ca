"""MLflow: every number of each round's metrics row as an MLflow metric, the recipe as
parameters.

An observer, like ``tensorboard``: it implements only ``configure`` and
``round_logged``, and changes nothing about the run. Each fedkit run is one MLflow run,
created in ``configure``; its id is kept in ``server.state``, so a resumed fedkit run
goes on logging into the same MLflow run. Creating it (or, on resume, marking it running
again) is the first write to the tracking store, so a store this process cannot write
(a read-only disk, a path under a file, MLflow 3's folder store, which refuses writes)
stops the run before round 1 with one ``RecipeError`` naming the tracking URI, never
after the run's own files were written. Rounds are MLflow steps; nested values are
flattened (``bytes/up_model``). The default store is a local SQLite file
(``sqlite:///mlflow.db`` in the working directory: offline, one file, what
``mlflow ui --backend-store-uri sqlite:///mlflow.db`` reads); ``http://host:5000`` is a
shared server. Needs the ``mlflow`` extra.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from fedkit import PluginOptions, RecipeError, Server, hookimpl
from fedkit_plugins.tensorboard import cause, option_key, scalars

STATE = "mlflow"
"""Where the MLflow run's id is kept in ``server.state`` (checkpointed)."""


def parameters(value: Any, prefix: str = "") -> dict[str, str]:
    """A recipe as flat MLflow parameters (``federation.optimizer.lr``), lists as text."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, item in value.items():
            out.update(parameters(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: str(value)[:500]}  # MLflow keeps at most 500 characters


def sqlite_file(uri: str) -> Path | None:
    """The database file an ``sqlite:///`` URI names (relative: to the working
    directory), or ``None`` for another store or an in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?")[0]
    return Path(path) if path and path != ":memory:" else None


def probe(file: Path | None) -> None:
    """``OSError`` unless this process can write ``file`` (or create it in its folder)."""
    if file is None:
        return
    try:
        if file.exists():
            with file.open("r+b"):
                return
        with tempfile.TemporaryFile(dir=file.parent):
            return
    except OSError as exc:
        where = file if file.exists() else file.parent
        raise OSError(exc.errno, f"cannot write there ({exc.strerror})", str(where)) from None


class MLflow:
    """MLflow: logs every number of each round's metrics row (an observer)."""

    class Options(PluginOptions):
        tracking_uri: str = "sqlite:///mlflow.db"
        experiment: str = "fedkit"
        run_name: str | None = None
        per_client: bool = False

    def __init__(self, options: Options) -> None:
        self.options = options
        self.client: Any = None  # server side only: opened in configure

    @hookimpl
    def configure(self, server: Server) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise RecipeError(
                "plugins", "the mlflow extra installed (pip install 'fedkit-fl[mlflow]')"
            ) from None
        uri = self.options.tracking_uri
        try:
            probe(sqlite_file(uri))  # at once: MLflow retries an unopenable file for minutes
            self.client = MlflowClient(tracking_uri=uri)
            kept = server.state.get(STATE)
            if kept is None:
                server.state[STATE] = {"run_id": self._new_run(server)}
            else:  # resumed: the run goes on (a write, so an unwritable store shows here)
                self.client.update_run(kept["run_id"], status="RUNNING")
        except Exception as exc:  # noqa: BLE001 - any failure of the store: one clear line
            where = ""
            if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
                where = f", a path relative to the working directory {Path.cwd()}"
            raise RecipeError(
                option_key(server, "mlflow", "tracking_uri"),
                "an MLflow tracking store this process can write: sqlite:///FILE.db in a "
                "writable folder, or a tracking server's http://HOST:PORT (MLflow 3 refuses "
                "writes to its file:// folder store)",
                uri,
                hint=f" ({cause(exc)}{where})",
            ) from None

    def _new_run(self, server: Server) -> str:
        """Create this fedkit run's MLflow run (its experiment if new) with the recipe as
        parameters; its id."""
        from mlflow.entities import Param

        experiment = self.client.get_experiment_by_name(self.options.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(self.options.experiment)
        )
        run = self.client.create_run(experiment_id, run_name=self.options.run_name)
        recipe = parameters(server.recipe.model_dump(mode="json"))
        items = [Param(k, v) for k, v in recipe.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 per batch
            self.client.log_batch(run.info.run_id, params=items[start : start + 100])
        return run.info.run_id

    @hookimpl
    def round_logged(self, server: Server, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        run_id = server.state[STATE]["run_id"]
        row = {k: v for k, v in metrics.items() if k not in ("round", "clients", "clusters")}
        if not self.options.per_client:
            row.pop("per_client", None)
        else:
            row["clients"] = row.pop("per_client", {})
        now, step = int(time.time() * 1000), int(metrics["round"])
        values = [Metric(tag, value, now, step) for tag, value in scalars(row).items()]
        for start in range(0, len(values), 1000):  # MLflow takes at most 1000 per batch
            self.client.log_batch(run_id, metrics=values[start : start + 1000])
        if step == server.recipe.federation.rounds:
            self.client.set_terminated(run_id)

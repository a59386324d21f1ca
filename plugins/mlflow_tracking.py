"""MLflow: every number of each round's metrics row as an MLflow metric, the recipe as
parameters.

An observer, like ``tensorboard``: it implements only ``configure`` (is MLflow
installed?) and ``round_logged``, and changes nothing about the run. Each fedkit run is
one MLflow run, created at the first round; its id is kept in ``server.state``, so a
resumed fedkit run goes on logging into the same MLflow run. Rounds are MLflow steps;
nested values are flattened (``bytes/up_model``). The default store is a local SQLite
file (``sqlite:///mlflow.db`` in the working directory: offline, one file, what
``mlflow ui --backend-store-uri sqlite:///mlflow.db`` reads); any tracking URI works
(``http://host:5000`` for a shared server). Needs the ``mlflow`` extra.
"""

from __future__ import annotations

import time
from typing import Any

from fedkit import PluginOptions, RecipeError, Server, hookimpl
from fedkit_plugins.tensorboard import scalars

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


class MLflow:
    """MLflow: logs every number of each round's metrics row (an observer)."""

    class Options(PluginOptions):
        tracking_uri: str = "sqlite:///mlflow.db"
        experiment: str = "fedkit"
        run_name: str | None = None
        per_client: bool = False

    def __init__(self, options: Options) -> None:
        self.options = options
        self.client: Any = None  # server side only: opened at the first round

    @hookimpl
    def configure(self, server: Server) -> None:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise RecipeError(
                "plugins", "the mlflow extra installed (pip install 'fedkit-fl[mlflow]')"
            ) from None

    def _run_id(self, server: Server) -> str:
        """The MLflow run of this fedkit run (created once, then kept in the checkpoints)."""
        kept = server.state.get(STATE)
        if kept is not None:
            return kept["run_id"]
        experiment = self.client.get_experiment_by_name(self.options.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(self.options.experiment)
        )
        run = self.client.create_run(experiment_id, run_name=self.options.run_name)
        recipe = parameters(server.recipe.model_dump(mode="json"))
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in recipe.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 per batch
            self.client.log_batch(run.info.run_id, params=items[start : start + 100])
        server.state[STATE] = {"run_id": run.info.run_id}
        return run.info.run_id

    @hookimpl
    def round_logged(self, server: Server, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        if self.client is None:
            self.client = MlflowClient(tracking_uri=self.options.tracking_uri)
        run_id = self._run_id(server)
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

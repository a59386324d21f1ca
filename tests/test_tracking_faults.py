"""Tracking plugins whose store cannot be written fail once, before round 1, with one line
naming the option and what to do (issue 54, item 7).

We run as root, for whom a chmod'ed folder stays writable, so a read-only place is made
another way: a path under a regular file (the folder cannot be made), ``/proc`` (the
kernel's file system: no new files, whoever asks) and MLflow 3's ``file://`` store (it
refuses writes). The plugin's ``configure`` is called on a stand-in server (the recipe and
``server.state`` are all it reads); one test goes through ``fedkit run``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from fedkit.config.schema import validate
from fedkit.errors import RecipeError
from fedkit.testing import tiny_recipe


def stand_in(plugin: dict, state: dict | None = None) -> SimpleNamespace:
    """What ``configure`` reads of a server: its recipe (``plugin`` second) and state."""
    return SimpleNamespace(
        recipe=validate(tiny_recipe(plugins=["fedavg", plugin])), state=state or {}
    )


def mlflow_plugin(uri: str):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    from fedkit_plugins.mlflow_tracking import MLflow

    return MLflow(MLflow.Options(tracking_uri=uri))


def unwritable(tmp_path: Path) -> dict[str, str]:
    blocker = tmp_path / "a-file"
    blocker.write_text("a file, not a folder")
    return {
        "under a file": f"sqlite:///{blocker / 'mlflow.db'}",
        "in /proc": "sqlite:////proc/mlflow.db",
        "file store": (tmp_path / "mlruns").as_uri(),  # writable, but MLflow 3 refuses it
    }


@pytest.mark.parametrize("case", ["under a file", "in /proc", "file store"])
def test_an_mlflow_store_that_cannot_be_written_stops_the_run_in_configure(tmp_path, case):
    uri = unwritable(tmp_path)[case]
    plugin = mlflow_plugin(uri)
    server = stand_in({"mlflow": {"tracking_uri": uri}})
    with pytest.raises(RecipeError) as refused:
        plugin.configure(server)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("plugins.1.options.tracking_uri: expected an MLflow tracking")
    assert f"found {uri!r}" in message and "sqlite:///FILE.db" in message
    if case == "file store":
        assert "maintenance mode" in message
    assert server.state == {}  # no MLflow run recorded


def test_a_resumed_run_whose_mlflow_run_cannot_be_written_is_refused(tmp_path, monkeypatch):
    """On resume the plugin marks its MLflow run running again: a write, so a store that
    became read-only (here: a client whose writes fail as SQLite's do) is named before
    round 1. tests/test_reports.py resumes into a real store."""
    import mlflow.tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    plugin = mlflow_plugin(uri)
    updated = []

    class ReadOnly:
        def __init__(self, tracking_uri: str) -> None:
            assert tracking_uri == uri

        def update_run(self, run_id: str, status: str) -> None:
            updated.append((run_id, status))
            raise OSError("attempt to write a readonly database")

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", ReadOnly)
    server = stand_in({"mlflow": {"tracking_uri": uri}}, {"mlflow": {"run_id": "abc"}})
    with pytest.raises(RecipeError) as refused:
        plugin.configure(server)
    assert updated == [("abc", "RUNNING")]
    assert "(OSError: attempt to write a readonly database)" in str(refused.value)
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("where", ["under a file", "in /proc"])
def test_a_tensorboard_logdir_that_cannot_be_written_stops_the_run_in_configure(tmp_path, where):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from fedkit_plugins.tensorboard import TensorBoard

    blocker = tmp_path / "a-file"
    blocker.write_text("a file, not a folder")
    logdir = str(blocker / "tb") if where == "under a file" else "/proc"  # /proc exists
    plugin = TensorBoard(TensorBoard.Options(logdir=logdir))
    with pytest.raises(RecipeError) as refused:
        plugin.configure(stand_in({"tensorboard": {"logdir": logdir}}))
    message = str(refused.value)
    assert message.startswith("plugins.1.options.logdir: expected a folder this process can write")
    assert f"found {logdir!r}" in message and "\n" not in message
    writable = tmp_path / "tb"
    TensorBoard(TensorBoard.Options(logdir=str(writable))).configure(
        stand_in({"tensorboard": {"logdir": str(writable)}})
    )
    assert writable.is_dir() and not list(writable.iterdir())  # the probe left nothing


@pytest.mark.slow
def test_fedkit_run_with_the_default_store_in_a_read_only_directory_exits_2_before_round_1(
    tmp_path, monkeypatch
):
    """``sqlite:///mlflow.db`` (the default) from a working directory no file can be made
    in: one line naming the URI and the folder, exit 2, and the run directory holds no
    checkpoint."""
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    import yaml

    from fedkit.cli.app import app

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(plugins=["fedavg", "mlflow"])))
    monkeypatch.chdir("/proc")
    done = CliRunner().invoke(app, ["run", str(recipe), "--out", str(tmp_path / "run")])
    assert done.exit_code == 2, done.output
    assert "Traceback" not in done.output
    said = " ".join(done.output.split())
    assert "plugins.1.options.tracking_uri" in said and "'sqlite:///mlflow.db'" in said
    assert "relative to the working directory /proc" in said
    assert not (tmp_path / "run" / "checkpoints").exists()

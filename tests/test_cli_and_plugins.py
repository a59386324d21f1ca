"""The CLI's listing commands, third-party plugins through entry points, and the
registry-wide checks every installed plugin must pass."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import tiny_recipe
from typer.testing import CliRunner

import fedkit
import fedkit.cli.app
from fedkit.cli.app import app
from fedkit.config import shipped
from fedkit.config.schema import load_recipe
from fedkit.plugin.registry import describe, discover, hook_names, hook_side
from fedkit.rundir import logs

runner = CliRunner()


def cells(line: str) -> list[str]:
    """The cells of one row of a rich table."""
    return [cell.strip() for cell in line.split("│")[1:-1]]


def test_plugins_lists_fedavg_with_package_and_hooks(monkeypatch):
    monkeypatch.setattr(fedkit.cli.app.console, "width", 250)  # wide enough for one line per plugin
    result = runner.invoke(app, ["plugins"])
    assert result.exit_code == 0
    header = next(ln for ln in result.output.splitlines() if "plugin" in ln and "┃" in ln)
    assert [c.strip() for c in header.split("┃")[1:-1]][:4] == [
        "plugin",
        "package",
        "server hooks",
        "client hooks",
    ]
    line = next(ln for ln in result.output.splitlines() if "fedavg" in ln)
    name, package, server, client, *_ = cells(line)
    assert name == "fedavg" and package == f"fedkit-fl {fedkit.__version__}"
    assert server == "init_models" and client == "local_objective"


def test_recipes_lists_quickstart_with_description():
    result = runner.invoke(app, ["recipes"], terminal_width=200)
    assert result.exit_code == 0
    assert "quickstart" in result.output and "digits" in result.output


def test_recipes_are_one_line_each_with_their_scale_and_filter():
    every = runner.invoke(app, ["recipes"])
    lines = every.output.splitlines()
    assert every.exit_code == 0 and len(lines) == len(shipped.shipped())
    assert any(line.split()[:2] == ["quickstart", "CPU"] for line in lines)
    assert any(line.split()[:2] == ["fedu-cifar10-iid", "GPU"] for line in lines)
    picked = runner.invoke(app, ["recipes", "ifca"]).output.splitlines()
    assert picked and all("ifca" in line.lower() for line in picked)
    assert runner.invoke(app, ["recipes", "no-such-thing"]).exit_code == 1


def test_a_finished_run_resumed_says_it_is_complete(tmp_path, write_recipe):
    raw = tiny_recipe(federation={"rounds": 1}, description="Prüfung: ünïcode")
    out = tmp_path / "run"
    first = runner.invoke(app, ["run", str(write_recipe(raw)), "--out", str(out), "-q"])
    assert first.exit_code == 0 and first.output.strip() == str(out)
    text = (out / "recipe.yaml").read_text(encoding="utf-8")
    assert "Prüfung: ünïcode" in text  # not escaped
    again = runner.invoke(app, ["run", "--resume", str(out)])
    assert again.exit_code == 0 and "is complete: all 1 rounds are done" in again.output
    assert "resuming" not in again.output


def test_overrides_are_noted_in_the_kept_description(write_recipe):
    path = write_recipe(tiny_recipe(description="tiny FedAvg"))
    recipe = load_recipe(path, ["federation.rounds=3", "seed=2"])
    assert recipe.description == "tiny FedAvg [--set federation.rounds=3; seed=2]"
    assert load_recipe(path).description == "tiny FedAvg"


def test_the_executor_flag_reaches_the_engine_as_a_value(tmp_path, write_recipe, monkeypatch):
    """``--executor`` is handed to the engine, not turned into ``engine.executor=...`` text:
    the run's kept recipe records the executor it ran on, its description notes only what
    ``--set`` said, and the name is looked up in the registry once; a misspelt one is
    refused by key before anything is left behind."""
    from fedkit.core import runs
    from fedkit.plugin.registry import Registry

    handed, lookups = [], []
    start, get = runs.start, Registry.get

    def spy_start(recipe, out, plugins=None, executor=None):
        handed.append((recipe.engine.executor, executor))
        return start(recipe, out, plugins, executor)

    def spy_get(self, name):
        lookups.append((self.key, name))
        return get(self, name)

    monkeypatch.setattr(runs, "start", spy_start)
    monkeypatch.setattr(Registry, "get", spy_get)
    path = str(write_recipe(tiny_recipe(federation={"rounds": 1}, description="tiny")))
    out = tmp_path / "run"
    args = ["run", path, "--out", str(out), "-q", "--set", "seed=3", "--executor", "isolated"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert handed == [("sequential", "isolated")]  # the file's value; the flag's, apart
    assert lookups.count(("engine.executor", "isolated")) == 1
    kept = load_recipe(out / "recipe.yaml")
    assert kept.engine.executor == "isolated" and kept.description == "tiny [--set seed=3]"
    bad = tmp_path / "bad"
    refused = runner.invoke(app, ["run", path, "--out", str(bad), "--executor", "dask"])
    assert refused.exit_code == 2 and "engine.executor" in refused.output
    assert "Traceback" not in refused.output and not bad.exists()


def test_new_plugin_says_to_install_with_this_environments_python(tmp_path):
    result = runner.invoke(app, ["new-plugin", "myprox", "--dir", str(tmp_path)])
    assert result.exit_code == 0
    assert f"{sys.executable} -m pip install -e" in result.output.replace("\n", "")


def test_validate_shipped_recipe_by_name():
    result = runner.invoke(app, ["validate", "quickstart"])
    assert result.exit_code == 0, result.output
    assert "ok" in result.output


@pytest.mark.parametrize("name", sorted(discover()))
def test_every_installed_plugin_is_documented_and_implements_hooks(name):
    info = describe(discover()[name])
    assert info.summary, f"{name} needs a docstring"
    assert info.hooks and set(info.hooks) <= set(hook_names())
    sides = info.hooks_by_side()
    assert sorted(sides) == ["client", "registry", "server", "simulation"]
    assert sorted(sum(sides.values(), [])) == sorted(info.hooks)
    assert all(hook_side(h) == side for side, hooks in sides.items() for h in hooks)


THIRD_PARTY = '''
"""A third-party fedkit plugin: scales every aggregated classifier bias by a factor."""
import torch
from pydantic import BaseModel
from fedkit import hookimpl


class Shrink:
    """Multiplies the aggregated classifier bias by ``factor``."""

    class Options(BaseModel):
        factor: float = 0.5

    def __init__(self, options):
        self.factor = options.factor

    @hookimpl
    def aggregate(self, server, cluster, uploads):
        mean = sum(u.tensors["classifier.bias"] * u.weight for u in uploads)
        mean = mean / sum(u.weight for u in uploads)
        return {"classifier.bias": mean * self.factor}

    @hookimpl
    def round_end(self, server):
        server.log(shrink_factor=self.factor)
'''


def install_fake_package(root):
    """A minimal installed distribution: a module plus dist-info with an entry point."""
    (root / "shrink_plugin.py").write_text(textwrap.dedent(THIRD_PARTY))
    info = root / "shrink_plugin-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shrink-plugin\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text("[fedkit]\nshrink = shrink_plugin:Shrink\n")


def test_third_party_plugin_is_listed_and_usable(tmp_path, write_recipe, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    install_fake_package(site)
    monkeypatch.syspath_prepend(str(site))  # as an installed distribution on sys.path is seen
    monkeypatch.setattr(fedkit.cli.app.console, "width", 200)
    listed = CliRunner().invoke(app, ["plugins"])
    assert listed.exit_code == 0, listed.output
    line = next(ln for ln in listed.output.splitlines() if "shrink" in ln)
    assert "shrink-plugin 1.2.3" in line and "aggregate" in line

    recipe = write_recipe(
        tiny_recipe(plugins=["fedavg", {"shrink": {"factor": 0.25}}], federation={"rounds": 1})
    )
    out = tmp_path / "out"
    ran = CliRunner().invoke(app, ["run", str(recipe), "--out", str(out)])
    assert ran.exit_code == 0, ran.output
    assert '"shrink_factor": 0.25' in (out / "metrics.jsonl").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_a_misspelt_set_key_is_answered_without_loading_torch(command, tmp_path):
    args = ["--set", "federation.roundz=2"]
    if command == "sweep":
        args += ["--set", "seed=0,1", "--out", str(tmp_path / "s")]
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fedkit", command, "quickstart", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert 'did you mean "rounds"' in proc.stderr and "Traceback" not in proc.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert "fedkit.cli.app" in imported and not any(m.startswith("torch") for m in imported)


def test_log_format_jsonl_prints_one_json_object_per_line(tmp_path, write_recipe):
    out = tmp_path / "run"
    result = runner.invoke(
        app, ["run", str(write_recipe(tiny_recipe())), "--out", str(out), "--log-format", "jsonl"]
    )
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.output.splitlines()]
    assert [e["event"] for e in events] == ["start", "round", "round", "end"]
    rows = logs.read_metrics(out)
    for event, row in zip(events[1:3], rows, strict=True):
        assert event["round"] == row["round"] and event["test_accuracy"] == row["test_accuracy"]
    assert events[-1]["run_dir"] == str(out) and events[-1]["final"] == rows[-1]
    bad = runner.invoke(app, ["run", "quickstart", "--log-format", "xml"])
    assert bad.exit_code == 2 and "rich or jsonl" in bad.output


def test_the_plugins_listing_is_cached_until_a_plugin_changes(tmp_path, monkeypatch):
    from fedkit.cli import plugin_cache
    from fedkit.plugin.entrypoints import discover as installed

    monkeypatch.setenv("FEDKIT_CACHE_DIR", str(tmp_path))
    first = runner.invoke(app, ["plugins"])
    assert first.exit_code == 0 and plugin_cache.cache_file().is_file()
    saved = json.loads(plugin_cache.cache_file().read_text())
    saved["rows"] = [["cached-row", "", "", "", "", "", ""]]
    plugin_cache.cache_file().write_text(json.dumps(saved))
    assert "cached-row" in runner.invoke(app, ["plugins"]).output  # used, not recomputed
    assert "cached-row" not in runner.invoke(app, ["plugins", "--check"]).output
    saved["key"][1][-1] = [0, 0]  # a plugin file of another size and time
    plugin_cache.cache_file().write_text(json.dumps(saved))
    again = runner.invoke(app, ["plugins"]).output
    assert "cached-row" not in again and "fedavg" in again
    assert plugin_cache.key(installed()) == json.loads(plugin_cache.cache_file().read_text())["key"]


@pytest.mark.slow
def test_a_cached_plugins_listing_imports_no_torch(tmp_path):
    env = {**__import__("os").environ, "FEDKIT_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-X", "importtime", "-m", "fedkit", "plugins"]
    subprocess.run(cmd, env=env, capture_output=True, check=True)  # fills the cache
    imports = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stderr
    assert " torch\n" not in imports and "timm" not in imports

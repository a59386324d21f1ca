"""Malformed recipes: each gives a clear error, exit code 2, no traceback."""

from __future__ import annotations

import pytest
from conftest import tiny_recipe
from typer.testing import CliRunner

from fedkit.cli import app
from fedkit.recipe import apply_overrides, load_recipe

runner = CliRunner()

CASES = {
    "empty": ("", ["(top level)", "an empty file"]),
    "not_yaml": ("seed: [1, 2\nplugins: x", ["valid YAML", "line"]),
    "not_mapping": ("- just\n- a list\n", ["a mapping of recipe sections"]),
    "misspelt_key": (
        tiny_recipe(federaton={"rounds": 2}),
        ["federaton", 'did you mean "federation"'],
    ),
    "misspelt_nested": (
        tiny_recipe(federation={"round": 2}),
        ["federation.round", 'did you mean "rounds"'],
    ),
    "unknown_key": (tiny_recipe(colour="blue"), ["colour", "unknown key"]),
    "wrong_type": (tiny_recipe(federation={"rounds": "many"}), ["federation.rounds", "integer"]),
    "zero_rounds": (tiny_recipe(federation={"rounds": 0}), ["federation.rounds", "greater than 0"]),
    "negative_clients": (tiny_recipe(data={"num_clients": -3}), ["data.num_clients", "-3"]),
    "unknown_plugin": (tiny_recipe(plugins=["fedavgg"]), ["plugins.0", 'did you mean "fedavg"']),
    "bad_plugin_option": (
        tiny_recipe(plugins=[{"fedavg": {"speed": 1}}]),
        ["plugins.0.fedavg.speed"],
    ),
    "unknown_model": (
        tiny_recipe(backbone={"name": "resnet_18"}),
        ["backbone.name", 'did you mean "resnet18"'],
    ),
    "unknown_partitioner": (
        tiny_recipe(data={"partition": {"name": "dirichlett", "alpha": 0.5}}),
        ["data.partition.name", 'did you mean "dirichlet"'],
    ),
    "bad_partition_param": (
        tiny_recipe(data={"partition": {"name": "dirichlet", "alpah": 0.5}}),
        ["data.partition.alpah"],
    ),
    "missing_root": (
        tiny_recipe(data={"dataset": "cifar10", "root": "/nonexistent/cifar"}),
        ["data.root", "/nonexistent/cifar"],
    ),
    "no_root": (tiny_recipe(data={"dataset": "cifar10"}), ["data.root"]),
    "unknown_dataset": (
        tiny_recipe(data={"dataset": "cifar11"}),
        ["data.dataset", 'did you mean "cifar10"'],
    ),
    "too_many_per_round": (
        tiny_recipe(federation={"clients_per_round": 5}),
        ["federation.clients_per_round", "at most data.num_clients (3)"],
    ),
    "bad_device": (tiny_recipe(device="tpu"), ["device"]),
}


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_recipe_exits_2_with_clear_message(case, command, write_recipe, tmp_path):
    content, needles = CASES[case]
    path = write_recipe(content)
    args = [command, str(path)] + (["--out", str(tmp_path / "run")] if command == "run" else [])
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert str(path) in result.output
    for needle in needles:
        assert needle in result.output, result.output
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_missing_recipe_file_suggests_shipped_name():
    result = runner.invoke(app, ["validate", "quickstrat"])
    assert result.exit_code == 2
    assert 'did you mean "quickstart"' in result.output


def test_overrides_are_validated(write_recipe):
    path = write_recipe(tiny_recipe())
    recipe = load_recipe(
        path, ["federation.rounds=7", "plugins.0=fedavg", "data.partition.alpha=0.1"]
    )
    assert recipe.federation.rounds == 7
    assert recipe.data.partition.params == {"alpha": 0.1}
    result = runner.invoke(app, ["validate", str(path), "--set", "federation.rounds=-1"])
    assert result.exit_code == 2 and "federation.rounds" in result.output


def test_override_list_index_out_of_range():
    raw = {"plugins": ["fedavg"]}
    with pytest.raises(Exception, match="plugins.3"):
        apply_overrides(raw, ["plugins.3=x"])


def test_plugin_shorthand_forms(write_recipe):
    recipe = load_recipe(write_recipe(tiny_recipe(plugins=["fedavg", {"x": {"a": 1}}])))
    assert [p.name for p in recipe.plugins] == ["fedavg", "x"]
    assert recipe.plugins[1].options == {"a": 1}

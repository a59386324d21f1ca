"""Malformed recipes: each gives a clear error, exit code 2, no traceback."""

from __future__ import annotations

import pytest
from conftest import tiny_recipe
from typer.testing import CliRunner

from fedkit.cli.app import app
from fedkit.config.schema import apply_overrides, load_recipe

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
    "binary_file": (bytes(range(256)) * 4, ["(file)", "a text (YAML) file", "binary data"]),
    "tab_indent": ("seed: 0\nfederation:\n\trounds: 2\n", ["valid YAML"]),
    "image_size_one": (
        tiny_recipe(backbone={"name": "test_convnext"}, data={"image_size": 1}),
        ["data.image_size", "a size backbone test_convnext can take", "at 1×1"],
    ),
    "faults_over_one": (
        tiny_recipe(faults={"exception": 0.7, "nan": 0.6}),
        ["faults", "at most 1"],
    ),
    "fault_probability": (tiny_recipe(faults={"dropout": 1.5}), ["faults.dropout"]),
    "unknown_executor": (tiny_recipe(engine={"executor": "dask"}), ["engine.executor", "ray"]),
    "unknown_store": (tiny_recipe(engine={"store": "cloud"}), ["engine.store", "disk"]),
    "keep_zero_checkpoints": (
        tiny_recipe(engine={"keep_checkpoints": 0}),
        ["engine.keep_checkpoints"],
    ),
    "zero_min_clients": (tiny_recipe(federation={"min_clients": 0}), ["federation.min_clients"]),
    "negative_timeout": (
        tiny_recipe(federation={"client_timeout": -1}),
        ["federation.client_timeout"],
    ),
    "negative_lr": (
        tiny_recipe(federation={"optimizer": {"name": "sgd", "lr": -0.1}}),
        ["federation.optimizer.lr"],
    ),
    "unknown_optimizer": (
        tiny_recipe(federation={"optimizer": {"name": "rmsprop"}}),
        ["federation.optimizer.name", "adam"],
    ),
    "unknown_schedule": (
        tiny_recipe(federation={"lr_schedule": "step"}),
        ["federation.lr_schedule", "cosine"],
    ),
    "unknown_protocol": (tiny_recipe(evaluation={"protocol": "svm"}), ["evaluation.protocol"]),
    "empty_semi_fractions": (
        tiny_recipe(evaluation={"semi_fractions": []}),
        ["evaluation.semi_fractions", "non-empty"],
    ),
    "plugin_option_type": (
        tiny_recipe(plugins=["fedsimsiam", {"dapu": {"mu": "high"}}]),
        ["plugins.1.dapu.mu", "high"],
    ),
    "misspelt_core_option": (
        tiny_recipe(plugins=["fedavg", {"fedprox": {"mue": 0.1}}]),
        ["plugins.1.fedprox.mue", 'did you mean "mu"'],
    ),
    "two_models": (
        tiny_recipe(plugins=["fedbyol", "fedsimsiam"]),
        ["plugins", "'fedbyol' answers it first", "'fedsimsiam'", "init_models"],
    ),
    "fedavg_then_byol": (
        tiny_recipe(plugins=["fedavg", "fedbyol"]),
        ["'fedavg' answers it first", "'fedbyol'", "init_models"],
    ),
    "ifca_then_fedu": (
        tiny_recipe(plugins=["ifca", "fedu"]),
        ["'ifca' answers it first", "'fedu'"],
    ),
    "fedu_then_ifca": (
        tiny_recipe(plugins=["fedu", "ifca"]),
        ["'fedu' answers it first", "'ifca'"],
    ),
    "plugins_not_a_list": (tiny_recipe(plugins="fedavg"), ["plugins"]),
    "plugin_twice": (tiny_recipe(plugins=["fedavg", "fedavg"]), ["plugins.1", "each plugin once"]),
    "no_plugins": (tiny_recipe(plugins=[]), ["plugins", "at least one plugin"]),
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


RUN_CASES = {
    "alpha_inf": (
        tiny_recipe(data={"partition": {"name": "dirichlet", "alpha": float("inf")}}),
        ["data.partition.alpha", "a finite number > 0"],
    ),
    "alpha_nan": (
        tiny_recipe(data={"partition": {"name": "dirichlet", "alpha": float("nan")}}),
        ["data.partition.alpha", "a finite number"],
    ),
    "alpha_negative": (
        tiny_recipe(data={"partition": {"name": "dirichlet", "alpha": -1}}),
        ["data.partition.alpha", "-1"],
    ),
    "k_too_big": (
        tiny_recipe(data={"partition": {"name": "classes_per_client", "k": 11}}),
        ["data.partition.k", "at most 10"],
    ),
    "empty_clients": (
        tiny_recipe(
            data={
                "num_clients": 250,
                "max_train": 300,
                "partition": {"name": "dirichlet", "alpha": 0.05, "min_size": 0},
            },
            federation={"clients_per_round": 250},
        ),
        ["federation.clients_per_round", "without training data", "never sampled"],
    ),
    "scaffold_with_adam": (
        tiny_recipe(plugins=["fedavg", "scaffold"]),
        ["federation.optimizer.name", "sgd with scaffold"],
    ),
}


@pytest.mark.parametrize("case", sorted(RUN_CASES))
def test_bad_recipe_found_when_the_run_starts(case, write_recipe, tmp_path):
    """Cases only the data or the plugins' configure can tell (``validate`` loads no data)."""
    content, needles = RUN_CASES[case]
    path = write_recipe(content)
    result = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, result.output
    assert not (tmp_path / "run" / "checkpoints").exists()


SET_CASES = {
    "no_equals": ("federation.rounds", ["--set", "KEY=VALUE"]),
    "unclosed_list": ("federation.rounds=[1,", ["--set", "a YAML value"]),
    "tab": ("federation.rounds=\t3", ["--set", "a YAML value"]),
    "backtick": ("description=`x", ["--set", "a YAML value"]),
    "into_scalar": ("seed.x=1", ["seed", "a section to set keys in"]),
    "bad_index": ("plugins.5=fedavg", ["plugins.5", "a list index below 1"]),
    "then_invalid": ("federation.rounds=zero", ["federation.rounds", "integer"]),
}


@pytest.mark.parametrize("case", sorted(SET_CASES))
def test_bad_set_value_exits_2_with_clear_message(case, write_recipe):
    item, needles = SET_CASES[case]
    path = write_recipe(tiny_recipe())
    result = runner.invoke(app, ["validate", str(path), "--set", item])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, result.output


def test_the_corpus_is_large():
    assert 2 * len(CASES) + len(RUN_CASES) + len(SET_CASES) >= 60

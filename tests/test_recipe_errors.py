"""Malformed recipes: each gives a clear error, exit code 2, no traceback."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import install_plugins, tiny_recipe
from typer.testing import CliRunner

from fedkit.cli.app import app
from fedkit.config.schema import apply_overrides, load_recipe, validate
from fedkit.data import Partition
from fedkit.errors import RecipeError

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
    "async_on_flower": (
        tiny_recipe(engine={"executor": "flower"}, systems={"mode": "async"}),
        ["systems.mode: expected async with a simulation executor"],
    ),
    "clock_with_secure_sums": (
        tiny_recipe(
            engine={"executor": "flower", "secure_aggregation": True}, systems={"deadline": 5}
        ),
        ["engine.secure_aggregation: expected false with the virtual clock", "summed"],
    ),
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
    "mlflow_file_store": (  # MLflow 3 refuses to write its folder store (issue 54)
        tiny_recipe(plugins=["fedavg", {"mlflow": {"tracking_uri": "file:///nowhere/mlruns"}}]),
        ["plugins.1.options.tracking_uri", "'file:///nowhere/mlruns'", "maintenance mode"],
    ),
    "tensorboard_unwritable": (  # /proc: no new files there, whoever asks (issue 54)
        tiny_recipe(plugins=["fedavg", {"tensorboard": {"logdir": "/proc/fedkit-tb"}}]),
        ["plugins.1.options.logdir", "a folder this process can write", "'/proc/fedkit-tb'"],
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


# Partitions, plugins given to the Python API, installed packages whose registry hooks raise

PARTITIONERS = '''
import numpy as np

from fedkit import Partition, hookimpl


def blocks(labels, num_clients):
    return np.array_split(np.arange(len(labels)), num_clients)


def negative(labels, num_clients, rng):
    chunks = blocks(labels, num_clients)
    chunks[1][0] = -1  # numpy would wrap it to the last image
    return Partition(chunks)


def beyond(labels, num_clients, rng):
    chunks = blocks(labels, num_clients)
    chunks[2][-1] = len(labels)
    return Partition(chunks)


def shared(labels, num_clients, rng):
    chunks = blocks(labels, num_clients)
    chunks[1] = np.concatenate([chunks[1], chunks[0][:5]])
    return Partition(chunks)


def short(labels, num_clients, rng):
    return Partition(blocks(labels, num_clients)[:-1])


def floats(labels, num_clients, rng):
    return Partition([c.astype(float) for c in blocks(labels, num_clients)])


def declared(labels, num_clients, rng):
    chunks = blocks(labels, num_clients)
    return Partition([np.concatenate([c, chunks[0][:5]]) for c in chunks])


declared.overlapping = True


class Odd:
    """Partitioners that return what no run should train on."""

    @staticmethod
    @hookimpl
    def register_partitioners(register):
        for fn in (negative, beyond, shared, short, floats, declared):
            register(fn.__name__, fn)
'''

BROKEN = '''
from fedkit import hookimpl


class Broken:
    """Registers a data set, but its hook fails."""

    @staticmethod
    @hookimpl
    def register_datasets(register):
        raise RuntimeError("cannot reach the data server")
'''


@pytest.fixture
def odd_packages(tmp_path, monkeypatch):
    """Two installed packages: odd partitioners, and a registry hook that raises."""
    from fedkit.plugin import registry

    site = install_plugins(
        tmp_path / "site", {"odd": PARTITIONERS, "broken": BROKEN}, dist="fedkit-{name}"
    )
    monkeypatch.syspath_prepend(str(site))
    registry.refresh()
    yield
    registry.refresh()


PARTITION_CASES = {
    "negative": ["'negative'", "client 1 holds index -1"],
    "beyond": ["'beyond'", "client 2 holds index 300", "0..299"],
    "shared": ["'shared'", "clients 0 and 1 both hold image 0", "disjoint"],
    "short": ["'short'", "2 index arrays for data.num_clients=3"],
    "floats": ["'floats'", "client 0's indices", "float64"],
}


@pytest.mark.filterwarnings("ignore::fedkit.plugin.entrypoints.RegistryWarning")
@pytest.mark.parametrize("case", sorted(PARTITION_CASES))
def test_a_bad_partition_is_refused_before_round_1(case, odd_packages, write_recipe, tmp_path):
    path = write_recipe(tiny_recipe(data={"partition": {"name": case}}))
    result = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for needle in ["data.partition.name", *PARTITION_CASES[case]]:
        assert needle in result.output, result.output
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.filterwarnings("ignore::fedkit.plugin.entrypoints.RegistryWarning")
def test_a_partitioner_that_declares_overlap_may_share_images(odd_packages):
    from fedkit.config.schema import validate
    from fedkit.data.partition import check_partition, partition
    from fedkit.plugin.registry import registries

    cfg = validate(tiny_recipe(data={"partition": {"name": "declared"}})).data
    labels = np.zeros(300, np.int64)
    fn = registries().partitioners.get("declared")
    split = partition(labels, cfg, np.random.default_rng(0), fn)
    assert [len(c) for c in split.clients] == [105, 105, 105]
    with pytest.raises(RecipeError, match="'declared': clients 0 and 1 both hold image 0"):
        check_partition("declared", split, 3, 300)  # had it not declared overlap
    with pytest.raises(RecipeError, match="client 2 holds index 300"):
        check_partition("declared", Partition([*split.clients[:2], np.array([300])]), 3, 300, True)


def test_a_raising_registry_hook_breaks_only_what_it_registers(odd_packages, write_recipe):
    from fedkit.core.preflight import check
    from fedkit.plugin.registry import RegistryWarning, registries

    with pytest.warns(RegistryWarning, match=r"'broken' \(package fedkit-broken\)"):
        registries()
    check(validate(tiny_recipe()))  # a recipe that needs nothing from it goes on
    path = write_recipe(tiny_recipe(data={"dataset": "remote"}))
    result = runner.invoke(app, ["validate", str(path), "--no-dry-run"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    for needle in ["data.dataset", "'remote'", "fedkit-broken", "register_datasets"]:
        assert needle in result.output, result.output
    assert "cannot reach the data server" in result.output
    result = runner.invoke(app, ["plugins", "--check"])
    assert result.exit_code == 2, result.output
    assert "'broken' (package fedkit-broken) failed in register_datasets" in result.output


@pytest.mark.parametrize("entry", [5, "fedavg", object, None])
def test_the_python_api_refuses_a_plugin_entry_that_is_no_plugin(entry):
    import fedkit

    raw = tiny_recipe(plugins=["fedavg", "notaplugin"])
    with pytest.raises(RecipeError, match=r"plugins\['notaplugin'\]: expected a plugin"):
        fedkit.run(raw, plugins={"notaplugin": entry})

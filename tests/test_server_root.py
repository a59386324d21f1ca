"""What a submitted run may make a deployment's server read and write
(``fedkit.flower.server_root``): the run directory stays under the operator's
``FEDKIT_SERVER_ROOT``, a recipe travels as YAML text and a path sent in its place is
never opened, and a recipe value that would lead the server outside its folders is
refused, naming the key. No SuperLink: the functions and the ServerApp's ``main`` are
called directly; ``fedkit deploy run`` is checked up to the ``flwr run`` it starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import tiny_recipe
from typer.testing import CliRunner

from fedkit.config.shipped import shipped
from fedkit.errors import FedkitError, RecipeError
from fedkit.flower.server_root import (
    DATA_ENV,
    ROOT_ENV,
    confine,
    new_recipe,
    recipe_mapping,
    run_directory,
    submission,
)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "server"
    folder.mkdir()
    return folder.resolve()


def sent(raw: dict, out: str = "runs/a", overrides: str = "") -> dict[str, str]:
    return {"recipe": yaml.safe_dump(raw), "out": out, "set": overrides}


def test_a_relative_out_lands_under_the_root(root):
    config = sent(tiny_recipe(), out="runs/a")
    got = submission(config, {ROOT_ENV: str(root)})
    assert got.out == root / "runs" / "a"
    assert got.recipe is not None and got.recipe.engine.executor == "flower"
    assert got.clients == 3


@pytest.mark.parametrize("out", ["/tmp/elsewhere", "../x", "runs/../../x", "~/x", ".", "", " "])
def test_an_out_outside_the_root_is_refused_naming_the_key(root, out):
    with pytest.raises(RecipeError) as refused:
        run_directory(out, root)
    message = str(refused.value)
    assert message.startswith("run config: out: expected a relative folder name without '..'")
    assert ROOT_ENV in message


def test_an_out_through_a_symlink_that_leads_out_is_refused(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(RecipeError, match=r"out: expected .* \(it resolves to .*outside/x\)"):
        run_directory("link/x", root)
    assert run_directory("runs/x", root) == root / "runs" / "x"


def test_without_a_root_the_server_refuses_to_start(tmp_path):
    with pytest.raises(FedkitError, match=f"^{ROOT_ENV} is not set in the SuperLink's env"):
        submission(sent(tiny_recipe()), {})
    with pytest.raises(FedkitError, match="expected an existing directory"):
        submission(sent(tiny_recipe()), {ROOT_ENV: str(tmp_path / "missing")})


def test_a_recipe_sent_as_text_is_used(root):
    raw = tiny_recipe(seed=7, federation={"rounds": 4})
    got = submission(sent(raw, overrides="federation.rounds=5"), {ROOT_ENV: str(root)})
    assert got.recipe.seed == 7 and got.recipe.federation.rounds == 5


def test_a_path_is_never_opened(tmp_path, monkeypatch):
    """The path of an existing recipe file is refused; a bare file name that is also a
    shipped recipe's name gives the shipped recipe, not the file beside the server."""
    mine = tmp_path / "mine.yaml"
    mine.write_text(yaml.safe_dump(tiny_recipe(seed=77)))
    with pytest.raises(RecipeError) as refused:
        recipe_mapping(str(mine))
    assert "recipe: expected the recipe's YAML text or the name of a shipped recipe" in str(
        refused.value
    )
    assert "a path is not opened on the server" in str(refused.value)
    (tmp_path / "quickstart.yaml").write_text(yaml.safe_dump(tiny_recipe(seed=77)))
    monkeypatch.chdir(tmp_path)
    got = recipe_mapping("quickstart.yaml")
    assert got == yaml.safe_load(shipped()["quickstart"].read_text())
    assert got.get("seed") != 77


def test_text_that_is_not_a_recipe_is_refused():
    with pytest.raises(RecipeError, match="not valid YAML"):
        recipe_mapping("seed: [1")
    with pytest.raises(RecipeError, match="found '\\[a, b\\]'"):
        recipe_mapping("[a, b]")
    with pytest.raises(RecipeError, match="name of a shipped recipe"):
        recipe_mapping("no-such-recipe")


@pytest.mark.parametrize(
    ("plugin", "key"),
    [
        ({"tensorboard": {"logdir": "/tmp/tb"}}, "plugins.1.options.logdir"),
        ({"tensorboard": {"logdir": "../../../tb"}}, "plugins.1.options.logdir"),
        ({"tensorboard": {"logdir": "~/tb"}}, "plugins.1.options.logdir"),
        ({"mlflow": {"tracking_uri": "sqlite:////var/tmp/m.db"}}, "plugins.1.options.tracking_uri"),
        ({"mlflow": {"tracking_uri": "file:///var/tmp/mlruns"}}, "plugins.1.options.tracking_uri"),
    ],
)
def test_a_plugin_option_that_leads_outside_is_refused(root, plugin, key):
    raw = tiny_recipe(plugins=["fedavg", plugin])
    recipe = new_recipe(raw, [])
    with pytest.raises(RecipeError) as refused:
        confine(recipe, root / "runs" / "a", root, None)
    message = str(refused.value)
    assert message.startswith(f"run config 'recipe': {key}: expected a path inside the server's")
    assert f"(plugin {next(iter(plugin))!r})" in message


def test_paths_inside_the_root_and_network_uris_are_kept(root):
    plugins = [
        "fedavg",
        {"tensorboard": {"logdir": "../tb"}},  # runs/tb: still under the root
        {"mlflow": {"tracking_uri": "http://tracking.example:5000"}},
    ]
    recipe = new_recipe(tiny_recipe(plugins=plugins), [])
    assert confine(recipe, root / "runs" / "a", root, None) == recipe


def test_backbone_kwargs_are_checked_too(root):
    raw = tiny_recipe(backbone={"kwargs": {"pretrained_cfg_overlay": {"file": "/etc/weights"}}})
    with pytest.raises(RecipeError, match="backbone.kwargs.pretrained_cfg_overlay.file"):
        confine(new_recipe(raw, []), root / "a", root, None)


def test_data_root_is_confined_when_the_operator_names_a_data_folder(root, tmp_path):
    data = tmp_path / "data"
    (data / "cifar").mkdir(parents=True)
    raw = tiny_recipe(data={"root": "cifar"})
    got = confine(new_recipe(raw, []), root / "a", root, data.resolve())
    assert got.data.root == str(data.resolve() / "cifar")
    for outside in ("/etc", "../elsewhere"):
        recipe = new_recipe(tiny_recipe(data={"root": outside}), [])
        with pytest.raises(RecipeError, match=f"data.root: expected a folder inside {DATA_ENV}"):
            confine(recipe, root / "a", root, data.resolve())


def test_without_a_data_folder_a_download_is_refused(root):
    recipe = new_recipe(tiny_recipe(data={"root": "/srv/data", "download": True}), [])
    with pytest.raises(RecipeError, match=f"data.download: expected false .* {DATA_ENV}"):
        confine(recipe, root / "a", root, None)
    kept = new_recipe(tiny_recipe(data={"root": "/srv/data"}), [])
    assert confine(kept, root / "a", root, None).data.root == "/srv/data"  # read, as given


def test_the_serverapp_refuses_in_one_line_of_its_log(root, monkeypatch, capsys):
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from fedkit.flower import serverapp

    class NoGrid:
        def get_node_ids(self):
            raise AssertionError("a refused run must not wait for nodes")

    monkeypatch.setenv(ROOT_ENV, str(root))
    config = sent(tiny_recipe(), out="/tmp/fedkit-elsewhere")
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    with pytest.raises(RecipeError):
        serverapp.main(NoGrid(), context)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "fedkit: refused the run: run config: out: expected a relative folder name without "
        f"'..' (the run directory, under {ROOT_ENV} on the server), found '/tmp/fedkit-elsewhere'"
    ]
    assert not list(root.iterdir())


def test_deploy_run_sends_the_recipe_text_and_a_relative_out(tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    from flwr.common.config import parse_config_args

    from fedkit.cli import deploy

    path = tmp_path / "recipe.yaml"
    path.write_text("# my recipe\n" + yaml.safe_dump(tiny_recipe(description='say "hi"')))
    calls = []

    def flwr_run(command, env, seen):
        config = Path(command[command.index("--run-config") + 1])
        calls.append((command, parse_config_args([str(config)])))
        seen.run_id = 1

    monkeypatch.setattr(deploy, "follow", flwr_run)  # tests/test_deploy_cli.py runs the rest
    monkeypatch.setattr(
        deploy, "final_status", lambda seen, env: deploy.RunStatus("finished:completed")
    )
    args = ["run", str(path), "--superlink", "127.0.0.1:1", "--insecure", "--out", "runs/a"]
    done = CliRunner().invoke(deploy.app, [*args, "--set", "seed=3"])
    assert done.exit_code == 0, done.output
    ((command, values),) = calls
    assert values == {"recipe": path.read_text(), "out": "runs/a", "set": "seed=3"}
    assert str(path) not in " ".join(command)

    for bad in ("/abs/run", "../up"):
        refused = CliRunner().invoke(deploy.app, [*args[:-1], bad])
        assert refused.exit_code == 2 and "relative folder name" in refused.output
    missing = CliRunner().invoke(deploy.app, ["run", str(tmp_path / "nope.yaml"), *args[2:]])
    assert missing.exit_code == 2 and "recipe" in missing.output
    assert len(calls) == 1

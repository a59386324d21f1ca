"""A plugin author's mistakes, each reported in one line with exit code 2 and no
traceback: a misspelt hook, a hook method without @hookimpl, @hookimpl on something that
is no hook, a wrong signature, an entry point that cannot be imported (the others are
still listed), a hook shadowed by recipe order, key-claim conflicts found by validate's
dry round, and a tensor of the wrong shape from aggregate, named at the hook."""

from __future__ import annotations

import pytest
from conftest import install_plugins, tiny_recipe
from typer.testing import CliRunner

import fedkit.cli.app
from fedkit.cli.app import app

PLUGINS = {
    "misspelt": """
        from fedkit import hookimpl
        from fedkit.training import supervised_objective

        class Misspelt:
            def local_objectve(self, ctx, model):
                return supervised_objective(ctx, model)
    """,
    "unmarked": """
        class Unmarked:
            def round_end(self, server):
                server.log(x=1)
    """,
    "nohook": """
        from fedkit import hookimpl

        class NoHook:
            @hookimpl
            def round_ends(self, server):
                server.log(x=1)
    """,
    "signature": """
        from fedkit import hookimpl

        class Signature:
            @hookimpl
            def round_end(self, server, client):
                server.log(x=1)
    """,
    "broken": """
        import a_module_that_does_not_exist

        class Broken:
            pass
    """,
    "keepbias": """
        from fedkit import hookimpl

        class KeepBias:
            @hookimpl
            def update_client(self, ctx, received, local):
                return {"classifier.bias": local["classifier.bias"]}

            @hookimpl
            def kept_keys(self, server, model):
                return ["classifier.bias"]
    """,
    "alsobias": """
        from fedkit import hookimpl

        class AlsoBias:
            @hookimpl
            def update_client(self, ctx, received, local):
                return {"classifier.bias": received["classifier.bias"]}

            @hookimpl
            def kept_keys(self, server, model):
                return []
    """,
    "badshape": """
        import torch
        from fedkit import hookimpl

        class BadShape:
            @hookimpl
            def aggregate(self, server, cluster, uploads):
                return {"classifier.bias": torch.zeros(3)}
    """,
    "mytrainer": """
        from fedkit import hookimpl
        from fedkit.training import supervised_objective

        class MyTrainer:
            @hookimpl
            def local_objective(self, ctx, model):
                return supervised_objective(ctx, model)
    """,
}


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Every plugin above as its own installed distribution (module + dist-info)."""
    root = install_plugins(tmp_path / "site", PLUGINS, dist="{name}-plugin")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(fedkit.cli.app.console, "width", 250)
    return root


def invoke(*args):
    result = CliRunner().invoke(app, list(args))
    assert "Traceback" not in result.output, result.output
    return result


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize(
    "plugin,message",
    [
        (
            "misspelt",
            "'local_objectve' looks like a misspelt hook (did you mean \"local_objective\"?)",
        ),
        ("unmarked", "'round_end' is named like a hook but not marked @hookimpl"),
        (
            "nohook",
            "'round_ends' is marked @hookimpl but there is no such hook "
            '(did you mean "round_end"?)',
        ),
        ("signature", "hook 'round_end' asks for argument 'client', which it does not get"),
    ],
)
def test_authoring_mistakes_are_one_line_each(installed, write_recipe, plugin, message):
    check = invoke("plugins", "--check")
    assert check.exit_code == 2 and f"{plugin}: {message}" in one_line(check.output)
    recipe = write_recipe(tiny_recipe(plugins=["fedavg", plugin]))
    for command in ("validate", "run"):
        result = invoke(command, str(recipe))
        assert result.exit_code == 2 and message in one_line(result.output), result.output


def test_a_broken_entry_point_is_listed_and_the_rest_still_work(installed, write_recipe):
    listing = invoke("plugins")
    assert listing.exit_code == 0
    text = one_line(listing.output)
    assert "broken" in text and "fedavg" in text and "mytrainer" in text
    check = invoke("plugins", "--check")
    assert check.exit_code == 2
    assert "broken: cannot be imported (broken_plugin:Broken): ModuleNotFoundError" in one_line(
        check.output
    )
    result = invoke("validate", str(write_recipe(tiny_recipe(plugins=["fedavg", "broken"]))))
    assert result.exit_code == 2 and "'broken' fails to import" in one_line(result.output)


def test_a_hook_shadowed_by_recipe_order_is_refused(installed, write_recipe):
    result = invoke("validate", str(write_recipe(tiny_recipe(plugins=["fedavg", "mytrainer"]))))
    assert result.exit_code == 2
    assert (
        "'fedavg' answers it first, so 'mytrainer''s local_objective would never run"
        in one_line(result.output)
    )


def test_key_claim_conflicts_are_found_before_training(installed, write_recipe):
    recipe = write_recipe(tiny_recipe(plugins=["fedavg", "keepbias", "alsobias"]))
    result = invoke("validate", str(recipe))
    assert result.exit_code == 2
    assert (
        "'keepbias' and 'alsobias' both claim key 'classifier.bias' in hook 'update_client'"
        in one_line(result.output)
    )
    assert invoke("validate", str(recipe), "--no-dry-run").exit_code == 0


def test_a_wrong_shape_from_aggregate_names_the_plugin_and_key(installed, write_recipe, tmp_path):
    recipe = write_recipe(tiny_recipe(plugins=["fedavg", "badshape"]))
    expected = (
        "plugin 'badshape' returned key 'classifier.bias' from hook 'aggregate' as (3,) "
        "torch.float32, but the key is (10,) torch.float32"
    )
    validated = invoke("validate", str(recipe))
    assert validated.exit_code == 2 and expected in one_line(validated.output)
    ran = invoke("run", str(recipe), "--out", str(tmp_path / "run"))
    assert ran.exit_code == 2 and expected in one_line(ran.output)

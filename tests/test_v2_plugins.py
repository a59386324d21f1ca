"""Contract v2 has ended (decision 0020): a plugin written for it gets one line, exit code
2 and no traceback, naming the plugin, the hook or attribute and the row of decision
0012's migration table that says what to write instead. Nothing of the v2 shim is left:
no import finder, no module generated with ``exec``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from conftest import install_plugins, tiny_recipe
from typer.testing import CliRunner

import fedkit
from fedkit.cli.app import app
from fedkit.errors import MIGRATION, ContractChanged
from fedkit.testing import run_recipe

V2 = {
    "v2import": """
        from fedkit.client import ClientContext

        class V2Import:
            pass
    """,
    "v2recipe": """
        from fedkit import hookimpl

        class V2Recipe:
            @hookimpl
            def configure(self, recipe, server):
                server.state["seed"] = recipe.seed
    """,
    "v2row": """
        from fedkit import hookimpl

        class V2Row:
            @hookimpl
            def round_end(self, server, metrics):
                metrics["clients_seen"] = len(metrics["clients"])
    """,
    "v2returns": """
        from fedkit import hookimpl

        class V2Returns:
            @hookimpl
            def after_local_train(self, ctx, model, before):
                return {"norm": 1.5}
    """,
    "v2none": """
        from fedkit import hookimpl

        class V2None:
            @hookimpl
            def upload_selection(self, ctx, local, model):
                return {"classifier.bias": None}
    """,
    "v2data": """
        from fedkit import hookimpl

        class V2Data:
            @hookimpl
            def round_end(self, server):
                server.log(classes_seen=server.data.num_classes)
    """,
    "v2ditto": """
        import torch
        from fedkit import Objective, hookimpl, supervised_objective

        class V2Ditto:
            @hookimpl
            def local_train(self, ctx, model):
                base = supervised_objective(ctx, model)
                reg = torch.zeros(())
                ctx.fit(model, Objective(lambda m, b: base.loss(m, b) + reg, base.batches))
                return True
    """,
    "v2objective": """
        from fedkit import hookimpl, supervised_objective
        from fedkit_plugins.fedavg import FedAvg

        class V2Objective(FedAvg):
            @hookimpl
            def local_objective(self, ctx, model):
                objective = supervised_objective(ctx, model)
                base = objective.loss
                objective.loss = lambda m, b: base(m, b) * 2
                return objective
    """,
    "v2prox": """
        from fedkit import hookimpl, supervised_objective
        from fedkit_plugins.fedavg import FedAvg

        class V2Prox(FedAvg):
            @hookimpl
            def local_objective(self, ctx, model):
                objective = supervised_objective(ctx, model)
                base = objective.loss
                objective.loss = lambda m, b: base(m, b) + 0.0
                return objective
    """,
}
"""Outside v2 plugins, one per habit contract v3 changed."""

CASES = [
    ("v2import", "No module named 'fedkit.client'", "M1-M12"),
    ("v2recipe", "hook 'configure' asks for argument 'recipe'", "M14"),
    ("v2row", "hook 'round_end' asks for argument 'metrics'", "M17"),
    ("v2returns", "plugin 'v2returns', hook 'after_local_train' returned dict", "M20"),
    (
        "v2none",
        "plugin 'v2none', hook 'upload_selection' claimed 'classifier.bias' with None",
        "M21",
    ),
    ("v2data", "plugin 'v2data', hook 'round_end' reads Server.data", "M22-M24"),
    ("v2ditto", "plugin 'v2ditto', hook 'local_train' (TypeError: can only concatenate", "M30"),
    ("v2objective", "plugin 'v2objective', hook 'local_objective' (its loss returned", "M30"),
    ("v2prox", "plugin 'v2prox', hook 'local_objective' (TypeError: ", "M30"),
]
"""Each v2 plugin, what its error says, and the migration table's row it cites."""


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every v2 plugin above as its own installed distribution (module + dist-info)."""
    root = install_plugins(tmp_path / "site", V2)
    monkeypatch.syspath_prepend(str(root))
    return root


@pytest.mark.parametrize("plugin,message,row", CASES, ids=[c[0] for c in CASES])
def test_a_v2_plugin_gets_one_line_naming_it_the_hook_and_the_table_row(
    installed, write_recipe, tmp_path, plugin, message, row
):
    plugins = [plugin] if plugin in ("v2objective", "v2prox") else ["fedavg", plugin]  # FedAvgs
    recipe = write_recipe(tiny_recipe(plugins=plugins, federation={"rounds": 1}))
    result = CliRunner().invoke(app, ["run", str(recipe), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    error = " ".join(result.output[result.output.index("error:") :].split())
    assert plugin in error and message in error, result.output
    assert error.count("migration table row") == 1, error
    assert f"migration table row {row}, {MIGRATION})" in error, error


def test_a_wrapped_v2_loss_stops_the_run_instead_of_failing_each_client(installed):
    with pytest.raises(ContractChanged, match="can only concatenate tuple.*row M30"):
        run_recipe(tiny_recipe(plugins=["fedavg", "v2ditto"]), rounds=1)


def test_no_module_of_fedkit_generates_code_with_exec():
    root = Path(fedkit.__file__).parent
    users = [p for p in root.rglob("*.py") if re.search(r"\bexec\(", p.read_text())]
    assert users == []


def test_importing_fedkit_installs_no_import_finder():
    assert [f for f in sys.meta_path if type(f).__module__.startswith("fedkit")] == []
    with pytest.raises(ModuleNotFoundError):
        __import__("fedkit.client")

"""``fedkit new-plugin NAME``: an installable plugin package whose test passes as
generated — the place to start a method from.

The package registers one plugin through the ``fedkit`` entry-point group, exactly as
the built-in ones are: a class with ``Options`` and one hook (a proximal term, the
smallest useful method), a recipe that uses it, a README and tests written with
``fedkit.testing``.
"""

from __future__ import annotations

import importlib.util
import keyword
import os
import re
import shutil
import sys
import tempfile
from importlib.metadata import entry_points, version
from pathlib import Path

from fedkit.errors import FedkitError
from fedkit.plugin.entrypoints import DISTRIBUTION
from fedkit.rundir.atomic import DIR_MODE

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "fedkit-{name}"
version = "0.1.0"
description = "The {name} plugin for fedkit."
requires-python = ">=3.10"
dependencies = ["{distribution}>={fedkit}"]

[project.entry-points.fedkit]
{name} = "{module}.plugin:{cls}"

[tool.setuptools]
packages = ["{module}"]

[tool.pytest.ini_options]
testpaths = ["tests"]
"""

PLUGIN = '''\
"""{cls}: a fedkit plugin.

As generated it is fedkit's own FedProx, renamed: it adds (μ/2)·‖w − w_global‖² to the
local loss of whichever method trains (a client-side ``loss_terms`` hook), logged as
``loss_{name}``. Change it into your method: every hook, with an example, is in fedkit's
docs/plugins.md and docs/hooks.md.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from torch import Tensor, nn

from fedkit import ClientContext, PluginOptions, hookimpl


class {cls}:
    """{cls}: (μ/2)·‖w − w_global‖² added to the local loss at every step."""

    class Options(PluginOptions):
        mu: float = Field(0.01, ge=0.0)

    def __init__(self, options: Options) -> None:
        self.mu = options.mu

    @hookimpl
    def loss_terms(self, ctx: ClientContext, model: nn.Module, batch: Any) -> dict[str, Tensor]:
        w_global = ctx.received
        squares = [
            (w - w_global[name].to(w.device)).pow(2).sum()
            for name, w in model.named_parameters()
            if name in w_global and w.requires_grad
        ]
        return {{"{name}": 0.5 * self.mu * sum(squares)}}
'''

RECIPE = """\
description: FedAvg with the {name} plugin on the embedded digits (no download), about a minute
seed: 0
backbone: {{name: test_resnet}}
data:
  dataset: digits
  image_size: 16
  num_clients: 10
  partition: {{name: classes_per_client, k: 2}}
federation:
  rounds: 10
  clients_per_round: 10
  local_epochs: 2
  optimizer: {{name: sgd, lr: 0.05}}
plugins:
  - fedavg
  - {name}: {{mu: 0.01}}
"""

TEST = '''\
"""The {name} plugin: installed, a no-op at mu 0, a logged term that changes training,
and the same numbers when each client job runs as in a worker process of its own."""

from importlib.metadata import entry_points
from pathlib import Path

from fedkit import load_recipe
from fedkit.testing import assert_same_runs, run_recipe, tiny_recipe

HERE = Path(__file__).resolve().parent.parent


def with_plugin(mu: float) -> dict:
    return tiny_recipe(plugins=["fedavg", {{"{name}": {{"mu": mu}}}}])


def test_the_plugin_is_installed():
    assert "{name}" in entry_points(group="fedkit").names


def test_mu_zero_is_fedavg_bit_for_bit():
    plain, mine = run_recipe(tiny_recipe()), run_recipe(with_plugin(0.0))
    assert_same_runs(plain, mine, ignore=["train_loss_{name}"])


def test_the_term_is_logged_and_changes_training():
    plain, mine = run_recipe(tiny_recipe()), run_recipe(with_plugin(1.0))
    assert mine.rows[-1]["train_loss_{name}"] > 0
    key = "classifier.weight"
    assert not (plain.pool[0][key] == mine.pool[0][key]).all()


def test_the_plugin_keeps_nothing_across_the_sides():
    # the isolated executor rebuilds the client-side plugin for every job and pickles
    # everything that crosses: a plugin that passes state through ``self`` differs here
    here = run_recipe(with_plugin(1.0))
    isolated = run_recipe(with_plugin(1.0), overrides=["engine.executor=isolated"])
    assert_same_runs(here, isolated)


def test_the_recipe_validates():
    recipe = load_recipe(HERE / "recipes" / "{name}.yaml")
    assert [p.name for p in recipe.plugins] == ["fedavg", "{name}"]
'''

README = """\
# fedkit-{name}

The `{name}` plugin for fedkit: a federated-learning
method written against fedkit's public hooks. As generated it adds a proximal term to
the local loss of whichever method trains; make it yours in `{module}/plugin.py`.

```bash
pip install -e .                      # registers the plugin (entry point `{name}`)
fedkit plugins                        # lists it, with its hooks
fedkit run recipes/{name}.yaml        # FedAvg + {name} on the embedded digits
pytest                                # the tests in tests/, with fedkit.testing
```

Options (`plugins: [fedavg, {{{name}: {{mu: 0.01}}}}]`): `mu`, the term's factor μ.
"""


def module_name(name: str) -> str:
    """A plugin name usable as an entry-point name and a Python package name that
    nothing installed already answers to: not an installed fedkit plugin (the built-in
    one would win or lose silently), not ``fedkit`` and not a module Python already
    finds (the standard library's ``json``, an installed ``torch``)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise FedkitError(
            f"{name!r} cannot name a plugin: use lowercase letters, digits and underscores, "
            "starting with a letter (for example `myprox`)"
        )
    plugins = {ep.name: ep.value for ep in entry_points(group="fedkit")}
    if name in plugins:
        raise FedkitError(
            f"{name!r} is already an installed fedkit plugin ({plugins[name]}); "
            "choose another name (for example `my_" + name + "`)"
        )
    taken = name in sys.stdlib_module_names or name.startswith("fedkit")
    if taken or importlib.util.find_spec(name) is not None:
        raise FedkitError(
            f"{name!r} is already a Python module here (the standard library's, or an installed "
            "package's), so the plugin's package could not be imported under it; choose "
            "another name (for example `my_" + name + "`)"
        )
    return name


def create(name: str, parent: Path) -> Path:
    """Write the package ``parent/name`` and return its folder."""
    module = module_name(name)
    root = parent / name
    if root.exists():
        raise FedkitError(f"{root} already exists; choose another name or folder")
    cls = "".join(part.capitalize() for part in name.split("_"))
    values = {
        "name": name,
        "module": module,
        "cls": cls,
        "fedkit": version(DISTRIBUTION),
        "distribution": DISTRIBUTION,
    }
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        f"{module}/__init__.py": '"""The {name} fedkit plugin."""\n',
        f"{module}/plugin.py": PLUGIN,
        f"recipes/{name}.yaml": RECIPE,
        f"tests/test_{name}.py": TEST,
    }
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=parent))
    try:  # built aside and renamed whole: a full disk leaves nothing behind
        for relative, template in files.items():
            path = staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(template.format(**values))
        os.chmod(staging, DIR_MODE)
        staging.rename(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return root

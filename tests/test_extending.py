"""One way to extend: an outside package adds a data set and a partitioner exactly as it
adds a method, through the ``fedkit`` entry-point group. The package is built in a
temporary directory (a module and its ``.dist-info``, as ``pip install`` leaves them),
``fedkit plugins`` lists what it registers, and a recipe uses both."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedkit.cli.app import app
from fedkit.errors import FedkitError
from fedkit.plugin import registry
from fedkit.testing import run_recipe, tiny_recipe

MODULE = '''
"""Stripes: a generated data set of horizontal and vertical stripes, and a partitioner
that deals clients their images round-robin."""
import numpy as np
import torch

from fedkit import hookimpl
from fedkit.data import Partition, RawImages


def load_stripes(cfg, split, limit):
    rng = np.random.default_rng(0 if split == "train" else 1)
    n = 240 if split == "train" else 60
    labels = rng.integers(0, 2, size=n)
    images = np.zeros((n, 8, 8), dtype=np.uint8)
    for i, label in enumerate(labels):
        offset = rng.integers(0, 2)
        if label == 0:
            images[i, offset::2, :] = 255
        else:
            images[i, :, offset::2] = 255
    return RawImages(torch.from_numpy(images), torch.from_numpy(labels), ["rows", "columns"])


def round_robin(labels, num_clients, rng, start=0):
    order = np.arange(len(labels))
    return Partition([order[(start + c) % num_clients :: num_clients] for c in range(num_clients)])


@hookimpl
def register_datasets(register):
    register("stripes", load_stripes, needs_root=False)


@hookimpl
def register_partitioners(register):
    register("round_robin", round_robin)
'''


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The package ``fedkit-stripes`` in ``tmp_path``, on the path like an installed one."""
    (tmp_path / "fedkit_stripes.py").write_text(textwrap.dedent(MODULE))
    info = tmp_path / "fedkit_stripes-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedkit-stripes\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedkit]\nstripes = fedkit_stripes\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.refresh()
    yield tmp_path
    registry.refresh()


@pytest.mark.slow
def test_fedkit_plugins_lists_what_an_outside_package_registers(installed: Path):
    result = CliRunner().invoke(app, ["plugins"])
    assert result.exit_code == 0, result.output
    # and from a fresh process, as a user would see it, wide enough for one line a row
    env = {**os.environ, "PYTHONPATH": str(installed), "COLUMNS": "400"}
    out = subprocess.run(
        [sys.executable, "-m", "fedkit", "plugins"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("│ stripes "))
    assert "fedkit-stripes 0.1" in row
    assert "dataset stripes" in row and "partitioner round_robin" in row


def test_a_recipe_uses_an_outside_data_set_and_partitioner(installed: Path):
    raw = tiny_recipe(
        data={"dataset": "stripes", "image_size": 8, "max_train": None, "num_clients": 3,
              "partition": {"name": "round_robin", "start": 1}, "local_test_size": 10},
        federation={"rounds": 3},
    )  # fmt: skip
    result = run_recipe(raw)
    data = result.run.data
    assert data.train.classes == ["rows", "columns"] and len(data.train) == 240
    assert [len(c) for c in data.clients] == [80, 80, 80]
    assert data.clients[0][0] == 1  # start=1: client 0 is dealt image 1 first
    assert result.rows[-1]["test_accuracy"] > 0.9  # stripes are easy to tell apart
    assert registry.registries().datasets.entries["stripes"].plugin == "stripes"


def test_a_name_two_plugins_register_is_an_error_naming_both(installed: Path):
    class Again:
        @staticmethod
        def register_datasets(register):
            register("stripes", lambda cfg, split, limit: None, needs_root=False)

    from fedkit import hookimpl

    Again.register_datasets = staticmethod(hookimpl(Again.register_datasets))
    loaded = registry.loaded_plugins(registry.discover())
    with pytest.raises(FedkitError, match="'again' and 'stripes'|'stripes' and 'again'"):
        registry.collect({**loaded, "again": Again})


def test_a_registry_hook_in_a_class_must_be_a_staticmethod():
    from fedkit import hookimpl

    class Method:
        @hookimpl
        def register_partitioners(self, register):
            pass

    with pytest.raises(FedkitError, match="must be a @staticmethod"):
        registry.collect({"method": Method})

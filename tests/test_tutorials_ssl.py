"""Executes the SSL tutorials' commands, shrunk to tiny settings.

Convention: every line of a ```bash block that starts with ``fedkit`` is a command the
tutorial means the reader to run (``\\`` continuations joined). ``$CIFAR10`` stands for the
CIFAR-10 subset; here it points at an empty folder because every ``fedkit run`` gets
``TINY`` appended, which switches to the bundled digits data, one round, small batches.
``fedkit eval`` gets ``TINY_EVAL`` (short probes). Commands run in a temporary directory.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedkit.cli import app

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ["fedu.md", "dapu.md", "fedsimclr.md", "fedbyol-fedsimsiam.md"]
TINY = [
    "data.dataset=digits",
    "data.image_size=16",
    "data.max_train=120",
    "data.max_test=60",
    "data.num_clients=3",
    "federation.clients_per_round=3",
    "federation.rounds=1",
    "federation.local_epochs=1",
    "federation.batch_size=16",
    "backbone.name=test_resnet",
    "backbone.cifar_stem=false",
    "evaluation.linear_epochs=10",
    "evaluation.every=0",
    "device=cpu",
]
TINY_EVAL = ["evaluation.linear_epochs=10", "evaluation.semi_epochs=1", "evaluation.max_eval=60"]


def commands(page: Path) -> list[list[str]]:
    """The ``fedkit`` command lines of a page's ```bash blocks, as argument lists."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = os.path.expandvars(line.strip())
            if line.startswith("fedkit "):
                found.append(shlex.split(line)[1:])
    return found


def shrunk(args: list[str]) -> list[str]:
    extra = {"run": TINY, "eval": TINY_EVAL}.get(args[0], [])
    return [*args, *(x for item in extra for x in ("--set", item))]


@pytest.mark.parametrize("page", TUTORIALS)
def test_tutorial_commands_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CIFAR10", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cmds = commands(ROOT / "docs" / "tutorials" / page)
    assert any(c[0] == "run" for c in cmds), f"{page} has no `fedkit run` command"
    for args in cmds:
        result = CliRunner().invoke(app, shrunk(args))
        assert result.exit_code == 0, f"fedkit {' '.join(args)}\n{result.output}"

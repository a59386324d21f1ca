"""Executes the SSL tutorials' commands, shrunk to tiny settings.

Convention (tests/tutorials.py): the ``fedkit`` lines of ```bash blocks run through the
CLI, shrunk by ``shrunk_ssl`` (tests/conftest.py): every ``fedkit run`` gets settings
appended that switch from CIFAR-10 (never downloaded here) to the bundled digits data,
one round, small batches; ``fedkit eval`` gets short probes. Commands run in a
temporary directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import shrunk_ssl
from tutorials import run_tutorial

from fedkit.rundir.logs import read_clients, read_metrics

pytestmark = pytest.mark.slow  # executes tutorials end to end

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ["fedu.md", "dapu.md", "fedsimclr.md", "fedbyol-fedsimsiam.md"]


@pytest.mark.parametrize("page", TUTORIALS)
def test_tutorial_commands_run(page, tmp_path, monkeypatch):
    done = run_tutorial(ROOT / "docs" / "tutorials" / page, shrunk_ssl, tmp_path, monkeypatch)
    for args, _ in done:
        if args[0] == "run" and any("single_client" in a for a in args):
            # the single-client baseline scores each client's own encoder
            out = Path(args[args.index("--out") + 1])
            final = read_metrics(out)[-1]
            scores = read_clients(out)[-1]["client_linear_accuracy"]  # per-client log
            assert set(scores) == {"0", "1", "2"}
            assert final["personalized_linear_accuracy"] == pytest.approx(sum(scores.values()) / 3)

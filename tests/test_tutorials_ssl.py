"""Executes the SSL tutorials' commands, shrunk to tiny settings.

Convention (tests/tutorials.py): the ``fedkit`` lines of ```bash blocks run through the
CLI. Every ``fedkit run`` gets ``TINY`` appended, which switches from CIFAR-10 (never
downloaded here) to the bundled digits data, one round, small batches. ``fedkit eval``
gets ``TINY_EVAL`` (short probes). Commands run in a temporary directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tutorials import run_tutorial, with_settings

from fedkit.rundir.logs import read_clients, read_metrics

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


def shrunk(args: list[str]) -> list[str]:
    return with_settings(args, {"run": TINY, "validate": TINY, "eval": TINY_EVAL}.get(args[0], []))


@pytest.mark.parametrize("page", TUTORIALS)
def test_tutorial_commands_run(page, tmp_path, monkeypatch):
    done = run_tutorial(ROOT / "docs" / "tutorials" / page, shrunk, tmp_path, monkeypatch)
    for args, _ in done:
        if args[0] == "run" and any("single_client" in a for a in args):
            # the single-client baseline scores each client's own encoder
            out = Path(args[args.index("--out") + 1])
            final = read_metrics(out)[-1]
            scores = read_clients(out)[-1]["client_linear_accuracy"]  # per-client log
            assert set(scores) == {"0", "1", "2"}
            assert final["personalized_linear_accuracy"] == pytest.approx(sum(scores.values()) / 3)

"""Executes the clustered-FL tutorials' commands (docs/tutorials/ifca.md, cpcfl.md) on tiny
settings: bundled digits data at 8×8, 6 clients in the 3-group partition, 2 rounds.

Same convention as the SSL tutorials: each ``fedkit`` line of a ```bash block runs (``\\``
continuations joined), every ``fedkit run`` gets ``TINY`` (and, for CP-CFL and IFCA
(FedAvg), shorter phases) appended. Commands run in a
temporary directory, in order, so later commands can use earlier runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tutorials import run_tutorial, with_settings

from fedkit.rundir.logs import read_clients

pytestmark = pytest.mark.slow  # executes tutorials end to end

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ["ifca.md", "cpcfl.md"]
TINY = [
    "data.dataset=digits",
    "data.image_size=8",
    "data.num_clients=6",
    "data.local_test_size=10",
    "federation.clients_per_round=6",
    "federation.rounds=2",
    "federation.local_epochs=1",
    "backbone.name=test_resnet",
    "device=cpu",
]
PER_RECIPE = {
    "cpcfl": ["plugins.0.cpcfl.switch_round=1", "plugins.0.cpcfl.pretrain.epochs=1"],
    "ifca-fedavg": ["plugins.0.ifca.random_rounds=1"],
}


def shrunk(args: list[str]) -> list[str]:
    if args[0] != "run":
        return args
    extra = list(TINY)
    for prefix, items in PER_RECIPE.items():
        if args[1].startswith(prefix):
            extra += items
    return with_settings(args, extra)


@pytest.mark.parametrize("page", TUTORIALS)
def test_tutorial_commands_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for args, _ in run_tutorial(ROOT / "docs" / "tutorials" / page, shrunk, tmp_path, monkeypatch):
        if args[0] == "run":
            out = Path(args[args.index("--out") + 1])
            assert (out / "metrics.jsonl").is_file()
            assert '"ari"' in (out / "metrics.jsonl").read_text()
            identities = read_clients(out)  # every client is sampled: all 6 placed each round
            assert identities and all(len(r["clusters"]) == 6 for r in identities)

"""docs/tutorials/fedavg.md runs as written (shrunk), and its ledger claim holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from tutorials import TUTORIALS, run_tutorial, with_settings

from fedkit.rundir.logs import read_ledger, read_metrics

pytestmark = pytest.mark.slow  # executes a tutorial end to end

TINY = [
    "data.max_train=300",
    "data.num_clients=4",
    "federation.clients_per_round=4",
    "federation.rounds=2",
    "federation.local_epochs=1",
    "device=cpu",
]


def test_fedavg_tutorial(tmp_path: Path, monkeypatch) -> None:
    def shrink(args: list[str]) -> list[str]:
        fresh_run = args[0] == "run" and "--resume" not in args
        return with_settings(args, TINY if fresh_run else [])

    done = run_tutorial(TUTORIALS / "fedavg.md", shrink, tmp_path, monkeypatch)
    assert [args[0] for args, _ in done] == ["validate", "run", "run"]
    out = tmp_path / "runs" / "quickstart"
    assert [row["round"] for row in read_metrics(out)] == [1, 2]
    rows = read_ledger(out)
    per_client = {}
    for row in rows:
        per_client.setdefault(row["client"], []).append(row["down_model"] + row["up_model"])
    sizes = {sum(v) for v in per_client.values()}
    assert len(sizes) == 1 and sizes.pop() == 2 * 2 * rows[0]["up_model"]

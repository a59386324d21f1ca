"""Executes docs/tutorials/systems.md, shrunk: synchronous FedAvg with a deadline and FedBuff
on the virtual clock, compared by ``fedkit compare --x virtual_time``; the page's Python
snippet reads the failures as the page says."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from tutorials import TUTORIALS, metrics_rows, run_tutorial, runs_shrunk, snippet_output

pytestmark = pytest.mark.slow  # executes a tutorial end to end

PAGE = TUTORIALS / "systems.md"
SMALL = [
    "federation.rounds=2",
    "federation.local_epochs=1",
    "data.max_train=200",
    "data.max_test=100",
    "data.local_test_size=10",
    "evaluation.every=2",
]


def test_systems_tutorial(tmp_path, monkeypatch):
    done = run_tutorial(PAGE, runs_shrunk(SMALL), tmp_path, monkeypatch)
    assert [args[0] for args, _ in done] == ["run", "run", "run", "compare"]
    sync, fedbuff = (
        metrics_rows(tmp_path / "runs" / "sync"),
        metrics_rows(tmp_path / "runs" / "fedbuff"),
    )
    for run in (sync, fedbuff):  # the clock runs on: virtual seconds only go forward
        times = [row["virtual_time"] for row in run]
        assert times == sorted(times) and times[0] > 0
    assert all("staleness" in row for row in fedbuff) and fedbuff[-1]["staleness_max"] >= 1
    assert not any("staleness" in row for row in sync)
    tight = [0.0] + [row["virtual_time"] for row in metrics_rows(tmp_path / "runs" / "sync-10")]
    steps = [b - a for a, b in itertools.pairwise(tight)]
    assert all(0 < step <= 10.0 + 1e-6 for step in steps), steps  # its deadline: 10 s
    # compare lined the runs up by virtual time: a row per target, each run's seconds in it
    output = done[-1][1].stdout
    assert "| test_accuracy ≥ | sync | fedbuff | sync-10 |" in output
    reached = r"not reached \(best [\d.]+\)|[\d.]+ s \(round \d+(, [\d.]+×)?\)"
    for target in ("0.9000", "0.9400"):
        line = next(x for x in output.splitlines() if x.startswith(f"| {target} |"))
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert len(cells) == 4 and all(re.fullmatch(reached, c) for c in cells[1:]), line
    # the page's snippet counts the failures.jsonl kinds of the synchronous run
    printed = snippet_output(PAGE)
    failures = [json.loads(x) for x in (tmp_path / "runs/sync-10/failures.jsonl").open()]
    kinds = {f["error"].split(":")[0] for f in failures}
    assert kinds <= {"deadline", "unavailable"}
    assert printed and printed[0].strip().startswith("{")

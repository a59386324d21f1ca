"""Executes docs/tutorials/robustness.md, shrunk: the attack ruins FedAvg, Multi-Krum stops
it, and the rows name exactly the attackers as flagged; the page's Python snippet reads
them as the page says."""

from __future__ import annotations

import re

import pytest
from tutorials import TUTORIALS, metrics_rows, run_tutorial, runs_shrunk, snippet_output

pytestmark = pytest.mark.slow  # executes a tutorial end to end

PAGE = TUTORIALS / "robustness.md"
RUNS = ("clean", "attacked", "krum")
SMALL = [
    "federation.rounds=1",
    "data.max_train=400",
    "data.max_test=200",
    "data.local_test_size=20",
]


def test_robustness_tutorial(tmp_path, monkeypatch):
    done = run_tutorial(PAGE, runs_shrunk(SMALL), tmp_path, monkeypatch)
    runs = tmp_path / "runs"
    clean, attacked, krum = (metrics_rows(runs / name) for name in RUNS)
    # the attack ruins FedAvg; Multi-Krum keeps it within reach of the clean run
    final = {n: r[-1]["test_accuracy"] for n, r in zip(RUNS, (clean, attacked, krum), strict=True)}
    assert final["attacked"] < 0.2 and final["clean"] > final["attacked"] + 0.3
    assert final["krum"] > final["clean"] - 0.15
    # detection: the three attackers the page names, every round, scored 1.0 both ways
    named = re.search(r"here clients (\d+), (\d+) and (\d+)", PAGE.read_text())
    assert named, "robustness.md: no sentence naming the malicious clients"
    attackers = [int(c) for c in named.groups()]
    for row in krum:
        assert row["defence"] == "krum" and row["flagged"] == attackers
        assert row["detection_precision"] == row["detection_recall"] == 1.0
    assert not any("flagged" in row or "detection_recall" in row for row in clean + attacked)
    # the comparison ran on the three runs
    assert [a[0] for a, _ in done] == ["run", "run", "run", "compare"]
    # the page's snippet prints one line per round of the krum run
    lines = snippet_output(PAGE)
    assert len(lines) == len(krum) and lines[0].split()[2] == "krum"

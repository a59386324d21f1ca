"""Honest time: every session's set-up and round times in ``times.jsonl``, never cut on
resume, and the run's cumulative time in ``summary.json``."""

from __future__ import annotations

import json
import time

import pytest
from conftest import kill_after_checkpoint, tiny_recipe
from typer.testing import CliRunner

from fedkit.cli.app import app
from fedkit.rundir.logs import TIMES, read_metrics, read_times, total_seconds


@pytest.mark.slow
def test_times_survive_kill_9_and_add_up_across_sessions(write_recipe, tmp_path):
    path = write_recipe(tiny_recipe(federation={"rounds": 4}, data={"max_train": 200}))
    out = tmp_path / "run"
    stopped_at = kill_after_checkpoint(path, out, 2)
    first = read_times(out)
    began = time.monotonic()
    resumed = CliRunner().invoke(app, ["run", "--resume", str(out)])
    second_wall = time.monotonic() - began
    assert resumed.exit_code == 0, resumed.output
    times = read_times(out)
    assert times[: len(first)] == first  # nothing of the killed session is cut
    sessions = {r["session"] for r in times}
    assert sessions == {1, 2}
    rounds = {s: [r["round"] for r in times if r["session"] == s and "round" in r] for s in (1, 2)}
    assert rounds[1][:stopped_at] == list(range(1, stopped_at + 1))
    assert rounds[2] == list(range(stopped_at + 1, 5))
    for row in (r for r in times if "round" in r):
        parts = row["train"] + row["aggregate"] + row["evaluate"]
        assert 0 < parts <= row["seconds"] + 0.01
    summary = json.loads((out / "summary.json").read_text())
    round_time = sum(r["seconds"] for r in times if "round" in r)
    assert summary["sessions"] == 2
    assert summary["seconds"] >= round(round_time, 2) > 0
    assert summary["seconds"] == round(total_seconds(times), 2)
    assert summary["seconds"] > summary["seconds_this_session"]
    assert summary["seconds_this_session"] <= second_wall
    assert all("seconds" not in row and "train" not in row for row in read_metrics(out))


def test_a_line_cut_short_by_a_kill_is_skipped(tmp_path):
    (tmp_path / TIMES).write_text('{"session": 1, "setup": 1.5}\n{"session": 1, "round": 1, "sec')
    assert read_times(tmp_path) == [{"session": 1, "setup": 1.5}]
    assert total_seconds(read_times(tmp_path)) == 1.5

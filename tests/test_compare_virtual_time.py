"""``fedkit compare --x virtual_time`` on hand-made run directories: the virtual seconds to
each accuracy target, the ratio to the first run, and a clear error for a run without
the virtual clock."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from fedkit.cli.app import app

runner = CliRunner()


def run_dir(root: Path, rows: list[tuple[float, float | None]]) -> Path:
    """A run directory whose rows are (test_accuracy, virtual_time) per round (``None``: no
    virtual time, a run without ``systems:``)."""
    root.mkdir()
    lines = []
    for round_, (accuracy, seconds) in enumerate(rows, 1):
        row = {"round": round_, "test_accuracy": accuracy}
        if seconds is not None:
            row["virtual_time"] = seconds
        lines.append(json.dumps(row) + "\n")
    (root / "metrics.jsonl").write_text("".join(lines))
    return root


def table(output: str, title_word: str) -> list[list[str]]:
    """The Markdown table after the line holding ``title_word`` (its header, then rows)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and title_word in line)
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return [rows[0], *rows[2:]]


def test_compare_by_virtual_time_reports_time_to_each_target(tmp_path: Path) -> None:
    sync = run_dir(tmp_path / "sync", [(0.5, 15.0), (0.8, 30.0), (0.9, 45.0), (0.93, 60.0)])
    fedbuff = run_dir(tmp_path / "fedbuff", [(0.6, 5.0), (0.85, 10.0), (0.91, 15.0), (0.95, 20.0)])
    args = ["compare", str(sync), str(fedbuff), "--out", str(tmp_path / "c"), "--markdown"]
    targets = ["--target", "0.94", "--target", "0.9"]  # 0.94: the sync run never gets there
    result = runner.invoke(app, [*args, "--x", "virtual_time", *targets])
    assert result.exit_code == 0, result.output
    header, *rows = table(result.stdout, "test_accuracy ≥")
    assert header == ["test_accuracy ≥", "sync", "fedbuff"]
    assert rows == [
        ["0.9000", "45.0 s (round 3)", "15.0 s (round 3, 0.33×)"],
        ["0.9400", "not reached (best 0.9300)", "20.0 s (round 4)"],
    ]
    summary = table(result.stdout, "virtual s")
    column = summary[0].index("virtual s")
    assert [row[column] for row in summary[1:]] == ["60.0", "20.0"]  # final virtual times
    # default targets: the best both reach (0.93), 95 % and 90 % of it, floored to 0.01
    result = runner.invoke(app, [*args, "--x", "virtual_time"])
    targets = [row[0] for row in table(result.stdout, "test_accuracy ≥")[1:]]
    assert targets == ["0.8300", "0.8800", "0.9300"]


def test_compare_by_virtual_time_refuses_a_run_without_the_clock(tmp_path: Path) -> None:
    sync = run_dir(tmp_path / "sync", [(0.5, 15.0), (0.8, 30.0)])
    plain = run_dir(tmp_path / "plain", [(0.5, None), (0.8, None)])
    out = str(tmp_path / "c")
    args = ["compare", str(sync), str(plain), "--out", out]
    result = runner.invoke(app, [*args, "--x", "virtual_time"])
    assert result.exit_code == 2
    assert "plain has no virtual_time" in result.output and "systems:" in result.output
    assert "Traceback" not in result.output
    wrong = runner.invoke(app, [*args, "--x", "time"])
    assert wrong.exit_code == 2 and "round, virtual_time" in wrong.output

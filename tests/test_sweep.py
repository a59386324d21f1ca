"""``fedkit sweep``: the grid it plans, the table it writes, and a killed sweep that ends
with the numbers of an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedkit.cli.app import app
from fedkit.cli.sweep import Cell, axes_of, cells_of, command, discard_unstarted, split_values
from fedkit.errors import FedkitError, RecipeError
from fedkit.rundir import checkpoint
from fedkit.rundir.lock import RunLock
from fedkit.testing import tiny_recipe

GRID = ["--set", "seed=0,1", "--set", "federation.optimizer.lr=0.003,0.006"]


def test_values_split_on_top_level_commas_only():
    assert split_values("1,2, 3") == ["1", "2", "3"]
    assert split_values("[0.2,1.0],[0.5,1.0]") == ["[0.2,1.0]", "[0.5,1.0]"]
    assert split_values("'a,b',c") == ["'a,b'", "c"]


def test_axes_are_the_keys_with_several_values():
    fixed, axes = axes_of(["seed=0,1", "federation.rounds=2", "data.partition.alpha=0.1,1"])
    assert fixed == ["federation.rounds=2"]
    assert axes == {"seed": ["0", "1"], "data.partition.alpha": ["0.1", "1"]}
    names = [c.name for c in cells_of(axes)]
    assert names == ["seed-0_alpha-0.1", "seed-0_alpha-1", "seed-1_alpha-0.1", "seed-1_alpha-1"]
    clash = cells_of({"federation.optimizer.lr": ["1", "2"], "ssl.lr": ["3", "4"]})
    assert clash[0].name == "federation.optimizer.lr-1_ssl.lr-3"


@pytest.mark.parametrize(
    "sets", [["seed"], ["seed=0,,1"], ["seed=0,0"], ["seed=0,1", "seed=2,3"], ["=1"]]
)
def test_bad_sets_are_refused_before_anything_runs(sets):
    with pytest.raises(RecipeError):
        axes_of(sets)


def test_values_are_compared_as_the_recipe_reads_them():
    assert axes_of(["seed=1,true", "x=a,'1'"])[1] == {"seed": ["1", "true"], "x": ["a", "'1'"]}
    for spelt in ("seed=1,01", "seed=1,1.0", "x=[1,2],[1, 2]", "x=a,'a'"):
        with pytest.raises(RecipeError, match="distinct values"):
            axes_of([spelt])


SWEEP_FAULTS = {
    "two_spellings": ("seed=1,01", ["--set seed", "'1' and '01' are both 1"]),
    "one_folder": (
        "description=run a,run/a",
        ["--set description", "'run a' and 'run/a'", "'description-run~a_seed-0'"],
    ),
    "folders_by_case": ("description=A,a", ["'A' and 'a'", "'description-a_seed-0'"]),
}


@pytest.mark.parametrize("case", sorted(SWEEP_FAULTS))
def test_a_grid_that_would_mix_runs_exits_2_before_anything_runs(case, tmp_path, write_recipe):
    item, needles = SWEEP_FAULTS[case]
    recipe, out = write_recipe(tiny_recipe()), tmp_path / "sweep"
    args = ["sweep", str(recipe), "--set", item, "--set", "seed=0,1", "--out", str(out)]
    if case == "two_spellings":
        args[5] = "federation.rounds=1,2"
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in result.output, result.output
    assert not out.exists()


@pytest.mark.slow
def test_a_cell_killed_before_its_recipe_was_written_starts_afresh(tmp_path):
    """A kill -9 can land after ``fedkit run`` made the cell's folder and before it wrote
    recipe.yaml: there is nothing to resume, so the sweep clears the folder and starts."""
    folder = tmp_path / "seed-1"
    (folder / "memories").mkdir(parents=True)
    (folder / "run.lock").write_text("12345\n")
    cell = Cell("seed-1", {"seed": "1"})
    discard_unstarted(folder)
    assert not folder.exists()
    assert "--resume" not in command("r.yaml", [], cell, folder, [])
    (folder / "checkpoints").mkdir(parents=True)  # a run that began is resumed, not cleared
    discard_unstarted(folder)
    assert folder.is_dir() and "--resume" in command("r.yaml", [], cell, folder, [])
    (folder / "checkpoints").rmdir()
    with RunLock(folder), pytest.raises(FedkitError, match="in use by another"):
        discard_unstarted(folder)  # a live run's folder is never removed
    assert folder.is_dir()


def sweep(recipe: Path, out: Path, grid: list[str] = GRID) -> subprocess.Popen:
    command = [sys.executable, "-m", "fedkit", "sweep", str(recipe), *grid, "--out", str(out)]
    return subprocess.Popen(
        [*command, "--parallel", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "FEDKIT_REPORT": "0"},
    )


def metrics(out: Path) -> dict[str, str]:
    return {d.name: (d / "metrics.jsonl").read_text() for d in sorted(out.glob("seed-*"))}


@pytest.mark.slow
def test_a_sweep_runs_its_grid_resumes_after_kill_9_and_reruns_nothing(tmp_path, write_recipe):
    recipe = write_recipe(tiny_recipe(federation={"rounds": 3}))
    whole = tmp_path / "whole"
    proc = sweep(recipe, whole)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output
    cells = metrics(whole)
    assert sorted(cells) == [
        "seed-0_lr-0.003", "seed-0_lr-0.006", "seed-1_lr-0.003", "seed-1_lr-0.006",
    ]  # fmt: skip
    table = json.loads((whole / "table.json").read_text())
    assert [row["federation.optimizer.lr"] for row in table] == ["0.003", "0.006"]
    for row in table:
        finals = [
            json.loads(cells[f"seed-{s}_lr-{row['federation.optimizer.lr']}"].splitlines()[-1])
            for s in (0, 1)
        ]
        values = [f["test_accuracy"] for f in finals]
        assert row["n"] == 2
        assert row["test_accuracy final"]["mean"] == pytest.approx(statistics.fmean(values))
        assert row["test_accuracy final"]["std"] == pytest.approx(statistics.stdev(values))
    assert "± " in (whole / "table.md").read_text()

    again = sweep(recipe, whole)
    output = again.communicate(timeout=300)[0]
    assert again.returncode == 0 and "4 of 4 cells already finished" in output, output
    assert "starting" not in output and "resuming" not in output
    assert metrics(whole) == cells

    killed = tmp_path / "killed"  # two of the cells, as a sweep of their own
    seeds = ["--set", "seed=0,1", "--set", "federation.optimizer.lr=0.006"]
    proc = sweep(recipe, killed, seeds)
    deadline = time.monotonic() + 300
    while not any(checkpoint.latest_round(d) == 1 for d in killed.glob("seed-*")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1)  # its cells' processes end with it
    assert not all((d / "summary.json").is_file() for d in killed.glob("seed-*"))
    proc = sweep(recipe, killed, seeds)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0 and "resuming" in output, output
    assert metrics(killed) == {
        k.removesuffix("_lr-0.006"): v for k, v in cells.items() if k.endswith("6")
    }

    proc = sweep(recipe, killed)  # another grid in the same directory
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2 and "holds a different sweep" in output, output
    assert "Traceback" not in output


@pytest.mark.slow
def test_a_run_redirected_to_a_file_prints_each_round_on_one_line(tmp_path, write_recipe):
    raw = tiny_recipe()
    recipe = write_recipe(raw)
    log = tmp_path / "log.txt"
    with log.open("w") as sink:
        subprocess.run(
            [sys.executable, "-m", "fedkit", "run", str(recipe), "--out", str(tmp_path / "r")],
            stdout=sink,
            stderr=subprocess.STDOUT,
            check=True,
            env={**os.environ, "FEDKIT_REPORT": "0", "COLUMNS": ""},
        )
    lines = [line for line in log.read_text().splitlines() if line.startswith("round ")]
    assert len(lines) == raw["federation"]["rounds"]
    for line in lines:
        assert len(line) > 80  # would have wrapped at rich's default width
        assert all(k in line for k in ("train_loss", "test_accuracy", "up", "down"))
    assert yaml.safe_load((tmp_path / "r" / "recipe.yaml").read_text())["seed"] == 0

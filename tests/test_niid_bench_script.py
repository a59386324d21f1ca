"""benchmarks/niid_bench.py's bookkeeping: which run directory a cell uses, and which rows
the table shows (the runs themselves take hours and live in benchmarks/)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml
from conftest import benchmark_script


@pytest.fixture(scope="module")
def niid_bench():
    return benchmark_script("niid_bench")


def write_run(folder: Path, standardize: bool | None) -> None:
    data = {"partition": {"name": "iid"}}
    if standardize is not None:
        data["standardize"] = standardize
    folder.mkdir(parents=True)
    (folder / "recipe.yaml").write_text(yaml.safe_dump({"data": data}))


def test_a_standardised_run_is_rerun_beside_it_and_never_resumed(niid_bench, tmp_path):
    args = argparse.Namespace(out=tmp_path, root=Path("data"), rounds=None)
    cell = ("fedavg", "iid", 42)
    fresh = niid_bench.cell_command(*cell, args)
    assert "--resume" not in fresh and str(tmp_path / "fedavg-iid-s42") in fresh
    write_run(tmp_path / "fedavg-iid-s42", standardize=None)  # from before the key existed
    assert niid_bench.cell_out(*cell, args) == tmp_path / "fedavg-iid-s42-unit"
    rerun = niid_bench.cell_command(*cell, args)
    assert "--resume" not in rerun and str(tmp_path / "fedavg-iid-s42-unit") in rerun
    write_run(tmp_path / "fedprox-iid-s42", standardize=False)  # a 0..1 run: resumed
    resumed = niid_bench.cell_command("fedprox", "iid", 42, args)
    assert resumed[2:4] == ["--resume", str(tmp_path / "fedprox-iid-s42")]


def test_the_table_prefers_rows_on_niid_benchs_inputs_and_marks_the_others(niid_bench):
    rows = [
        {"method": "fedavg", "partition": "iid", "seed": 42, "accuracy": 80.0},
        {"method": "fedavg", "partition": "iid", "seed": 42, "accuracy": 89.0,
         "standardize": False},
        {"method": "scaffold", "partition": "iid", "seed": 42, "accuracy": 70.0},
    ]  # fmt: skip
    iid = [line for line in niid_bench.table(rows).splitlines() if line.startswith("| iid |")]
    lines = {line.split(" | ")[1]: line for line in iid}
    assert "| 89.0 | 1 |" in lines["FedAvg"] and "+0.0" in lines["FedAvg"]
    assert "| 70.0¶ | 1 |" in lines["SCAFFOLD"]
    assert "| – | 0 |" in lines["FedProx"]


def test_a_run_on_fedkits_own_draw_is_rerun_on_flowers_draw(niid_bench, tmp_path):
    args = argparse.Namespace(out=tmp_path, root=Path("data"), rounds=None)
    cell = ("fedavg", "dirichlet-0.5", 1)
    base = tmp_path / "fedavg-dirichlet-0.5-s1"
    fresh = niid_bench.cell_command(*cell, args)
    assert (
        "data.partition={name: dirichlet, alpha: 0.5, min_size: 10, cap: true, draw_seed: 1}"
        in fresh
    )
    write_run(base, standardize=False)  # 0..1 inputs, fedkit's own draw
    assert niid_bench.cell_out(*cell, args) == base.with_name(base.name + "-unit")
    drawn = {"standardize": False, "partition": {"name": "dirichlet", "draw_seed": 1}}
    (base.with_name(base.name + "-unit")).mkdir()
    (base.with_name(base.name + "-unit") / "recipe.yaml").write_text(
        yaml.safe_dump({"data": drawn})
    )
    resumed = niid_bench.cell_command(*cell, args)
    assert resumed[2:4] == ["--resume", str(base) + "-unit"]


def test_the_table_prefers_rows_on_flowers_draw(niid_bench):
    row = {"method": "fedavg", "partition": "dirichlet-0.5", "standardize": False}
    rows = [
        {**row, "seed": 42, "accuracy": 86.0},
        {**row, "seed": 1, "accuracy": 85.0},
        {**row, "seed": 42, "accuracy": 88.0, "draw_seed": 42},
        {**row, "method": "scaffold", "seed": 42, "accuracy": 86.5},
    ]
    assert [niid_bench.outdated(r) for r in rows] == [True, True, False, True]
    lines = {
        line.split(" | ")[1]: line
        for line in niid_bench.table(rows).splitlines()
        if line.startswith("| dirichlet-0.5 |")
    }
    assert "| 88.0 | 1 | 88.4 |" in lines["FedAvg"]
    assert "| 86.5§ | 1 |" in lines["SCAFFOLD"]


def test_a_rerun_on_a_newer_set_up_moves_the_older_rows_aside(niid_bench, tmp_path):
    results = tmp_path / "results.jsonl"
    cell = {"method": "fedavg", "partition": "dirichlet-0.5", "seed": 42}
    standardised = {**cell, "accuracy": 87.2}
    own_draw = {**cell, "accuracy": 86.1, "standardize": False}
    flowers = {**cell, "accuracy": 88.0, "standardize": False, "draw_seed": 42}
    untouched = {**cell, "method": "scaffold", "accuracy": 86.6}  # its only row: stays
    for row in (standardised, untouched, own_draw):
        niid_bench.append_row(results, row)
    assert niid_bench.supersede(results) == [standardised]
    niid_bench.append_row(results, flowers)
    assert niid_bench.supersede(results) == [own_draw]
    assert niid_bench.supersede(results) == []
    assert niid_bench.read_rows(results) == [untouched, flowers]
    kept = niid_bench.read_rows(niid_bench.superseded_path(results))
    assert kept == [standardised, own_draw]


def test_a_cell_runs_at_its_recipes_thread_count_whatever_parallel_is(
    niid_bench, tmp_path, monkeypatch
):
    """Every cell at the recipe's ``engine.num_cpus`` (issue 54: the harness split the
    cores by --parallel, so a row depended on how many cells ran beside it), recorded in
    its row. Popen is a stand-in: nothing starts."""
    started = []

    class Finished:
        returncode = 0

        def __init__(self, command, env):
            started.append((command[0], env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]))

        def poll(self):
            return 0

    monkeypatch.setattr(niid_bench.subprocess, "Popen", Finished)
    monkeypatch.setattr(niid_bench.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(niid_bench.os, "cpu_count", lambda: 8)
    cells = [(m, "iid", 42) for m in niid_bench.METHODS]
    for parallel in (1, 2, 4):
        args = argparse.Namespace(parallel=parallel, results=tmp_path / f"r{parallel}.jsonl")
        niid_bench.run_cells(
            cells, args, lambda m, p, s, a: [m], lambda cell: {"cell": cell}, threads=lambda c: 1
        )
    assert sorted(set(started)) == sorted((m, "1", "1") for m in niid_bench.METHODS)
    assert len(started) == 3 * len(cells)
    assert {niid_bench.recipe_threads(m) for m in niid_bench.METHODS} == {1}  # the recipes'
    out = tmp_path / "fedavg-iid-s42"
    write_run(out, standardize=False)
    (out / "summary.json").write_text('{"final": {"test_accuracy": 0.5}, "seconds": 3.0}')
    args = argparse.Namespace(out=tmp_path, root=Path("data"), rounds=None)
    row = niid_bench.niid_row(("fedavg", "iid", 42), args)
    assert row["threads"] == 1 and row["accuracy"] == 50.0

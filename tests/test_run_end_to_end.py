"""End-to-end FedAvg runs on digits through the CLI: run directory, ledger, reproducibility."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_recipe
from safetensors.torch import load_file
from typer.testing import CliRunner

from fedkit.cli.app import app
from fedkit.rundir.integrity import sha256_file
from fedkit.rundir.logs import read_clients, read_ledger, read_metrics

pytestmark = pytest.mark.slow  # whole runs through the CLI

runner = CliRunner()


def run_cli(write_recipe, out, **sections):
    path = write_recipe(tiny_recipe(**sections), name=f"{out.name}.yaml")
    result = runner.invoke(app, ["run", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return result


def test_fedavg_learns_and_writes_run_directory(write_recipe, tmp_path):
    out = tmp_path / "run"
    result = run_cli(write_recipe, out, federation={"rounds": 4, "local_epochs": 2})
    assert "round   4/4" in result.output and "run summary" in result.output
    assert "Partition" in result.output and "test_accuracy" in result.output
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["test_accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    logs = ("metrics.jsonl", "clients.jsonl", "ledger.jsonl", "failures.jsonl")
    for name in ("recipe.yaml", "partition.json", "summary.json", *logs):
        assert (out / name).is_file()
    assert [r["round"] for r in read_clients(out)] == [1, 2, 3, 4]
    assert not any("per_client" in r or "clusters" in r for r in rows)  # in clients.jsonl
    pointer = json.loads((out / "checkpoints" / "latest.json").read_text())
    folder = out / "checkpoints" / pointer["folder"]
    sidecar = json.loads((folder / "state.json").read_text())
    assert sidecar["round"] == 4 and set(sidecar["clients"]) == {"0", "1", "2"}
    for entry in sidecar["clients"].values():
        assert sha256_file(out / "clients" / entry["file"]) == entry["sha256"]
    assert "rng" in sidecar and "torch" in sidecar["rng"]
    assert any(k.startswith("0/encoder.") for k in load_file(folder / "pool.safetensors"))


def test_fedavg_ledger_matches_two_t_s(write_recipe, tmp_path):
    out = tmp_path / "run"
    run_cli(write_recipe, out, federation={"rounds": 3})
    pool = load_file(next((out / "checkpoints").glob("round-*")) / "pool.safetensors")
    size = sum(v.numel() * v.element_size() for v in pool.values())
    rows = read_ledger(out)
    per_client = {}
    for row in rows:
        per_client[row["client"]] = (
            per_client.get(row["client"], 0) + row["down_model"] + row["up_model"]
        )
        assert row["down_data"] == row["up_data"] == row["down_aux"] == row["up_aux"] == 0
    assert per_client == {0: 2 * 3 * size, 1: 2 * 3 * size, 2: 2 * 3 * size}


def test_same_seed_same_run_different_seed_different(write_recipe, tmp_path):
    a, b, c = (tmp_path / n for n in ("a", "b", "c"))
    run_cli(write_recipe, a)
    run_cli(write_recipe, b)
    run_cli(write_recipe, c, seed=1)
    assert read_metrics(a) == read_metrics(b)
    assert read_clients(a) == read_clients(b)  # per-client values, once in metrics rows
    assert read_metrics(a) != read_metrics(c)
    pa = load_file(next((a / "checkpoints").glob("round-*")) / "pool.safetensors")
    pb = load_file(next((b / "checkpoints").glob("round-*")) / "pool.safetensors")
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_partial_participation_samples_clients(write_recipe, tmp_path):
    out = tmp_path / "run"
    run_cli(write_recipe, out, data={"num_clients": 4}, federation={"clients_per_round": 2})
    rows = read_metrics(out)
    assert all(len(r["clients"]) == 2 for r in rows)
    ledger = read_ledger(out)
    assert {(r["round"], r["client"]) for r in ledger if r["down_model"]} == {
        (row["round"], c) for row in rows for c in row["clients"]
    }


def test_refuses_to_overwrite_a_run(write_recipe, tmp_path):
    out = tmp_path / "run"
    run_cli(write_recipe, out, federation={"rounds": 1})
    path = write_recipe(tiny_recipe())
    result = runner.invoke(app, ["run", str(path), "--out", str(out)])
    assert result.exit_code == 2 and "--resume" in result.output

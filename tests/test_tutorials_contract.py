"""Executes the tutorials of the contract-v2 plugins (fedprox, scaffold, fednova, the
personalisation baselines, fedbn, fedopt, dp, fedema), shrunk to tiny settings, and checks
what each says the run directory shows."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import flower_in_process
from safetensors.torch import load_file
from tutorials import TUTORIALS, run_tutorial, with_settings
from typer.testing import CliRunner

from fedkit.cli.app import app
from fedkit.rundir.logs import read_ledger, read_metrics

pytestmark = pytest.mark.slow  # executes tutorials end to end

TINY = [
    "data.dataset=digits",
    "data.image_size=16",
    "data.max_train=150",
    "data.num_clients=3",
    "federation.clients_per_round=3",
    "federation.rounds=2",
    "federation.local_epochs=1",
    "federation.batch_size=8",
    "backbone.name=test_resnet",
    "backbone.cifar_stem=false",
    "evaluation.linear_epochs=10",
    "device=cpu",
]


def shrunk(args: list[str]) -> list[str]:
    fresh = args[0] == "run" and "--resume" not in args
    return with_settings(args, TINY if fresh else [])


def ledger(out: Path) -> list[dict]:
    rows = read_ledger(out)
    assert rows, f"{out}: empty ledger.jsonl"
    return rows


def final_pool(out: Path) -> dict:
    pointer = json.loads((out / "checkpoints" / "latest.json").read_text())
    return load_file(out / "checkpoints" / pointer["folder"] / "pool.safetensors")


def run_page(page: str, tmp_path: Path, monkeypatch) -> Path:
    run_tutorial(TUTORIALS / page, shrunk, tmp_path, monkeypatch)
    return tmp_path / "runs"


def test_fedprox_tutorial(tmp_path, monkeypatch):
    runs = run_page("fedprox.md", tmp_path, monkeypatch)
    for name in ("fedprox", "fedprox-01", "fedbyol-prox"):
        assert all(row["train_loss_prox"] > 0 for row in read_metrics(runs / name)[1:])
    assert "train_loss_prox" not in read_metrics(runs / "fedavg-skew")[0]


def test_scaffold_tutorial(tmp_path, monkeypatch):
    runs = run_page("scaffold.md", tmp_path, monkeypatch)
    pool = final_pool(runs / "scaffold")
    variates = sum(
        v.numel() * v.element_size() for k, v in pool.items() if k.startswith("0/scaffold.c.")
    )
    assert 0 < variates < sum(v.numel() * v.element_size() for v in pool.values())
    for row in ledger(runs / "scaffold"):
        assert row["up_aux"] == variates and row["up_data"] == 0
        assert row["down_aux"] == (variates if row["round"] > 1 else 0)


def test_fednova_tutorial(tmp_path, monkeypatch):
    runs = run_page("fednova.md", tmp_path, monkeypatch)
    for row in ledger(runs / "fednova"):
        assert row["up_aux"] == 8 and row["down_aux"] == 0  # one float64 a_i up
    assert not any("fednova" in k for k in final_pool(runs / "fednova"))
    assert all(row["up_aux"] == 0 for row in ledger(runs / "fedavg-niid"))
    assert [r["round"] for r in read_metrics(runs / "fednova")] == [1, 2]


def test_personalization_tutorial(tmp_path, monkeypatch):
    def tiny(args: list[str]) -> list[str]:  # test_resnet takes no batch_norm argument
        fresh = args[0] == "run" and "--resume" not in args
        return with_settings(args, [*TINY, "backbone.kwargs={}"] if fresh else [])

    run_tutorial(TUTORIALS / "personalization.md", tiny, tmp_path, monkeypatch)
    runs = tmp_path / "runs"
    for name in ("pfl-fedavg", "pfl-ft", "pfl-ditto", "pfl-fedrep", "pfl-fedbabu"):
        assert "personalized_accuracy" in read_metrics(runs / name)[-1], name
    assert not any(k.startswith("classifier.") for k in final_pool(runs / "pfl-fedrep"))
    assert all(r["up_aux"] == r["up_data"] == 0 for r in ledger(runs / "pfl-ditto"))
    assert (runs / "pfl-compare" / "compare.html").is_file()


def test_fedbn_tutorial(tmp_path, monkeypatch):
    runs = run_page("fedbn.md", tmp_path, monkeypatch)
    pool = final_pool(runs / "fedbn")
    assert not any("bn" in k for k in pool)
    shared = sum(v.numel() * v.element_size() for v in pool.values())
    assert all(r["up_model"] == r["down_model"] == shared for r in ledger(runs / "fedbn"))


def test_fedopt_tutorial(tmp_path, monkeypatch):
    runs = run_page("fedopt.md", tmp_path, monkeypatch)
    for name in ("fedadam", "fedavgm"):
        assert [r["round"] for r in read_metrics(runs / name)] == [1, 2]


def dp_shrunk(args: list[str]) -> list[str]:
    """TINY, but the DP-SGD recipe keeps its BatchNorm-free backbone (dpsgd refuses
    test_resnet's BatchNorm)."""
    if "dpsgd-digits" not in args:
        return shrunk(args)
    return with_settings(args, [s for s in TINY if not s.startswith("backbone.")])


def test_dp_tutorial(tmp_path, monkeypatch):
    pytest.importorskip("opacus")
    pytest.importorskip("flwr")
    flower_in_process(monkeypatch)  # the SecAgg+ runs: Flower's nodes, without Ray
    run_tutorial(TUTORIALS / "dp.md", dp_shrunk, tmp_path, monkeypatch)
    runs = tmp_path / "runs"
    eps = [row["dp_epsilon"] for row in read_metrics(runs / "dp")]
    assert eps[0] < eps[1]
    assert read_metrics(runs / "dp-1")[-1]["dp_epsilon"] < eps[-1]
    assert "dp_epsilon" not in read_metrics(runs / "no-dp")[-1]

    # the budget: σ calibrated, ε within the target in the row and in the ledger's field
    last = read_metrics(runs / "dp-budget")[-1]
    assert 0 < last["dp_noise_multiplier"] and 7.9 < last["dp_epsilon"] <= 8
    assert last["privacy"]["client"]["epsilon"] == last["dp_epsilon"]

    # SecAgg+: every row says the server saw only the sum of the 3 clients, and what the
    # protocol cost; the accounting is the plain run's
    secure = read_metrics(runs / "dp-secagg")
    assert [r["server_saw"] for r in secure] == ["sum", "sum"]
    assert [r["dp_epsilon"] for r in secure] == eps
    cost = secure[-1]["secagg"]
    assert cost["clients"] == 3 and cost["dropped"] == [] and cost["messages"] == 8 * 3
    booked = secure[-1]["bytes"]  # the protocol's bytes in the ledger, the upload among them
    assert cost["bytes_up"] == booked["up_secagg"] > 2 * booked["down_model"]  # int64 vs float32
    assert cost["bytes_down"] == booked["down_secagg"] and booked["up_model"] == 0
    assert "server_saw" not in read_metrics(runs / "dp")[-1]

    # the refusals: the page's commands, at the recipe's own size, print the page's lines
    # (a budget the run would exceed; a plugin that needs each upload, under SecAgg+)
    page = (TUTORIALS / "dp.md").read_text()
    shown = re.findall(r"```console\n\$ fedkit (.*)\n(error: .*)\n```", page)
    assert len(shown) == 2, "dp.md: expected two ```console blocks with refused runs"
    for command, error in shown:
        args = shlex.split(command)
        result = CliRunner().invoke(app, args, terminal_width=1000)
        assert result.exit_code == 2, result.output
        said = " ".join(result.output.split())
        assert said.endswith(error.split("recipes/dp-digits.yaml: ", 1)[1]), said
        assert not Path(args[args.index("--out") + 1]).exists()

    # sample-level DP-SGD: every client's ε in clients.jsonl, within its target
    rows = [json.loads(line) for line in (runs / "dpsgd" / "clients.jsonl").open()]
    final = rows[-1]["per_client"]
    assert len(final) == 3
    assert all(0 < c["dpsgd_epsilon"] <= 8 for c in final.values())


def test_fedema_tutorial(tmp_path, monkeypatch):
    runs = run_page("fedema.md", tmp_path, monkeypatch)
    rows = read_metrics(runs / "fedema-small")
    assert rows[-1]["train_fedema_mu"] == pytest.approx(0.8)
    assert all(r["train_fedema_divergence"] > 0 for r in rows)

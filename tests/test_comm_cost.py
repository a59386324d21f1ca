"""The ledger reproduces CP-CFL's communication cost: C = T·(C_sc + C_cs) per client,
2·T·S for FedAvg and T·(N+1)·S for clustered FL (N models down, one up)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tensor_bytes
from safetensors.torch import save_file

from fedkit.config.schema import validate
from fedkit.core.engine import prepare, run_round
from fedkit.models.backbones import create_backbone
from fedkit.plugin.ledger import METRIC_FIELDS

ROUNDS, CLIENTS, SAMPLED = 2, 6, 4


def tiny(plugin: Any) -> Any:
    return validate(
        {
            "seed": 0,
            "backbone": {"name": "test_resnet"},
            "data": {"dataset": "digits", "image_size": 8, "num_clients": CLIENTS},
            "federation": {
                "rounds": ROUNDS,
                "clients_per_round": SAMPLED,
                "local_epochs": 1,
                "optimizer": {"name": "adam", "lr": 0.001},
            },
            "plugins": [plugin],
            "evaluation": {"protocol": "none"},
            "device": "cpu",
        }
    )


def tensors_booked(totals: dict[str, int]) -> int:
    """The ledger's total without the clients' reported values (``*_metrics``)."""
    return totals["total"] - sum(totals[f] for f in METRIC_FIELDS)


def ledger_total(plugin: Any) -> tuple[int, int]:
    """Run every round; return the ledger's total bytes of tensors and one model's size S."""
    run = prepare(tiny(plugin))
    size = tensor_bytes(run.server.pool[0].values())
    for r in range(1, ROUNDS + 1):
        run_round(run, r)
    totals = run.server.ledger.totals()
    assert totals["up_metrics"] > 0  # every client reports its loss, booked besides
    return tensors_booked(totals), size


@pytest.fixture(scope="module")
def encoder_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("enc") / "encoder.safetensors"
    torch.manual_seed(0)
    save_file(create_backbone(validate({}).backbone).state_dict(), str(path))
    return path


@pytest.mark.slow
def test_fedavg_costs_two_model_transfers_per_client_and_round() -> None:
    total, size = ledger_total("fedavg")
    assert total == 2 * ROUNDS * SAMPLED * size


@pytest.mark.slow
def test_ifca_with_three_clusters_costs_n_plus_one_transfers() -> None:
    n = 3
    total, size = ledger_total({"ifca": {"num_clusters": n}})
    assert total == ROUNDS * SAMPLED * (n + 1) * size


def test_cpcfl_with_three_clusters_costs_n_plus_one_in_both_phases(encoder_file: Path) -> None:
    n = 3
    plugin = {"cpcfl": {"num_clusters": n, "switch_round": 1, "encoder": str(encoder_file)}}
    total, size = ledger_total(plugin)
    assert total == ROUNDS * SAMPLED * (n + 1) * size


def test_random_phase_without_broadcast_sends_only_the_chosen_model(encoder_file: Path) -> None:
    plugin = {
        "cpcfl": {
            "num_clusters": 3,
            "switch_round": ROUNDS,
            "encoder": str(encoder_file),
            "broadcast_pool": False,
        }
    }
    total, size = ledger_total(plugin)
    assert total == 2 * ROUNDS * SAMPLED * size


def test_client_side_evaluation_books_the_state_each_client_is_sent() -> None:
    """Each evaluated client receives its cluster's state: one model per client and
    evaluated round, booked as ``eval`` (scores come back unbooked); train traffic is
    as without evaluation."""
    raw = tiny("fedavg").model_dump(mode="json")
    raw["data"]["local_test_size"] = 10
    raw["evaluation"] = {"protocol": "supervised", "every": 2}
    run = prepare(validate(raw))
    size = tensor_bytes(run.server.pool[0].values())
    rows = [run_round(run, r) for r in range(1, ROUNDS + 1)]
    assert [row["bytes"]["eval_model"] for row in rows] == [0, CLIENTS * size]
    assert all(row["bytes"]["eval_aux"] == row["bytes"]["eval_data"] == 0 for row in rows)
    booked = {c: row["eval_model"] for (r, c), row in run.server.ledger.rows.items() if r == 2}
    assert booked == dict.fromkeys(range(CLIENTS), size)
    totals = run.server.ledger.totals()
    assert tensors_booked(totals) - totals["eval_model"] == 2 * ROUNDS * SAMPLED * size

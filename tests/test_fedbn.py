"""FedBN: no normalisation key ever crosses (pool, downloads, uploads, ledger), each
client keeps its own BN statistics, and personalised accuracy uses them."""

from __future__ import annotations

import numpy as np
import torch
from conftest import prepared, spied, tensor_bytes, tiny_recipe
from torch import nn

from fedkit.core.engine import run_round
from fedkit.plugin.keys import norm_keys
from fedkit.training import accuracy

RECIPE = tiny_recipe(
    plugins=["fedavg", "fedbn"], data={"partition": {"name": "classes_per_client", "k": 3}}
)


def test_no_bn_key_crosses_and_ledger_counts_shared_bytes_exactly():
    run, spy = spied(RECIPE)
    template = run.server.template
    bn = set(norm_keys(template, (nn.BatchNorm2d,)))
    assert bn and run.server.private == bn
    shared = {k: v for k, v in template.state_dict().items() if k not in bn}
    size = tensor_bytes(shared.values())
    rows = [run_round(run, r) for r in (1, 2)]
    assert not bn & set(run.server.pool[0])
    for r in (1, 2):
        for up in spy.uploads[r]:
            assert set(up.tensors) == set(shared)
    for received in spy.received.values():
        assert not bn & set(received)
    for row in run.server.ledger.to_rows():
        assert row["down_model"] == row["up_model"] == row["eval_model"] == size
        assert row["down_aux"] == row["down_data"] == row["up_aux"] == row["up_data"] == 0
    # 3 clients: a job down, an upload, and the global state sent to score locally
    # (besides the values they report, booked as *_metrics)
    for row in rows:
        reported = row["bytes"]["up_metrics"] + row["bytes"]["eval_metrics"]
        assert reported > 0 and row["bytes"]["total"] - reported == 3 * 3 * size


def test_clients_keep_their_own_bn_statistics_and_personal_accuracy_uses_them():
    run = prepared(RECIPE)
    rows = [run_round(run, r) for r in (1, 2)]
    bn = sorted(run.server.private)
    stats = (
        "encoder.bn1.running_mean"
        if "encoder.bn1.running_mean" in bn
        else next(k for k in bn if k.endswith("running_mean"))
    )
    kept = [run.executor.store.get(c).model for c in range(3)]
    assert not torch.equal(kept[0][stats], kept[1][stats])
    # personalised accuracy by hand: global shared keys + the client's own BN keys
    model = run.server.model(0)
    accs, accs_template_bn = [], []
    for cid in range(3):
        state = {**run.server.pool[0], **{k: kept[cid][k] for k in bn}}
        model.load_state_dict(state)
        accs.append(accuracy(model, run.executor.clients[cid].test, torch.device("cpu")))
    assert rows[-1]["personalized_accuracy"] == float(np.mean(accs))
    model.load_state_dict(
        {**run.server.pool[0], **{k: run.server.template.state_dict()[k] for k in bn}}
    )
    for cid in range(3):
        accs_template_bn.append(
            accuracy(model, run.executor.clients[cid].test, torch.device("cpu"))
        )
    assert float(np.mean(accs_template_bn)) != rows[-1]["personalized_accuracy"]

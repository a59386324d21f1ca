"""Clustered FL: the pool mechanics, the ifca and cpcfl plugins, cluster metrics, data set-up.

Learning runs use a generated 3-group data set of 8×8 images (10 classes, each its own
colour and stripe phase) that a tiny backbone separates in a couple of rounds.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import attach_spy, blobs_recipe, make_blobs
from safetensors.torch import save_file

from fedkit.config.schema import DataConfig, validate
from fedkit.core import runs
from fedkit.core.aggregation import weighted_mean
from fedkit.core.engine import prepare, run_round
from fedkit.core.messages import read_only
from fedkit.data.datasets import ImageSet
from fedkit.data.federated import split_federated
from fedkit.errors import RecipeError
from fedkit.models.backbones import create_backbone
from fedkit.plugin.registry import registries
from fedkit.plugin.server import Upload
from fedkit.rundir import logs
from fedkit.rundir.checkpoint import saved_part
from fedkit.rundir.store import ClientMemory
from fedkit.ssl.pretrain import PretrainConfig, build_heads, pretrain_encoder
from fedkit.training import supervised_loss
from fedkit_plugins.clustered import PRETRAINED, load_encoder, lowest_loss_cluster

HEAD_KEYS = ("classifier.0.weight", "classifier.0.bias")
PAPER_TC = 10  # IFCA has no switch round; its bound is the paper's T_c + 3


@pytest.fixture(scope="module")
def blobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_blobs(tmp_path_factory.mktemp("blobs"))


def random_encoder_file(path: Path) -> Path:
    torch.manual_seed(0)
    save_file(create_backbone(validate({}).backbone).state_dict(), str(path))
    return path


QUICK_PRETRAIN = {"epochs": 2, "batch_size": 64, "jitter": [0, 0, 0, 0], "crop_scale": [0.5, 1]}


def rounds_until_recovered(run, limit: int) -> int | None:
    """Run rounds until the identities match the true groups (ARI 1.0); the round, or None."""
    for r in range(1, limit + 1):
        if run_round(run, r).get("ari") == 1.0:
            return r
    return None


# ---------------------------------------------------------------- must-show: recovery


@pytest.mark.slow
def test_cpcfl_recovers_true_groups_within_tc_plus_3(blobs: Path) -> None:
    switch = 3
    run = prepare(
        blobs_recipe(blobs, {"cpcfl": {"switch_round": switch, "pretrain": QUICK_PRETRAIN}})
    )
    found = rounds_until_recovered(run, switch + 3)
    assert found is not None and found > switch
    assert run_round(run, found + 1)["ari"] == 1.0


@pytest.mark.slow
def test_ifca_with_restarts_recovers_true_groups_within_tc_plus_3(blobs: Path) -> None:
    rec = blobs_recipe(blobs, {"ifca": {"restarts": 3}}, **{"federation.optimizer.lr": 0.03})
    run = prepare(rec)
    found = rounds_until_recovered(run, PAPER_TC + 3)
    assert found is not None
    assert run_round(run, found + 1)["ari"] == 1.0


# ---------------------------------------------------------------- pool mechanics


def test_lowest_loss_selection_picks_the_model_with_the_lowest_loss(blobs: Path) -> None:
    run = prepare(blobs_recipe(blobs, {"ifca": {"num_clusters": 3}}))
    server, client = run.server, run.executor.clients[4]
    counts = torch.bincount(client.train.labels, minlength=10).double()
    prior = torch.log((counts + 1e-3) / counts.sum()).float()
    weight = server.pool[0]["classifier.0.weight"]
    server.pool[2]["classifier.0.weight"] = torch.zeros_like(weight)
    server.pool[2]["classifier.0.bias"] = prior
    server.pool[1]["classifier.0.weight"] = weight * 50
    losses = [supervised_loss(server.model(c), client.train, server.device) for c in range(3)]
    assert int(np.argmin(losses)) == 2
    # client 4's context as its worker builds it in round 1, offered the whole pool
    worker = run.executor.worker
    offers = read_only(server.pool)
    ctx = worker.context(1, 0.05, client, ClientMemory(), torch.Generator(), offers)
    assert lowest_loss_cluster(ctx, worker.model) == 2
    assert ctx.fetched == [0, 1, 2]  # scoring downloads every cluster (booked by the ledger)


@pytest.mark.slow
def test_clusters_aggregate_their_own_clients_weighted_and_unchosen_keep_their_model(
    blobs: Path,
) -> None:
    run = prepare(blobs_recipe(blobs, {"ifca": {"num_clusters": 5}}, **{"federation.rounds": 1}))
    spy = attach_spy(run)
    before = copy.deepcopy(run.server.pool)
    metrics = run_round(run, 1)
    chosen = {int(c) for c in metrics["clusters"].values()}
    assert chosen != set(range(5))
    clients = run.executor.clients
    for cluster in range(5):
        members = [info.id for info in run.server.roster if info.cluster == cluster]
        if not members:
            for key, value in before[cluster].items():
                assert torch.equal(run.server.pool[cluster][key], value)
            continue
        trained = {c: spy.trained[(1, c)] for c in members}
        uploads = [Upload(c, float(len(clients[c].train)), trained[c]) for c in members]
        for key in HEAD_KEYS + ("encoder.conv1.0.weight",):
            expected = weighted_mean(uploads, key)
            assert torch.allclose(run.server.pool[cluster][key], expected, atol=1e-6)


@pytest.mark.slow
def test_restart_triggers_when_every_client_chose_one_cluster(blobs: Path) -> None:
    run = prepare(blobs_recipe(blobs, {"ifca": {"restarts": 1}}))
    server = run.server
    for cluster in (1, 2):
        server.pool[cluster]["classifier.0.weight"] *= 1000
    metrics = run_round(run, 1)
    assert set(metrics["clusters"].values()) == {0}
    assert metrics["restart"] == 1 and server.state["ifca_restarts"] == 1
    assert metrics["ari"] == 0.0
    for cluster in (1, 2):
        server.pool[cluster]["classifier.0.weight"] = server.pool[0]["classifier.0.weight"] * 1000
    again = run_round(run, 2)
    assert "restart" not in again and server.state["ifca_restarts"] == 1


@pytest.mark.slow
def test_cpcfl_freezes_the_encoder_before_switch_round(blobs: Path, tmp_path: Path) -> None:
    enc = random_encoder_file(tmp_path / "enc.safetensors")
    plugin = {"cpcfl": {"switch_round": 1, "encoder": str(enc)}}
    run = prepare(blobs_recipe(blobs, plugin, **{"data.server_fraction": 0.0}))
    spy = attach_spy(run)
    start = copy.deepcopy(run.server.pool)
    metrics = run_round(run, 1)
    assert metrics["encoder_frozen"] is True
    for cid in run.executor.clients:
        after, received = spy.trained[(1, cid)], spy.received[(1, cid)]
        for key, value in received.items():
            if key.startswith("encoder."):
                assert torch.equal(after[key], value), key
        assert not torch.equal(after["classifier.0.weight"], received["classifier.0.weight"])
    for cluster, state in enumerate(run.server.pool):
        for key, value in start[cluster].items():
            if key.startswith("encoder.") and value.is_floating_point():
                assert torch.allclose(state[key], value, atol=1e-7)
    metrics = run_round(run, 2)
    assert metrics["encoder_frozen"] is False
    after, received = spy.trained[(2, 0)], spy.received[(2, 0)]
    assert not torch.equal(after["encoder.conv1.0.weight"], received["encoder.conv1.0.weight"])


def test_cpcfl_pool_is_one_encoder_with_n_random_heads(blobs: Path, tmp_path: Path) -> None:
    enc = random_encoder_file(tmp_path / "enc.safetensors")
    plugin = {"cpcfl": {"num_clusters": 3, "head": "c-2", "encoder": str(enc)}}
    run = prepare(blobs_recipe(blobs, plugin))
    pool = run.server.pool
    saved = load_encoder(enc)
    for state in pool:
        assert all(torch.equal(state[f"encoder.{k}"], v) for k, v in saved.items())
        assert sum(k.startswith("classifier.") and k.endswith("weight") for k in state) == 3
    assert not torch.equal(pool[0]["classifier.0.weight"], pool[1]["classifier.0.weight"])


# ---------------------------------------------------------------- pre-training and encoders


@pytest.mark.slow
def test_cpcfl_stage1_saves_a_reusable_encoder_and_scores_relevance(
    blobs: Path, tmp_path: Path
) -> None:
    pretrain = {**QUICK_PRETRAIN, "epochs": 1, "objective": "byol"}
    rec = blobs_recipe(blobs, {"cpcfl": {"pretrain": pretrain}}, **{"federation.rounds": 1})
    out = tmp_path / "run"
    summary = runs.execute(runs.start(rec, out), out)
    # kept by the core in the run's checkpoint (server.safetensors, pretrained_encoder/*)
    saved = saved_part(out, "", PRETRAINED, "server")
    assert saved.keys() == create_backbone(rec.backbone).state_dict().keys()
    assert not (out / "encoder.safetensors").exists()
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert -1.0 <= first["relevance_score"] <= 1.0
    assert summary["final"]["round"] == 1  # its clusters are in clients.jsonl
    assert logs.read_clients(out)[-1]["clusters"].keys() == {str(i) for i in range(9)}
    assert all(torch.equal(load_encoder(out)[k], v) for k, v in saved.items())
    reuse = prepare(blobs_recipe(blobs, {"cpcfl": {"encoder": str(out)}}))
    assert all(torch.equal(reuse.server.pool[0][f"encoder.{k}"], v) for k, v in saved.items())


def test_cpcfl_needs_a_server_split_or_an_encoder(blobs: Path) -> None:
    with pytest.raises(RecipeError, match="server_fraction"):
        prepare(blobs_recipe(blobs, {"cpcfl": {}}, **{"data.server_fraction": 0.0}))


@pytest.mark.slow
def test_ifca_warm_start_from_a_fedavg_run(blobs: Path, tmp_path: Path) -> None:
    out = tmp_path / "fedavg"
    rec = blobs_recipe(blobs, {"name": "fedavg"}, **{"federation.rounds": 1})
    runs.execute(runs.start(rec, out), out)
    fedavg_encoder = load_encoder(out)
    plugin = {"ifca": {"encoder": str(out), "random_rounds": 2}}
    run = prepare(blobs_recipe(blobs, plugin))
    for state in run.server.pool:
        assert all(torch.equal(state[f"encoder.{k}"], v) for k, v in fedavg_encoder.items())
    assert run_round(run, 1)["bytes"]["total"] > 0


@pytest.mark.parametrize("objective", ["simclr", "byol", "simsiam"])
def test_pretrain_objectives_train_the_encoder(objective: str) -> None:
    torch.manual_seed(0)
    encoder = create_backbone(validate({}).backbone)
    before = copy.deepcopy(encoder.state_dict())
    images = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    data = ImageSet(images, torch.full((16,), -1), ["x"], (0.5,) * 3, (0.25,) * 3)
    cfg = PretrainConfig(objective=objective, epochs=1, batch_size=8)
    losses = pretrain_encoder(
        encoder, data, cfg, device=torch.device("cpu"), generator=torch.Generator()
    )
    assert len(losses) == 1 and np.isfinite(losses[0])
    assert not torch.equal(encoder.state_dict()["conv1.0.weight"], before["conv1.0.weight"])


def test_pretrain_heads_follow_cp_cfl_sizes() -> None:
    simclr = build_heads(96, PretrainConfig(objective="simclr"))
    assert [m.out_features for m in simclr["projector"] if hasattr(m, "out_features")] == [
        256,
        256,
    ]
    byol = build_heads(96, PretrainConfig(objective="byol"))
    assert [m.out_features for m in byol["predictor"] if hasattr(m, "out_features")] == [64, 512]
    assert isinstance(byol["projector"][-1], torch.nn.BatchNorm1d)


# ---------------------------------------------------------------- data set-up and metrics


def test_cluster_groups_reproduces_the_paper_set_up() -> None:
    labels = torch.arange(10).repeat_interleave(2000)
    train = ImageSet(torch.zeros(len(labels), 3, 1, 1, dtype=torch.uint8), labels, [""] * 10,
                     (0.5,) * 3, (0.5,) * 3)  # fmt: skip
    tlabels = torch.arange(10).repeat_interleave(500)
    test = ImageSet(torch.zeros(len(tlabels), 3, 1, 1, dtype=torch.uint8), tlabels, [""] * 10,
                    (0.5,) * 3, (0.5,) * 3)  # fmt: skip
    cfg = DataConfig(
        num_clients=60,
        server_fraction=0.25,
        local_test_size=50,
        partition={"name": "cluster_groups"},
    )
    cluster_groups = registries().partitioners.get("cluster_groups")
    data = split_federated(train, test, cfg, seed=0, partitioner=cluster_groups)
    assert data.groups == [g for g in range(3) for _ in range(20)]
    group_classes = [{0, 1, 2, 3}, {3, 4, 5, 6}, {6, 7, 8, 9}]
    server = set(data.server.tolist())
    for cid, idx in enumerate(data.clients):
        assert len(idx) == 50 and not server & set(idx.tolist())
        counts = np.bincount(labels[idx].numpy(), minlength=10)
        held = {int(c) for c in np.flatnonzero(counts)}
        assert held == group_classes[data.groups[cid]]
        assert sorted(counts[counts > 0].tolist()) == [5, 5, 20, 20]
        test_counts = np.bincount(tlabels[data.client_tests[cid]].numpy(), minlength=10)
        assert np.array_equal(test_counts, counts)
    everything = np.concatenate(data.clients)
    assert len(np.unique(everything)) == len(everything)


@pytest.mark.slow
def test_run_directory_records_identities_and_cluster_metrics_every_round(
    blobs: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ifca"
    rec = blobs_recipe(blobs, {"ifca": {}}, **{"federation.rounds": 2, "evaluation.every": 2})
    runs.execute(runs.start(rec, out), out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    identities = logs.read_clients(out)  # every client is sampled: all 9 every round
    assert [r["round"] for r in identities] == [1, 2]
    for row, ids in zip(rows, identities, strict=True):
        assert set(ids["clusters"]) == {str(i) for i in range(9)}
        assert {"ari", "ari_round", "clusters_used"} <= set(row)
    assert {"personalized_accuracy", "personalized_f1", "personalized_auroc"} <= set(rows[1])
    assert "personalized_f1" not in rows[0]


@pytest.mark.slow
def test_cpcfl_resume_reuses_the_saved_encoder_and_matches_an_uninterrupted_run(
    blobs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pretrain = {**QUICK_PRETRAIN, "epochs": 1}
    rec = blobs_recipe(blobs, {"cpcfl": {"switch_round": 1, "pretrain": pretrain}})
    rec = rec.model_copy(update={"federation": rec.federation.model_copy(update={"rounds": 2})})
    full = tmp_path / "full"
    runs.execute(runs.start(rec, full), full)

    cut = tmp_path / "cut"
    run = runs.start(rec, cut)
    runs.commit(run, cut, [run_round(run, 1)], 1)
    monkeypatch.setattr("fedkit_plugins.cpcfl.pretrain_encoder", pytest.fail)
    resumed, done = runs.resume(cut)
    assert done == 1 and resumed.server.state["pretrain"] == run.server.state["pretrain"]
    runs.execute(resumed, cut, done)
    for a, b in zip(resumed.server.pool, runs.resume(full)[0].server.pool, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)

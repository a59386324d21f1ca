"""Key-level composition: claims, defaults for unclaimed keys, conflicts, plugin errors."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import kept_model, prepared, spied

from fedkit import DROP, hookimpl
from fedkit.core.engine import run_round, update_cluster
from fedkit.errors import ClaimConflict, PluginError
from fedkit.plugin.keys import under
from fedkit.plugin.server import Upload
from fedkit.training import accuracy


class KeepClassifier:
    """Claims the classifier keys in update_client: the client keeps its own head."""

    @hookimpl
    def update_client(self, ctx, received, local):
        return {k: v for k, v in local.items() if k.startswith("classifier.")}


class AlsoClassifier:
    @hookimpl
    def update_client(self, ctx, received, local):
        return {"classifier.weight": local["classifier.weight"]}


class PrivateHead:
    """Declares the classifier private: never in the pool, never uploaded."""

    @hookimpl
    def private_keys(self, server, model):
        return under(model, "classifier")


class SendFeatures:
    uploads_data_derived = True

    @hookimpl
    def upload_selection(self, ctx, local, model):
        return {"features.mean": torch.ones(4), "encoder.conv1.0.weight": DROP}

    @hookimpl
    def aggregate(self, server, cluster, uploads):
        return {"features.mean": torch.stack([u.tensors["features.mean"] for u in uploads]).sum(0)}


class Broken:
    @hookimpl
    def round_end(self, server):
        raise ValueError("boom")


def recipe(*plugins, **overrides):
    from conftest import tiny_recipe

    return tiny_recipe(plugins=list(plugins), federation={"rounds": 1}, **overrides)


class Recorder:
    """Records the state each client starts local training from, and trains nothing."""

    def __init__(self):
        self.seen = {}

    @hookimpl
    def local_train(self, ctx, model):
        self.seen[ctx.id] = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model["classifier"].bias.add_(ctx.id + 1.0)
        ctx.log(loss=0.0)
        return True


def test_unclaimed_keys_are_replaced_and_claimed_keys_kept():
    rec = Recorder()
    run = prepared(recipe("rec", "fedavg", "keep"), rec=rec, keep=KeepClassifier())
    run_round(run, 1)
    kept = {cid: kept_model(run, cid) for cid in range(3)}
    pool = {k: v.clone() for k, v in run.server.pool[0].items()}
    run_round(run, 2)
    for cid in range(3):
        # update_client without kept_keys: the client keeps every key, to be safe
        assert set(kept[cid]) == set(run.server.template.state_dict())
        seen = rec.seen[cid]
        assert torch.equal(seen["classifier.bias"], kept[cid]["classifier.bias"])
        assert torch.equal(seen["encoder.conv1.0.weight"], pool["encoder.conv1.0.weight"])
    # the server averaged the biases: initial + mean(1, 2, 3) weighted by sample counts
    assert not torch.equal(run.server.pool[0]["classifier.bias"], pool["classifier.bias"])


def test_conflicting_claims_name_both_plugins():
    run = prepared(recipe("fedavg", "keep", "also"), keep=KeepClassifier(), also=AlsoClassifier())
    with pytest.raises(ClaimConflict, match="'keep' and 'also'.*classifier.weight.*update_client"):
        run_round(run, 1)


def test_private_keys_stay_out_of_pool_and_uploads():
    run = prepared(recipe("fedavg", "private"), private=PrivateHead())
    assert not any(k.startswith("classifier.") for k in run.server.pool[0])
    run_round(run, 1)
    assert not any(k.startswith("classifier.") for k in run.server.pool[0])
    assert run.server.private == frozenset(under(run.server.template, "classifier"))
    kept = kept_model(run, 0)
    assert all(k.startswith("classifier.") or k.startswith("encoder.") for k in kept)
    assert set(kept) == run.server.private  # a client keeps its private keys only
    rows = run.server.ledger.to_rows()
    head = sum(v.numel() * 4 for k, v in kept.items() if k.startswith("classifier."))
    enc = sum(v.numel() * v.element_size() for k, v in run.server.pool[0].items())
    assert head > 0 and all(r["up_model"] == enc for r in rows)


def test_personalized_accuracy_scores_each_client_with_its_own_private_keys():
    run = prepared(recipe("fedavg", "private"), private=PrivateHead())
    row = run_round(run, 1)
    model = copy.deepcopy(run.server.template)
    scores = []
    for cid, data in sorted(run.executor.clients.items()):
        own = {k: v for k, v in kept_model(run, cid).items() if k in run.server.private}
        model.load_state_dict({**run.server.pool[0], **own})  # shared from the pool
        scores.append(accuracy(model, data.test, torch.device("cpu")))
    assert row["personalized_accuracy"] == pytest.approx(sum(scores) / len(scores))


def test_data_derived_uploads_are_counted_apart():
    run = prepared(recipe("fedavg", "feats"), feats=SendFeatures())
    run_round(run, 1)
    rows = run.server.ledger.to_rows()
    assert all(r["up_data"] == 4 * 4 for r in rows)
    assert torch.equal(run.server.pool[0]["features.mean"], torch.full((4,), 3.0))
    assert run.plugins.uploads_data_derived() == ["feats"]
    # the kept-private key was not sent: the server still has its initial value
    assert all(r["up_model"] < r["down_model"] for r in rows)


def test_plugin_exception_names_plugin_and_hook():
    run = prepared(recipe("fedavg", "broken"), broken=Broken())
    with pytest.raises(PluginError, match="plugin 'broken' failed in hook 'round_end': ValueError"):
        run_round(run, 1)


def test_default_aggregation_is_weighted_mean_and_unclaimed_cluster_keeps_model():
    run = prepared(recipe("fedavg"))
    before = {k: v.clone() for k, v in run.server.pool[0].items()}
    key = "classifier.bias"
    ups = [
        Upload(0, 1.0, {key: torch.zeros_like(before[key])}),
        Upload(1, 3.0, {key: torch.full_like(before[key], 4.0)}),
    ]
    state = update_cluster(run, 0, ups)
    assert torch.allclose(state[key], torch.full_like(before[key], 3.0))
    assert torch.equal(state["classifier.weight"], before["classifier.weight"])


def test_trace_prints_hook_calls(monkeypatch, capsys):
    monkeypatch.setenv("FEDKIT_TRACE_PLUGINS", "1")
    run = prepared(recipe("fedavg"))
    run_round(run, 1)
    err = capsys.readouterr().err
    assert "[fedkit] local_objective -> fedavg" in err  # client side: who trains
    assert "[fedkit] update_client" in err
    assert "[fedkit] init_models -> fedavg" in err  # server side


def test_pool_is_weighted_mean_of_what_each_client_trained():
    run, spy = spied(recipe("fedavg"))
    run_round(run, 1)
    clients = run.executor.clients
    sizes = [len(clients[cid].train) for cid in sorted(clients)]
    states = [spy.trained[(1, cid)] for cid in sorted(clients)]
    key = "classifier.weight"
    expected = sum(s[key].double() * n for s, n in zip(states, sizes, strict=True)) / sum(sizes)
    assert not torch.equal(states[0][key], states[1][key])
    assert torch.allclose(run.server.pool[0][key].double(), expected, atol=1e-6)


class DropsInUpdate:
    @hookimpl
    def kept_keys(self, server, model):
        return []

    @hookimpl
    def update_client(self, ctx, received, local):
        return {"classifier.bias": DROP}


class DropsOnTheServer:
    @hookimpl
    def server_update(self, server, cluster, previous, aggregated):
        return {"classifier.bias": DROP}


def test_drop_removes_a_key_where_it_can_and_is_an_error_elsewhere():
    from fedkit.errors import RoundFailed

    run = prepared(recipe("fedavg", "drops"), drops=DropsInUpdate())
    with pytest.raises(RoundFailed, match="fedkit.DROP, which only upload_selection"):
        run_round(run, 1)
    run = prepared(recipe("fedavg", "server"), server=DropsOnTheServer())
    run_round(run, 1)
    assert "classifier.bias" not in run.server.pool[0] and "classifier.weight" in run.server.pool[0]

"""The personalisation baselines, by their defining properties: Ditto's global model is
FedAvg's and each client is scored with its own v_k; FedRep uploads only the body and
each client keeps its head; FedBABU never trains the head during federation and scores a
fine-tuned copy; local fine-tuning changes only what a client is scored with."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import client_context, kept_model, prepared, spied, tensor_bytes, tiny_recipe

from fedkit.core.engine import run_round
from fedkit.plugin.ledger import TENSOR_FIELDS
from fedkit.training import accuracy
from fedkit_plugins.ditto import PERSONAL, Ditto
from fedkit_plugins.finetune import fine_tuned

SGD = {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.0}}


def rounds(raw, n=2, spy=False):
    run, watch = spied(raw) if spy else (prepared(raw), None)
    rows = [run_round(run, r) for r in range(1, n + 1)]
    return run, rows, watch


def recipe(*plugins, federation=None):
    """FedAvg with ``plugins`` beside it; FedRep and FedBABU build their own model."""
    alone = any(isinstance(p, dict) and {"fedrep", "fedbabu"} & p.keys() for p in plugins)
    chosen = list(plugins) if alone else ["fedavg", *plugins]
    return tiny_recipe(plugins=chosen, federation={**SGD, **(federation or {})})


def same_pool(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def tensor_traffic(row):
    """A row's bytes of tensors (what clients report is booked besides, as *_metrics)."""
    return {k: row["bytes"][k] for k in TENSOR_FIELDS}


def without(row, *prefixes):
    return {k: v for k, v in row.items() if not k.startswith(prefixes)}


# ---------------------------------------------------------------- Ditto


@pytest.mark.slow
def test_dittos_global_model_is_fedavgs_and_clients_are_scored_with_their_own():
    plain, plain_rows, _ = rounds(recipe())
    ditto, ditto_rows, _ = rounds(recipe({"ditto": {"lam": 0.1}}))
    assert same_pool(plain.server.pool[0], ditto.server.pool[0])
    for a, b in zip(plain_rows, ditto_rows, strict=True):
        assert a["train_loss"] == b["train_loss"] and a["test_accuracy"] == b["test_accuracy"]
        assert tensor_traffic(a) == tensor_traffic(b)  # v_k never travels
    for cid in range(3):
        tensors = ditto.executor.memory(cid).tensors
        personal = {k[len(PERSONAL) :]: v for k, v in tensors.items() if k.startswith(PERSONAL)}
        model = copy.deepcopy(ditto.server.template)
        model.load_state_dict(personal)
        assert not torch.equal(
            personal["classifier.weight"], ditto.server.pool[0]["classifier.weight"]
        )
        score = accuracy(model, ditto.data.client(cid).test, torch.device("cpu"))
        assert ditto_rows[-1]["client_accuracy"][str(cid)] == score
    assert ditto_rows[-1]["client_accuracy"] != plain_rows[-1]["client_accuracy"]
    assert all(r["train_ditto_loss"] > 0 for r in ditto_rows)


def test_dittos_personal_loss_adds_half_lambda_times_the_squared_distance():
    """One personal step with plain SGD from v = w: the pull is zero, so v moves as the
    cross-entropy gradient alone says; from v = w + 1 it also moves back by lr·λ."""
    raw = recipe(federation={**SGD, "batch_size": 300, "local_epochs": 1})
    run = prepared(raw)
    data = run.data.client(0)
    ctx = client_context(raw, train=data.train)
    model = copy.deepcopy(run.server.template)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lam, lr = 0.5, 0.05
    plugin = Ditto(Ditto.Options(lam=lam, personal_epochs=1))
    plugin.after_local_train(ctx, model, before)
    step = {k: ctx.tensors[PERSONAL + k] for k in before}
    shifted = {k: (v + 1 if v.is_floating_point() else v) for k, v in before.items()}
    ctx2 = client_context(
        raw, train=data.train, tensors={PERSONAL + k: v for k, v in shifted.items()}
    )
    plugin.after_local_train(ctx2, model, before)
    for key in ("classifier.weight", "classifier.bias"):  # a linear layer: exact arithmetic
        moved = step[key] - before[key]  # −lr·∇CE(w)
        pulled = ctx2.tensors[PERSONAL + key] - shifted[key]  # −lr·(∇CE(w+1) + λ·1)
        assert pulled.mean() < moved.mean()
        assert torch.allclose(
            pulled + lr * lam, -lr * _grad(run, data.train, shifted, key), atol=1e-5
        )


def _grad(run, train, state, key):
    """∂CE/∂key at ``state`` on the whole client set (one batch)."""
    from fedkit.training import normalize

    model = copy.deepcopy(run.server.template)
    model.load_state_dict(state)
    model.train()
    x = normalize(train.images, train)
    loss = torch.nn.functional.cross_entropy(model["classifier"](model["encoder"](x)), train.labels)
    loss.backward()
    return dict(model.named_parameters())[key].grad


# ---------------------------------------------------------------- FedRep


def test_fedrep_uploads_only_the_body_and_each_client_keeps_its_head():
    run, rows, spy = rounds(recipe({"fedrep": {"head_epochs": 2}}), spy=True)
    pool = run.server.pool[0]
    assert not any(k.startswith("classifier.") for k in pool)
    body = tensor_bytes(
        v for k, v in run.server.template.state_dict().items() if k.startswith("encoder.")
    )
    for round_uploads in spy.uploads.values():
        for upload in round_uploads:
            assert all(k.startswith("encoder.") for k in upload.tensors)
    assert all(r["bytes"]["up_model"] == 3 * body for r in rows)
    heads = [kept_model(run, cid)["classifier.weight"] for cid in range(3)]
    assert not torch.equal(heads[0], heads[1]) and not torch.equal(heads[1], heads[2])
    for cid in range(3):  # round 2 starts from the client's own head of round 1
        assert torch.equal(
            spy.loaded[(2, cid)]["classifier.weight"], spy.trained[(1, cid)]["classifier.weight"]
        )
    assert all(r["train_head_loss"] > 0 for r in rows)


def test_fedrep_trains_the_head_first_with_the_received_body_frozen():
    run, _, spy = rounds(recipe({"fedrep": {"head_epochs": 3}}), n=1, spy=True)
    start, end = spy.loaded[(1, 0)], spy.trained[(1, 0)]
    assert not torch.equal(start["classifier.weight"], end["classifier.weight"])
    assert not torch.equal(start["encoder.conv1.0.weight"], end["encoder.conv1.0.weight"])


# ---------------------------------------------------------------- FedBABU


@pytest.mark.slow
def test_fedbabu_never_trains_the_head_during_federation():
    raw = recipe({"fedbabu": {"finetune_epochs": 1}})
    run, rows, spy = rounds(raw, n=3, spy=True)
    initial = build_classifier_like(run)
    for key in ("classifier.weight", "classifier.bias"):
        assert torch.equal(run.server.pool[0][key], initial[key])
        for (rnd, cid), state in spy.trained.items():
            assert torch.equal(state[key], initial[key]), (rnd, cid)
    assert not torch.equal(
        run.server.pool[0]["encoder.conv1.0.weight"], initial["encoder.conv1.0.weight"]
    )
    for round_uploads in spy.uploads.values():
        assert all(not any(k.startswith("classifier.") for k in u.tensors) for u in round_uploads)


def build_classifier_like(run):
    """The server's initial model (the template is the round-0 pool's model)."""
    return {k: v for k, v in run.server.template.state_dict().items()}


@pytest.mark.slow
def test_fedbabu_scores_a_fine_tuned_copy_and_keeps_the_global_model():
    tuned_run, tuned_rows, _ = rounds(recipe({"fedbabu": {"finetune_epochs": 2}}))
    plain_run, plain_rows, _ = rounds(recipe({"fedbabu": {"finetune_epochs": 0}}))
    assert same_pool(tuned_run.server.pool[0], plain_run.server.pool[0])  # evaluation only
    assert tuned_rows[-1]["client_accuracy"] != plain_rows[-1]["client_accuracy"]
    assert tuned_rows[-1]["test_accuracy"] == plain_rows[-1]["test_accuracy"]


# ---------------------------------------------------------------- local fine-tuning


@pytest.mark.slow
@pytest.mark.parametrize("part", ["all", "head"])
def test_fine_tuning_changes_only_what_a_client_is_scored_with(part):
    plain, plain_rows, _ = rounds(recipe())
    tuned, tuned_rows, _ = rounds(recipe({"finetune": {"epochs": 1, "part": part}}))
    assert same_pool(plain.server.pool[0], tuned.server.pool[0])
    assert without(plain_rows[-1], "client_", "personalized_", "bytes") == without(
        tuned_rows[-1], "client_", "personalized_", "bytes"
    )
    assert tensor_traffic(plain_rows[-1]) == tensor_traffic(tuned_rows[-1])
    assert tuned_rows[-1]["client_accuracy"] != plain_rows[-1]["client_accuracy"]


def test_head_fine_tuning_leaves_the_encoder_as_it_was():
    raw = recipe()
    run = prepared(raw)
    ctx = client_context(raw, train=run.data.client(0).train)
    model = copy.deepcopy(run.server.template).eval()
    tuned = fine_tuned(ctx, model, 2, "head")
    for key, value in model.state_dict().items():
        same = torch.equal(tuned.state_dict()[key], value)
        assert same == (not key.startswith("classifier.")), key
    assert fine_tuned(ctx, model, 0) is None

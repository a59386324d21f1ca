"""Evaluation where the data is: every client scores its personal model on the client, and
only the scores reach the server.

For every built-in plugin, the scores clients report equal what the v2 engine computed
on the driver (the cluster's state with the client's own private keys, scored on its
local test set, or its encoder on the pooled benchmark sets). A plugin can supply a whole
personal model of its own (``personal_model``) and scores of its own
(``evaluate_client``), and ``evaluation.clients`` evaluates a sample of clients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import COMBOS, prepared, ssl_recipe, tiny_recipe

from fedkit import hookimpl
from fedkit.core.engine import run_round
from fedkit.evaluation.scoring import score_encoder, supervised_scores
from fedkit.training import supervised_loss

OWN_MODEL = ("ditto", "finetune", "fedbabu")
"""Plugins whose ``personal_model`` scores a model of their own (v_k, a fine-tuned copy):
test_personalization.py checks what they are scored with."""
SUPERVISED = [name for name in COMBOS if name not in ("tensorboard", "mlflow", *OWN_MODEL)]


def personal_state(run, cid: int) -> dict[str, torch.Tensor]:
    """What the v2 engine evaluated for a client: its cluster's state with its own values
    of the private keys (the template's before it first trained)."""
    server = run.server
    state = dict(server.template.state_dict())
    cluster = server.roster[cid].cluster or 0
    state.update({k: v for k, v in server.pool[cluster].items() if k in state})
    memory = run.executor.memory(cid)
    if memory is not None and memory.model is not None:
        state.update({k: memory.model[k] for k in server.private})
    return state


def expected_scores(run, cid: int) -> dict[str, float]:
    model = copy.deepcopy(run.server.template)
    model.load_state_dict(personal_state(run, cid))
    model.eval()
    cfg, device = run.recipe.evaluation, run.server.device
    if cfg.protocol == "supervised":
        scores = run.evaluator.client_scores(len(run.server.pool))
        return supervised_scores(model, run.data.client(cid).test, device, scores)
    memory = run.executor.memory(cid)
    if memory is None or memory.model is None:
        return {}
    train, test = run.evaluator.benchmark()
    return score_encoder(model["encoder"], train, test, cfg.protocol, cfg, run.recipe.seed, device)


def evaluated(raw):
    """Run a recipe for its rounds, evaluating every round (representation recipes score
    each client's encoder with a small kNN)."""
    raw = copy.deepcopy(raw)
    if raw["evaluation"]["protocol"] == "none":
        raw["evaluation"] = {"protocol": "knn", "every": 1, "personal": True, "knn_k": 5}
    raw["federation"]["rounds"] = 2
    run = prepared(raw)
    rows = [run_round(run, r) for r in (1, 2)]
    return run, rows


@pytest.mark.slow
@pytest.mark.parametrize("name", SUPERVISED)
def test_client_scores_equal_the_personal_model_scored_on_the_client(name):
    run, rows = evaluated(COMBOS[name])
    last = rows[-1]
    names = {k[len("client_") :] for k, v in last.items() if k.startswith("client_")}
    assert names, f"{name}: no client scores"
    for cid in range(len(run.server.roster)):
        want = expected_scores(run, cid)
        got = {n: last[f"client_{n}"][str(cid)] for n in names if str(cid) in last[f"client_{n}"]}
        assert got == want, f"{name}, client {cid}"
    for n in names:
        values = list(last[f"client_{n}"].values())
        assert last[f"personalized_{n}"] == pytest.approx(sum(values) / len(values), abs=1e-12)
    run.close()


class OwnModel:
    """Keeps the whole model it trained to (in ``ctx.tensors``) and is evaluated with it."""

    @hookimpl
    def after_local_train(self, ctx, model, before):
        for key, value in model.state_dict().items():
            ctx.tensors[f"own.{key}"] = value.detach().cpu().clone()

    @hookimpl
    def personal_model(self, ctx, model):
        own = {k[4:]: v for k, v in ctx.tensors.items() if k.startswith("own.")}
        if not own:
            return None  # never trained: the default personal model
        model.load_state_dict(own)
        return model

    @hookimpl
    def evaluate_client(self, ctx, model):
        ctx.log(test_loss=supervised_loss(model, ctx.test, ctx.device))


@pytest.mark.slow
def test_a_plugin_supplies_a_whole_personal_model_and_scores_of_its_own():
    raw = tiny_recipe(plugins=["fedavg", "ownmodel"])
    run = prepared(raw, ownmodel=OwnModel)
    rows = [run_round(run, r) for r in (1, 2)]
    plain = prepared(tiny_recipe())
    plain_rows = [run_round(plain, r) for r in (1, 2)]
    assert rows[-1]["test_accuracy"] == plain_rows[-1]["test_accuracy"]  # training unchanged
    for cid in range(3):
        memory = run.executor.memory(cid)
        own = {k[4:]: v for k, v in memory.tensors.items() if k.startswith("own.")}
        model = copy.deepcopy(run.server.template)
        model.load_state_dict(own)
        data = run.data.client(cid)
        want = supervised_scores(model.eval(), data.test, run.server.device, ("accuracy",))
        assert rows[-1]["client_accuracy"][str(cid)] == want["accuracy"]
        loss = supervised_loss(model, data.test, run.server.device)
        assert rows[-1]["client_test_loss"][str(cid)] == loss
    # the client's own trained model, not the global one: the scores differ
    assert rows[-1]["client_accuracy"] != plain_rows[-1]["client_accuracy"]
    assert "personalized_test_loss" in rows[-1]
    for r in (run, plain):
        r.close()


@pytest.mark.slow
def test_evaluation_of_a_sample_of_clients_is_seeded_and_the_same_under_isolation():
    raw = tiny_recipe(data={"num_clients": 6}, federation={"clients_per_round": 3})
    raw["evaluation"] = {"protocol": "supervised", "every": 1, "clients": 2}
    rows = {}
    for executor in ("sequential", "isolated"):
        run = prepared({**raw, "engine": {"executor": executor}})
        rows[executor] = [run_round(run, r) for r in (1, 2)]
        run.close()
    for row in rows["sequential"]:
        assert len(row["client_accuracy"]) == 2
    assert [r["client_accuracy"] for r in rows["sequential"]] == [
        r["client_accuracy"] for r in rows["isolated"]
    ]
    assert rows["sequential"][0]["client_accuracy"] != rows["sequential"][1]["client_accuracy"]


def test_representation_scores_of_untrained_clients_are_left_out():
    raw = ssl_recipe("fedbyol", "single_client", rounds=1)
    raw["data"]["num_clients"] = 4
    raw["federation"]["clients_per_round"] = 2
    raw["evaluation"] = {"protocol": "knn", "every": 1, "personal": True, "knn_k": 5}
    run = prepared(raw)
    row = run_round(run, 1)
    assert set(row["client_knn_accuracy"]) == {str(c) for c in row["clients"]}
    run.close()

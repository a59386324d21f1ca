"""Behaviour of the self-supervised plugins: what each uploads, replaces and keeps
private, their losses on known inputs, and the single-client baseline."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import (
    kept_model,
    keys_under,
    prepared,
    run_rounds,
    same_keys,
    spied,
    ssl_recipe,
    tensor_bytes,
)
from torch import nn

from fedkit.config.schema import validate
from fedkit.core.engine import run_round
from fedkit.errors import RecipeError
from fedkit.evaluation.scoring import score_encoder
from fedkit.plugin.ledger import TENSOR_FIELDS
from fedkit_plugins._ssl_common import byol_loss_fn
from fedkit_plugins.fedsimclr import FedSimCLR
from fedkit_plugins.fedsimsiam import simsiam_loss_fn

TARGET = ("target_encoder.", "target_projector.")


@pytest.mark.slow
@pytest.mark.parametrize(
    "plugins",
    [
        ["fedbyol"],
        ["fedu", ("dapu", {"mu": 0.4})],
        ["fedbyol", "dapu"],
        ["fedsimsiam"],
        ["fedsimclr"],
    ],
    ids=lambda p: "+".join(x if isinstance(x, str) else x[0] for x in p),
)
def test_plugins_train_end_to_end_with_knn_monitor(plugins):
    raw = ssl_recipe(*plugins, evaluation={"protocol": "knn", "every": 1})
    run = prepared(raw)
    rows = run_rounds(run, 2)
    assert all(math.isfinite(r["train_loss"]) for r in rows)
    assert all(0.0 <= r["knn_accuracy"] <= 1.0 for r in rows)
    assert rows[1]["bytes"]["up_model"] > 0


@pytest.mark.slow
def test_fedbyol_uploads_online_and_predictor_replaces_them_and_keeps_target():
    run, spy = spied(ssl_recipe("fedbyol"))
    run_rounds(run, 1)
    kept = {cid: kept_model(run, cid) for cid in range(3)}
    run_round(run, 2)
    template = run.server.template.state_dict()
    shared = [k for k in template if not k.startswith(TARGET)]
    targets = [k for k in template if k.startswith(TARGET)]
    assert keys_under(template, "predictor.") and targets
    assert all(set(kept[cid]) == set(targets) for cid in range(3))  # keeps its target only
    for up in spy.uploads[1]:
        assert set(up.tensors) == set(shared)
    assert set(run.server.pool[0]) == set(shared)
    for cid in range(3):
        first, second = spy.loaded[(1, cid)], spy.loaded[(2, cid)]
        for k in keys_under(first, "encoder.") + keys_under(first, "projector."):
            assert torch.equal(first["target_" + k], first[k])  # first participation: copy
        assert same_keys(second, spy.received[(2, cid)], shared)  # online + predictor replaced
        assert same_keys(second, kept[cid], targets)  # the client's own target, as it left round 1
        assert same_keys(spy.trained[(1, cid)], kept[cid], targets)
        assert not same_keys(second, spy.trained[(1, cid)], keys_under(second, "encoder."))


@pytest.mark.slow
def test_global_model_is_the_weighted_mean_of_the_clients_models():
    run, spy = spied(ssl_recipe("fedbyol", rounds=1))
    run_rounds(run, 1)
    clients = run.executor.clients
    weights = torch.tensor([float(len(clients[cid].train)) for cid in sorted(clients)])
    for k in ("encoder.conv1.0.weight", "predictor.0.weight"):
        stacked = torch.stack([spy.trained[(1, cid)][k] for cid in sorted(clients)])
        expected = torch.einsum("c,c...->...", weights / weights.sum(), stacked)
        torch.testing.assert_close(run.server.pool[0][k], expected)


def test_fedbyol_target_is_an_ema_of_the_online_network():
    raw = ssl_recipe("fedbyol", rounds=1)
    raw["federation"].update(batch_size=64, local_epochs=1)
    run, spy = spied(raw)
    before = run.server.template.state_dict()
    run_rounds(run, 1)
    after = spy.trained[(1, 0)]
    assert len(run.executor.clients[0].train) <= 64  # one optimiser step: one EMA update
    params = {n for n, _ in run.server.template.named_parameters()}
    checked = [
        k for k in keys_under(after, "encoder.") + keys_under(after, "projector.") if k in params
    ]
    assert checked
    for k in checked:
        expected = 0.99 * before[k] + 0.01 * after[k]
        torch.testing.assert_close(after["target_" + k], expected)
        assert torch.equal(kept_model(run, 0)["target_" + k], after["target_" + k])  # kept


@pytest.mark.slow
def test_fedu_ledger_counts_zero_target_bytes():
    run, spy = spied(ssl_recipe("fedu", ("dapu", {"mu": 0.4})))
    run_rounds(run, 2)
    state = run.server.template.state_dict()
    target_bytes = tensor_bytes(v for k, v in state.items() if k.startswith(TARGET))
    shared_bytes = tensor_bytes(v for k, v in state.items() if not k.startswith(TARGET))
    assert target_bytes > 0
    for (_, _), row in run.server.ledger.rows.items():
        assert row["up_model"] == shared_bytes
        assert row["up_aux"] == row["up_data"] == 0
    for ups in spy.uploads.values():
        for up in ups:
            assert not any(k.startswith(TARGET) for k in up.tensors)


@pytest.mark.slow
def test_fedu_upload_target_sends_target_values_under_online_keys():
    run, spy = spied(ssl_recipe(("fedu", {"upload": "target"}), rounds=1))
    run_rounds(run, 1)
    for up in spy.uploads[1]:
        trained = spy.trained[(1, up.client)]
        online = keys_under(trained, "encoder.") + keys_under(trained, "projector.")
        assert online
        for k in online:
            assert torch.equal(up.tensors[k], trained["target_" + k])
        assert not any(k.startswith(TARGET) for k in up.tensors)


@pytest.mark.slow
@pytest.mark.parametrize("update", ["online", "target", "both"])
def test_fedu_update_modes_replace_what_they_name(update):
    run, spy = spied(ssl_recipe(("fedu", {"update": update})))
    run_rounds(run, 1)
    kept = {cid: kept_model(run, cid) for cid in range(3)}
    rounds_2 = run_round(run, 2)
    assert math.isfinite(rounds_2["train_loss"])
    for cid in range(3):
        loaded, got = spy.loaded[(2, cid)], spy.received[(2, cid)]
        trained = spy.trained[(1, cid)]  # the client's full state as it left round 1
        online = keys_under(loaded, "encoder.") + keys_under(loaded, "projector.")
        target_from_global = all(torch.equal(loaded["target_" + k], got[k]) for k in online)
        online_from_global = same_keys(loaded, got, online)
        assert online_from_global == (update in ("online", "both"))
        assert same_keys(loaded, trained, online) == (update == "target")
        # only update: target needs the client's own online network kept between rounds
        kept_online = [k for k in online if k in kept[cid]]
        assert kept_online == (online if update == "target" else [])
        assert target_from_global == (update in ("target", "both"))
        targets = ["target_" + k for k in online]
        assert same_keys(loaded, kept[cid], targets) == (update == "online")


@pytest.mark.slow
def test_fedu_local_predictor_is_private():
    run, spy = spied(ssl_recipe(("fedu", {"predictor": "local"})))
    run_rounds(run, 1)
    kept = {cid: kept_model(run, cid) for cid in range(3)}
    run_round(run, 2)
    assert not keys_under(run.server.pool[0], "predictor.")
    for up in spy.uploads[1]:
        assert not keys_under(up.tensors, "predictor.")
    for cid in range(3):
        keys = keys_under(kept[cid], "predictor.")
        assert same_keys(spy.loaded[(2, cid)], kept[cid], keys)


@pytest.mark.slow
@pytest.mark.parametrize("plugin", ["fedsimsiam", "fedsimclr"])
def test_simsiam_and_simclr_share_every_part(plugin):
    run, spy = spied(ssl_recipe(plugin))
    run_rounds(run, 2)
    keys = set(run.server.template.state_dict())
    parts = {k.split(".", 1)[0] for k in keys}
    assert parts == (
        {"encoder", "projector", "predictor"}
        if plugin == "fedsimsiam"
        else {"encoder", "projector"}
    )
    for up in spy.uploads[1]:
        assert set(up.tensors) == keys
    for cid in range(3):
        assert same_keys(spy.loaded[(2, cid)], spy.received[(2, cid)], keys)


class _Identity(nn.Module):
    def forward(self, x):
        return x


def _identity_model(predictor: bool = True, target: bool = False) -> nn.ModuleDict:
    names = ["encoder", "projector"] + (["predictor"] if predictor else [])
    names += ["target_encoder", "target_projector"] if target else []
    return nn.ModuleDict({n: _Identity() for n in names})


V1 = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
V2 = torch.tensor([[1.0, 1.0], [0.0, -3.0]])


def test_byol_loss_on_a_known_input():
    # cos(v1, v2) per row: 1/sqrt(2) and -1; each term 2 - 2cos, two terms summed
    per_row = [2 - 2 / math.sqrt(2), 2 + 2]
    expected = 2 * sum(per_row) / 2
    loss, outputs = byol_loss_fn(_identity_model(target=True), V1, V2)
    assert set(outputs) == {"features", "projections"}
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_simsiam_loss_on_a_known_input():
    expected = -(1 / math.sqrt(2) - 1) / 2
    loss, _ = simsiam_loss_fn(_identity_model(), V1, V2)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_simclr_loss_on_a_known_input_and_temperature_option():
    plugin = FedSimCLR(FedSimCLR.Options(temperature=0.5))
    z = torch.nn.functional.normalize(torch.cat([V1, V2]), dim=1)
    sim = (z @ z.t() / 0.5).tolist()
    total = 0.0
    for i in range(4):
        pos = (i + 2) % 4
        denominator = sum(math.exp(sim[i][j]) for j in range(4) if j != i)
        total += -math.log(math.exp(sim[i][pos]) / denominator)
    loss, _ = plugin.loss(_identity_model(predictor=False), V1, V2)
    assert loss.item() == pytest.approx(total / 4, abs=1e-5)


@pytest.mark.slow
def test_single_client_sends_nothing_keeps_its_model_and_scores_clients():
    raw = ssl_recipe(
        "fedbyol", "single_client", evaluation={"protocol": "knn", "every": 1, "personal": True}
    )
    run, spy = spied(raw)
    rows = run_rounds(run, 2)
    # every key is private: no tensor goes up or comes down, the pool holds nothing; only
    # the values clients report cross (booked as *_metrics)
    assert run.server.private == set(run.server.template.state_dict())
    assert all(up.tensors == {} for ups in spy.uploads.values() for up in ups)
    totals = run.server.ledger.totals()
    assert all(totals[f] == 0 for f in TENSOR_FIELDS)
    assert totals["total"] == totals["up_metrics"] + totals["eval_metrics"] > 0
    assert run.server.pool == [{}]
    for row in rows:
        scores = row["client_knn_accuracy"]
        assert set(scores) == {"0", "1", "2"}
        assert row["personalized_knn_accuracy"] == pytest.approx(sum(scores.values()) / 3)
        assert 0.0 <= row["knn_accuracy"] <= 1.0  # cluster 0's (untrained) encoder
    # a client's score is its own encoder's, as it left its last round
    model = copy.deepcopy(run.server.template)
    model.load_state_dict(kept_model(run, 1))
    train, test = run.evaluator.benchmark()
    cfg, seed = run.recipe.evaluation, run.recipe.seed
    own = score_encoder(model["encoder"], train, test, "knn", cfg, seed, run.server.device)
    assert rows[-1]["client_knn_accuracy"]["1"] == own["knn_accuracy"]


@pytest.mark.slow
def test_single_client_round_two_starts_from_its_own_round_one_model():
    run, spy = spied(ssl_recipe("fedsimsiam", "single_client"))
    run_rounds(run, 1)
    kept = {cid: kept_model(run, cid) for cid in range(3)}
    run_round(run, 2)
    for cid in range(3):
        assert set(kept[cid]) == set(run.server.template.state_dict())  # every key is private
        assert same_keys(spy.loaded[(2, cid)], kept[cid], kept[cid])


@pytest.mark.slow
def test_fedkit_eval_reproduces_the_runs_knn_and_scores_clients_and_transfer(tmp_path):
    import json

    import yaml
    from typer.testing import CliRunner

    from fedkit.cli.app import app

    raw = ssl_recipe("fedsimsiam", evaluation={"protocol": "knn", "every": 0})
    raw["data"]["max_test"] = 60
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    out = tmp_path / "run"
    cli = CliRunner()
    assert cli.invoke(app, ["run", str(recipe), "--out", str(out)]).exit_code == 0
    final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])

    def evaluate(*args):
        result = cli.invoke(app, ["eval", str(out), *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.output.strip().splitlines()[-1])

    assert evaluate("--protocol", "knn")["knn_accuracy"] == final["knn_accuracy"]
    # fedsimsiam clients keep nothing between rounds: a client's personal encoder is the
    # global one, so it scores the same; a client that never trained is an error
    assert evaluate("--protocol", "knn", "--client", "1")["knn_accuracy"] == final["knn_accuracy"]
    never = cli.invoke(app, ["eval", str(out), "--protocol", "knn", "--client", "99"])
    assert never.exit_code == 2 and "client 99 has not trained" in never.output
    semi = evaluate("--protocol", "semi", "--set", "evaluation.semi_epochs=1")
    assert set(semi) == {
        "dataset", "protocol", "client", "round", "semi_accuracy_1", "semi_accuracy_10",
    }  # fmt: skip
    transfer = evaluate("--protocol", "linear", "--dataset", "digits", "--set", "data.image_size=8")
    assert transfer["dataset"] == "digits" and 0 <= transfer["linear_accuracy"] <= 1
    kept = [json.loads(line) for line in (out / "evaluations.jsonl").read_text().splitlines()]
    assert [(e["protocol"], e["client"]) for e in kept] == [
        ("knn", None), ("knn", 1), ("semi", None), ("linear", None),
    ]  # fmt: skip
    assert kept[-1]["linear_accuracy"] == transfer["linear_accuracy"] and kept[-1]["round"] == 2
    assert cli.invoke(app, ["report", str(out)]).exit_code == 0
    page = (out / "report.html").read_text()
    assert "Offline evaluations" in page and "linear on digits (global, round 2)" in page
    assert cli.invoke(app, ["eval", str(out), "--protocol", "svm"]).exit_code == 2
    assert cli.invoke(app, ["eval", str(tmp_path / "nothing")]).exit_code == 2
    # a client that keeps its encoder (single_client: every key private) is scored as the
    # run scored it
    own = ssl_recipe("fedsimsiam", "single_client", rounds=1)
    own["evaluation"] = {"protocol": "knn", "every": 0, "personal": True}
    own["data"]["max_test"] = 60
    recipe.write_text(yaml.safe_dump(own))
    out = tmp_path / "own"
    assert cli.invoke(app, ["run", str(recipe), "--out", str(out)]).exit_code == 0
    per_client = json.loads((out / "clients.jsonl").read_text().splitlines()[-1])
    scored = evaluate("--protocol", "knn", "--client", "1")["knn_accuracy"]
    assert scored == per_client["client_knn_accuracy"]["1"]


@pytest.mark.slow
def test_knn_monitor_runs_every_few_rounds_beside_a_final_linear_probe():
    evaluation = {"protocol": "linear", "every": 0, "monitor_every": 2, "knn_k": 5}
    evaluation["linear_epochs"] = 5
    run = prepared(ssl_recipe("fedsimclr", rounds=4, evaluation=evaluation))
    rows = run_rounds(run, 4)
    assert [("knn_accuracy" in r, "linear_accuracy" in r) for r in rows] == [
        (False, False),
        (True, False),
        (False, False),
        (True, True),
    ]
    train, test = run.evaluator._pooled, run.evaluator.test
    encoder = run.server.model(0)["encoder"]
    expected = score_encoder(
        encoder, train, test, "knn", run.recipe.evaluation, 0, run.server.device
    )
    assert rows[-1]["knn_accuracy"] == expected["knn_accuracy"]


def test_the_knn_monitor_needs_a_representation_protocol():
    raw = ssl_recipe("fedsimclr", evaluation={"protocol": "supervised", "monitor_every": 2})
    with pytest.raises(RecipeError, match="monitor_every"):
        validate(raw)

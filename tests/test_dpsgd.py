"""DP-SGD on each client (plugins/dpsgd.py): each per-sample gradient clipped to C, seeded
Gaussian noise σ·C, terms of the parameters alone added back unclipped; plain training
when nothing clips and nothing is added; composition with fedprox and ifca; BatchNorm
refused before round 1; ε per client in clients.jsonl equal to opacus's accountant, and
carried across a resume."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import client_context, prepared, tiny_recipe
from torch import nn
from typer.testing import CliRunner

import fedkit
from fedkit.cli.app import app
from fedkit.errors import FedkitError, RecipeError
from fedkit.rundir.logs import read_clients
from fedkit.testing import run_recipe

pytest.importorskip("opacus", reason="the dp extra (opacus) is not installed")
from opacus.accountants import RDPAccountant  # noqa: E402

from fedkit_plugins.dpsgd import DPSGD, recorded  # noqa: E402

NO_BN = {"name": "niid_bench_cnn", "kwargs": {"image_size": 16}}
SGD = {"optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.0}}


def recipe(*plugins, dpsgd=None, rounds=2, backbone=NO_BN):
    specs = [*plugins] + ([{"dpsgd": dpsgd}] if dpsgd is not None else [])
    return tiny_recipe(
        plugins=specs or ["fedavg"],
        backbone=backbone,
        federation={"rounds": rounds, "batch_size": 32, **SGD},
        data={"max_train": 240},
        evaluation={"protocol": "none", "every": 0},
    )


# ------------------------------------------------------------------ one step, by hand


def tiny_model() -> nn.ModuleDict:
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.ReLU())
    return nn.ModuleDict({"encoder": encoder, "classifier": nn.Linear(6, 3)})


def batch(n=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 2, 2, generator=g), torch.randint(0, 3, (n,), generator=g)


def loss_of(model, x, y, reduction="mean"):
    return F.cross_entropy(model["classifier"](model["encoder"](x)), y, reduction=reduction)


def dp_step(model, c, sigma, term=None, client=7):
    """One step through the plugin's hooks: attach, forward, backward, before_step."""
    plugin = DPSGD(DPSGD.Options(max_grad_norm=c, noise_multiplier=sigma))
    ctx = client_context(recipe(), id=client)
    plugin.local_train(ctx, model)
    x, y = batch()
    total = loss_of(model, x, y) + (term(model) if term is not None else 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()
    total.backward()
    plugin.before_step(ctx, model, optimizer)
    grads = [p.grad.clone() for p in model.parameters()]
    plugin.after_local_train(ctx, model)
    return grads, ctx


def clipped_mean_by_hand(model, c):
    """Each sample's gradient on its own (a loop, no opacus), clipped to c, averaged."""
    x, y = batch()
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(y)):
        model.zero_grad()
        loss_of(model, x[i : i + 1], y[i : i + 1]).backward()
        g = [p.grad.clone() for p in model.parameters()]
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in g))
        scale = min(1.0, c / (norm + 1e-6))
        total = [a + scale * b for a, b in zip(total, g, strict=True)]
    return [t / len(y) for t in total]


def prox(model):
    return 0.05 * sum(p.pow(2).sum() for p in model.parameters())


def test_each_per_sample_gradient_is_clipped_before_the_mean():
    model = tiny_model()
    expected = clipped_mean_by_hand(model, c=0.05)
    grads, ctx = dp_step(model, c=0.05, sigma=0.0)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert math.sqrt(sum(float(g.pow(2).sum()) for g in grads)) <= 0.05 + 1e-6
    assert ctx.logged["dpsgd_clipped"] == 1.0  # every sample's norm is above 0.05
    assert not hasattr(next(model.parameters()), "grad_sample")  # hooks taken off


def test_a_term_of_the_parameters_alone_is_added_unclipped():
    model = tiny_model()
    expected = clipped_mean_by_hand(model, c=0.05)
    params = list(model.parameters())
    grads, _ = dp_step(model, c=0.05, sigma=0.0, term=prox)
    for got, want, p in zip(grads, expected, params, strict=True):
        torch.testing.assert_close(got, want + 0.1 * p.detach(), atol=1e-6, rtol=1e-5)


def test_noise_has_std_sigma_c_over_n_and_is_seeded_per_client_and_round():
    quiet, _ = dp_step(tiny_model(), c=0.05, sigma=0.0)
    loud, _ = dp_step(tiny_model(), c=0.05, sigma=4.0)
    again, _ = dp_step(tiny_model(), c=0.05, sigma=4.0)
    other, _ = dp_step(tiny_model(), c=0.05, sigma=4.0, client=8)
    assert all(torch.equal(a, b) for a, b in zip(loud, again, strict=True))
    assert not torch.equal(loud[0], other[0])
    noise = torch.cat([(a - b).flatten() for a, b in zip(loud, quiet, strict=True)])
    assert noise.std().item() == pytest.approx(4.0 * 0.05 / 8, rel=0.15)


def test_history_merges_rows_of_one_sigma_and_rate():
    history = recorded([], 1.0, 0.1, 5)
    history = recorded(recorded(history, 1.0, 0.1, 3), 2.0, 0.1, 4)
    assert history == [[1.0, 0.1, 8], [2.0, 0.1, 4]]


def test_noise_multiplier_and_target_epsilon_together_are_refused():
    raw = recipe("fedavg", dpsgd={"noise_multiplier": 1.0, "target_epsilon": 3.0})
    with pytest.raises(RecipeError, match="not both"):
        prepared(raw)


# ------------------------------------------------------------------ whole runs


def final_pool(raw):
    return run_recipe(raw).pool[0]


@pytest.mark.slow
def test_without_noise_and_clipping_it_is_plain_training():
    plain = final_pool(recipe("fedavg"))
    private = final_pool(recipe("fedavg", dpsgd={"max_grad_norm": 1e6, "noise_multiplier": 0}))
    for key in plain:
        torch.testing.assert_close(private[key], plain[key], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_seeded_noise_repeats_and_changes_training():
    noisy = recipe("fedavg", dpsgd={"max_grad_norm": 1.0, "noise_multiplier": 1.0}, rounds=1)
    a, b = final_pool(noisy), final_pool(noisy)
    plain = final_pool(recipe("fedavg", rounds=1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.allclose(a[k], plain[k]) for k in a)


@pytest.mark.slow
def test_composes_with_fedprox_and_its_term_stays():
    options = {"max_grad_norm": 1.0, "noise_multiplier": 0.5}
    rows = run_recipe(recipe("fedavg", {"fedprox": {"mu": 0.5}}, dpsgd=options)).rows
    assert all(r["train_loss_prox"] > 0 and r["train_dpsgd_epsilon"] > 0 for r in rows[1:])


@pytest.mark.slow
def test_composes_with_ifca():
    raw = recipe({"ifca": {"num_clusters": 2}}, dpsgd={"max_grad_norm": 1.0})
    raw["data"] |= {"num_clients": 4, "server_fraction": 0.2}
    rows = run_recipe(raw).rows
    clients = [v for r in rows for v in r["per_client"].values()]
    assert len(clients) == 6 and all(0 < v["dpsgd_epsilon"] < math.inf for v in clients)


@pytest.mark.slow
def test_batchnorm_is_refused_by_the_cli_in_one_line(write_recipe, tmp_path):
    path = write_recipe(recipe("fedavg", dpsgd={}, backbone={"name": "test_resnet"}))
    result = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "run")])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "plugins.dpsgd: expected a model without BatchNorm" in text
    assert "encoder.bn1" in text


def accountant_epsilons(rows, client, delta):
    """ε after each round from opacus's accountant, stepped once per logged step."""
    accountant, out = RDPAccountant(), []
    for row in rows:
        mine = row["per_client"][client]
        for _ in range(mine["dpsgd_steps"]):
            accountant.step(
                noise_multiplier=mine["dpsgd_noise_multiplier"],
                sample_rate=mine["dpsgd_sample_rate"],
            )
        out.append(accountant.get_epsilon(delta=delta))
    return out


@pytest.mark.slow
def test_epsilon_per_client_grows_equals_opacus_and_meets_the_target(tmp_path):
    raw = recipe("fedavg", dpsgd={"target_epsilon": 4.0, "delta": 1e-4}, rounds=3)
    fedkit.run(raw, out=tmp_path / "run")
    rows = read_clients(tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2, 3]
    for client in rows[0]["per_client"]:
        mine = [r["per_client"][client]["dpsgd_epsilon"] for r in rows]
        assert mine == sorted(mine) and mine[0] < mine[-1]
        assert mine == pytest.approx(accountant_epsilons(rows, client, 1e-4), abs=1e-9)
        assert 3.9 <= mine[-1] <= 4.0  # every client trained every round: the planned steps


@pytest.mark.slow
def test_accounting_resumes(write_recipe, tmp_path):
    path = write_recipe(recipe("fedavg", dpsgd={"noise_multiplier": 1.5}, rounds=2))
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    cli = CliRunner()
    assert cli.invoke(app, ["run", str(path), "--out", str(whole)]).exit_code == 0
    first = ["run", str(path), "--out", str(cut), "--set", "federation.rounds=1"]
    assert cli.invoke(app, first).exit_code == 0
    resumed = cli.invoke(app, ["run", "--resume", str(cut), "--set", "federation.rounds=2"])
    assert resumed.exit_code == 0, resumed.output
    assert read_clients(cut) == read_clients(whole)


def test_a_parameter_without_per_sample_gradients_is_refused():
    model = tiny_model()
    plugin = DPSGD(DPSGD.Options(max_grad_norm=1.0))
    ctx = client_context(recipe())
    plugin.local_train(ctx, model)
    loose = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([*model.parameters(), loose], lr=0.1)
    x, y = batch()
    (loss_of(model, x, y) + (loose * x.mean()).sum()).backward()
    with pytest.raises(FedkitError, match="no per-sample gradient"):
        plugin.before_step(ctx, model, optimizer)

"""FedCA: what a client uploads (features, counted as data-derived), how the server builds
the global dictionary, how the local loss uses it and the alignment term, and the CLI's
privacy warnings."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import client_context, kept_model, prepared, spied, tensor_bytes, tiny_recipe
from torch import nn
from typer.testing import CliRunner

import fedkit.cli.app
from fedkit.cli.app import app
from fedkit.core.engine import run_round
from fedkit.errors import RecipeError
from fedkit.plugin.registry import describe, discover
from fedkit.rundir import checkpoint
from fedkit.rundir.checkpoint import saved_part
from fedkit_plugins.fedca import (
    DICTIONARY,
    PUBLIC_FEATURES,
    PUBLIC_IMAGES,
    FedCA,
    FedCAOptions,
    alignment_loss,
    encode_dictionary,
    fedca_loss,
)

DIM = 8
BASE = {"epochs": 1, "batch_size": 16}


def fedca_recipe(rounds: int = 2, server_fraction: float = 0.2, **options):
    """3 clients on 120 digits images (16×16), 20% held by the server as public data."""
    opts = {"projector_hidden": 16, "projection_dim": DIM, "base": BASE, **options}
    return tiny_recipe(
        data={
            "max_train": 120,
            "server_fraction": server_fraction,
            "partition": {"name": "classes_per_client", "k": 4},
        },
        federation={"rounds": rounds, "batch_size": 16, "optimizer": {"name": "sgd", "lr": 0.05}},
        plugins=[{"fedca": opts}],
        evaluation={"protocol": "none", "every": 0},
    )


@pytest.fixture(scope="module")
def two_rounds():
    """One FedCA run of two rounds, shared by the tests that only look at it."""
    run, spy = spied(fedca_recipe())
    rows = [run_round(run, r) for r in (1, 2)]
    return run, spy, rows


def test_upload_holds_normalised_features_of_every_local_sample(two_rounds):
    run, spy, _ = two_rounds
    for upload in spy.uploads[2]:
        client = run.executor.clients[upload.client]
        feats = upload.tensors[DICTIONARY]
        assert feats.shape == (len(client.train), DIM) and feats.dtype == torch.float32
        assert torch.allclose(feats.norm(dim=1), torch.ones(len(feats)), atol=1e-5)
        model = run.server.model(0).cpu()
        model.load_state_dict(spy.trained[(2, client.id)])  # the encoder it just trained
        assert torch.equal(feats, encode_dictionary(model, client.train, torch.device("cpu")))


def test_ledger_counts_features_as_data_derived_to_the_byte(two_rounds):
    run, spy, _ = two_rounds
    model_bytes = tensor_bytes(run.server.pool[0][k] for k in run.server.model_keys)
    for upload in spy.uploads[2]:
        row = run.server.ledger.rows[(2, upload.client)]
        assert row["up_data"] == len(run.executor.clients[upload.client].train) * DIM * 4
        assert row["up_model"] == model_bytes and row["up_aux"] == 0
        assert set(upload.tensors) == run.server.model_keys | {DICTIONARY}


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as multisets of rows (order ignored)."""
    return len(a) == len(b) and torch.equal(torch.unique(a, dim=0), torch.unique(b, dim=0))


def test_the_global_dictionary_is_every_upload_and_goes_down_next_round(two_rounds):
    run, spy, _ = two_rounds
    bank = run.server.pool[0][DICTIONARY]
    assert same_rows(bank, torch.cat([u.tensors[DICTIONARY] for u in spy.uploads[2]]))
    clients = sorted(run.executor.clients)
    assert all(spy.received[(1, cid)].get(DICTIONARY) is None for cid in clients)
    sent = spy.received[(2, 0)][DICTIONARY]
    assert same_rows(sent, torch.cat([u.tensors[DICTIONARY] for u in spy.uploads[1]]))
    for cid in clients:
        assert torch.equal(spy.received[(2, cid)][DICTIONARY], sent)
        assert run.server.ledger.rows[(2, cid)]["down_data"] == len(sent) * DIM * 4


def test_public_data_and_base_model_stay_on_the_server(two_rounds):
    run, spy, _ = two_rounds
    assert set(run.server.template) == {"encoder", "projector"}
    public = run.server.own_data
    base = run.server.tensors["fedca_base/features"]  # kept by the core (server.once)
    assert set(run.server.tensors) == {"fedca_base/features"} and len(base) == len(public)
    once = len(public) * 3 * 16 * 16 + tensor_bytes([base])
    for cid in sorted(run.executor.clients):
        # sent once, on the first participation, and kept by the client
        first, second = spy.received[(1, cid)], spy.received[(2, cid)]
        assert set(first) - run.server.model_keys == {PUBLIC_IMAGES, PUBLIC_FEATURES}
        assert torch.equal(first[PUBLIC_IMAGES], public.images)
        assert torch.equal(first[PUBLIC_FEATURES], base)
        assert not {PUBLIC_IMAGES, PUBLIC_FEATURES} & set(second)
        assert set(run.executor.store.get(cid).tensors) == {PUBLIC_IMAGES, PUBLIC_FEATURES}
        assert kept_model(run, cid) == {}  # of its model, a client keeps nothing
        assert run.server.ledger.rows[(1, cid)]["down_data"] == once
    for ups in spy.uploads.values():
        for u in ups:
            assert not any("public" in k or "base" in k for k in u.tensors)


def test_samples_per_client_and_dictionary_size_cap():
    run, spy = spied(fedca_recipe(rounds=1, samples_per_client=10, dictionary_size=25))
    run_round(run, 1)
    uploads = spy.uploads[1]
    assert all(u.tensors[DICTIONARY].shape == (10, DIM) for u in uploads)
    assert all(run.server.ledger.rows[(1, u.client)]["up_data"] == 10 * DIM * 4 for u in uploads)
    bank = run.server.pool[0][DICTIONARY]
    everything = torch.cat([u.tensors[DICTIONARY] for u in uploads])
    assert bank.shape == (25, DIM)
    assert all((everything == row).all(dim=1).any() for row in bank)


def hand_nt_xent(views: list[list[float]], negatives: list[list[float]], tau: float) -> float:
    """NT-Xent written out: views are [a1, b1, a2, b2, ...] reordered as [a.., b..]."""

    def unit(v):
        n = math.sqrt(sum(x * x for x in v))
        return [x / n for x in v]

    z = [unit(v) for v in views]
    bank = [unit(v) for v in negatives]
    n = len(z) // 2
    total = 0.0
    for i in range(2 * n):
        pos = (i + n) % (2 * n)
        sims = [sum(a * b for a, b in zip(z[i], z[j], strict=True)) for j in range(2 * n) if j != i]
        sims += [sum(a * b for a, b in zip(z[i], d, strict=True)) for d in bank]
        s_pos = sum(a * b for a, b in zip(z[i], z[pos], strict=True))
        total += -s_pos / tau + math.log(sum(math.exp(s / tau) for s in sims))
    return total / (2 * n)


def linear_model() -> nn.ModuleDict:
    return nn.ModuleDict({"encoder": nn.Flatten(), "projector": nn.Identity()})


V1 = [[1.0, 0.0], [0.0, 1.0]]
V2 = [[1.0, 1.0], [0.5, 1.0]]


def client_with(dictionary, **tensors):
    """A client context that received ``dictionary`` (if any) and keeps ``tensors``."""
    received = {} if dictionary is None else {DICTIONARY: torch.tensor(dictionary)}
    return client_context(fedca_recipe(), received=received, tensors=tensors)


def local_loss(plugin: FedCA, ctx, model: nn.ModuleDict, v1, v2) -> torch.Tensor:
    """The plugin's objective on one batch of two views (as the core fit loop computes it)."""
    loss, _ = plugin.local_objective(ctx, model).loss(model, (v1, v2))
    return loss


def test_local_loss_uses_the_received_dictionary_as_hand_computed():
    plugin = FedCA(FedCAOptions(temperature=0.5, alignment=False))
    v1, v2 = torch.tensor(V1), torch.tensor(V2)
    losses = {}
    for name, dictionary in [("none", None), ("d1", [[-1.0, 0.0]]), ("d2", [[3.0, 1.0], [0, -2]])]:
        loss = local_loss(plugin, client_with(dictionary), linear_model(), v1, v2)
        expected = hand_nt_xent(V1 + V2, dictionary or [], 0.5)
        assert loss.item() == pytest.approx(expected, rel=1e-6)
        losses[name] = loss.item()
    assert len({round(v, 6) for v in losses.values()}) == 3


def test_dictionary_off_ignores_what_was_received():
    plugin = FedCA(FedCAOptions(temperature=0.5, alignment=False, dictionary=False))
    ctx = client_with([[-1.0, 0.0]])
    loss = local_loss(plugin, ctx, linear_model(), torch.tensor(V1), torch.tensor(V2))
    assert loss.item() == pytest.approx(hand_nt_xent(V1 + V2, [], 0.5), rel=1e-6)


def test_alignment_loss_is_the_mean_squared_distance_to_the_base_features():
    h = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    base = torch.tensor([[0.0, 0.0], [3.0, 1.0]])
    assert alignment_loss(h, base).item() == pytest.approx((1 + 4 + 9 + 4) / 2)
    z1, z2 = torch.tensor(V1), torch.tensor(V2)
    total = fedca_loss(z1, z2, 0.5, None, h, base, align_weight=0.1)
    assert total.item() == pytest.approx(hand_nt_xent(V1 + V2, [], 0.5) + 0.1 * 9.0, rel=1e-6)


def test_local_loss_adds_weighted_alignment_on_public_images():
    plugin = FedCA(FedCAOptions(temperature=0.5, align_weight=0.25, public_batch=8))
    pixels = torch.tensor([[255, 0, 0], [0, 255, 255]], dtype=torch.uint8)
    # what the client kept from its first download; normalised with mean 0, std 1
    ctx = client_with(
        [[0.0, 0.0, 1.0]],
        **{
            PUBLIC_IMAGES: pixels.view(2, 3, 1, 1),
            PUBLIC_FEATURES: torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
        },
    )
    v1 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]).view(2, 3, 1, 1)
    v2 = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]]).view(2, 3, 1, 1)
    model = linear_model()
    contrastive = local_loss(plugin, ctx, model, v1, v2)
    terms = plugin.loss_terms(ctx, model, (v1, v2))
    assert set(terms) == {"align"}  # logged as loss_align
    align = (0 + 1 + 0) + (0 + 1 + 1)
    nt_xent = hand_nt_xent(v1.view(2, 3).tolist() + v2.view(2, 3).tolist(), [[0.0, 0.0, 1.0]], 0.5)
    assert contrastive.item() == pytest.approx(nt_xent, rel=1e-6)
    assert terms["align"].item() == pytest.approx(0.25 * align / 2, rel=1e-6)
    total = contrastive + sum(terms.values())  # what the core fit loop minimises
    assert total.item() == pytest.approx(nt_xent + 0.25 * align / 2, rel=1e-6)
    off = FedCA(FedCAOptions(temperature=0.5, alignment=False))
    assert not off.loss_terms(ctx, model, (v1, v2))


def test_alignment_needs_a_public_split():
    with pytest.raises(RecipeError, match="server_fraction"):
        prepared(fedca_recipe(server_fraction=0.0))
    run = prepared(fedca_recipe(server_fraction=0.0, alignment=False))
    assert run.server.tensors == {}  # no base model trained
    assert run.plugins.claims("downlink", server=run.server, client=run.server.roster[0]) == {}


def test_plugins_lists_fedca_as_uploading_data_derived_tensors(monkeypatch):
    monkeypatch.setattr(fedkit.cli.app.console, "width", 250)  # one line per plugin
    assert describe(discover()["fedca"]).uploads_data_derived
    result = CliRunner().invoke(app, ["plugins"], terminal_width=200)
    line = next(ln for ln in result.output.splitlines() if "fedca" in ln)
    assert "yes" in line
    fedsimclr = next(ln for ln in result.output.splitlines() if "fedsimclr" in ln)
    assert "yes" not in fedsimclr


def test_run_warns_and_keeps_the_base_features_in_its_checkpoint(write_recipe, tmp_path):
    out = tmp_path / "run"
    raw = fedca_recipe(rounds=1)
    raw["data"]["max_train"] = 60
    result = CliRunner().invoke(app, ["run", str(write_recipe(raw)), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "warning" in result.output and "'fedca' uploads data-derived" in result.output
    kept = saved_part(out, "", "fedca_base", "server")
    public = checkpoint.read(out).server_state["fedca"]["public_images"]
    assert set(kept) == {"features"} and len(kept["features"]) == public > 0
    assert not (out / "fedca-base.safetensors").exists()


@pytest.mark.slow
def test_resume_reuses_the_saved_base_encoder_and_matches(tmp_path, monkeypatch):
    import fedkit_plugins.fedca as fedca_module
    from fedkit.config.schema import validate
    from fedkit.core import runs

    recipe = validate(fedca_recipe(rounds=2))
    full = runs.start(recipe, tmp_path / "full")
    runs.execute(full, tmp_path / "full")
    half = runs.start(recipe, tmp_path / "half")
    runs.commit(half, tmp_path / "half", [run_round(half, 1)], 1)

    def no_training(*args, **kwargs):
        raise AssertionError("the base encoder was trained again on resume")

    monkeypatch.setattr(fedca_module, "pretrain_encoder", no_training)
    resumed, done = runs.resume(tmp_path / "half")
    runs.execute(resumed, tmp_path / "half", done)
    for key, value in full.server.pool[0].items():
        assert torch.equal(value, resumed.server.pool[0][key]), key

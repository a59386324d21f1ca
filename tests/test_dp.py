"""DP-FedAvg: every upload's update is clipped to C, the server's noise has standard
deviation σ·C/K, ε is opacus's RDP value for the same (q, σ, steps), and non-model
uploads are refused."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import prepared, spied, tiny_recipe

from fedkit import hookimpl
from fedkit.core.engine import run_round
from fedkit.errors import RecipeError

pytest.importorskip("opacus", reason="the dp extra (opacus) is not installed")
from opacus.accountants import RDPAccountant  # noqa: E402

CLIP, SIGMA = 0.5, 0.8


def dp_recipe(*plugins, clip=CLIP, sigma=SIGMA, **changes):
    return tiny_recipe(
        plugins=[*plugins, {"dp": {"clip": clip, "noise_multiplier": sigma}}],
        data={"num_clients": 6, "max_train": 300},
        federation={"rounds": 2, "clients_per_round": 3, "optimizer": {"name": "sgd", "lr": 0.1}},
        **changes,
    )


class Idle:
    """Trains nothing: every client's update is exactly zero."""

    @hookimpl
    def local_train(self, ctx, model):
        ctx.log(loss=0.0)
        return True


class SendsFeatures:
    @hookimpl
    def upload_selection(self, ctx, local, model):
        return {"features.mean": torch.ones(3)}


def norm(update: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in update.values()))


@pytest.mark.slow
def test_every_upload_is_within_the_clipping_bound():
    run, spy = spied(dp_recipe("fedavg"))
    rows = [run_round(run, r) for r in (1, 2)]
    clipped = 0
    for r in (1, 2):
        for up in spy.uploads[r]:
            received = spy.received[(r, up.client)]
            update = {
                k: up.tensors[k] - received[k]
                for k in up.tensors
                if up.tensors[k].is_floating_point()
            }
            assert norm(update) <= CLIP * (1 + 1e-6)
            raw = rows[r - 1]["per_client"][str(up.client)]["dp_update_norm"]
            clipped += raw > CLIP
            assert norm(update) == pytest.approx(min(raw, CLIP), rel=1e-5)
    assert clipped > 0  # the bound was active, not vacuous


def test_noise_standard_deviation_is_sigma_c_over_k():
    run = prepared(dp_recipe("fedavg", "idle", clip=2.0, sigma=1.5), idle=Idle)
    before = {k: v.clone() for k, v in run.server.pool[0].items()}
    run_round(run, 1)
    noise = torch.cat(
        [
            (run.server.pool[0][k].double() - before[k].double()).flatten()
            for k in before
            if before[k].is_floating_point()
        ]
    )
    expected = 1.5 * 2.0 / 3  # σ·C/K with K = 3 clients
    assert noise.numel() > 50_000
    assert noise.std().item() == pytest.approx(expected, rel=0.02)
    assert abs(noise.mean().item()) < 0.02 * expected


def test_epsilon_matches_opacus_rdp_accountant_every_round():
    run = prepared(dp_recipe("fedavg", "idle"), idle=Idle)
    for r in (1, 2):
        row = run_round(run, r)
        accountant = RDPAccountant()
        for _ in range(r):
            accountant.step(noise_multiplier=SIGMA, sample_rate=3 / 6)
        assert row["dp_epsilon"] == pytest.approx(accountant.get_epsilon(delta=1e-5), rel=1e-12)
        assert row["dp_delta"] == 1e-5


def test_noise_is_seeded_so_runs_repeat():
    a, b = prepared(dp_recipe("fedavg")), prepared(dp_recipe("fedavg"))
    run_round(a, 1), run_round(b, 1)
    assert all(torch.equal(a.server.pool[0][k], b.server.pool[0][k]) for k in a.server.pool[0])


def test_non_model_uploads_are_refused_with_a_clear_error():
    run = prepared(dp_recipe("fedavg", "feats"), feats=SendsFeatures)
    with pytest.raises(RecipeError, match="dp.*features.mean"):
        run_round(run, 1)

"""Robust aggregation (plugins/defences.py): each defence's arithmetic on hand-made updates
against its paper's definition, ties and even counts, the f/n bounds refused before round
1 and in a round, the detection log (``flagged``, ``defence``), and tiny runs (one with
IFCA's clusters)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_recipe
from torch import nn

from fedkit import RecipeError, Upload
from fedkit.config.schema import validate
from fedkit.data import ImageSet
from fedkit.plugin.server import Server, ServerRecord
from fedkit.testing import run_recipe
from fedkit_plugins import defences as d


def rows(*values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# ---------------------------------------------------------------- arithmetic


def test_median_odd_and_even_counts():
    assert d.coordinate_median(rows([1, -1], [5, 7], [2, 0])).tolist() == [2, 0]
    # even: the mean of the two middle values, per coordinate
    assert d.coordinate_median(rows([1, 0], [4, 0], [2, 1], [10, 1])).tolist() == [3, 0.5]
    assert d.coordinate_median(rows([3, 3], [3, 3])).tolist() == [3, 3]  # ties


def test_trimmed_mean_drops_floor_beta_n_from_each_end():
    values = rows([1, 5], [2, 5], [3, 5], [4, 5], [100, -100])
    assert d.trimmed_mean(values, 1).tolist() == [3, 5]  # β = 0.2, n = 5: one each side
    assert d.trimmed_mean(values, 0).tolist() == [22, -16]  # plain mean
    with pytest.raises(ValueError, match="leaves none"):
        d.trimmed_mean(rows([1], [2]), 1)


def test_krum_scores_and_ties_by_client_id():
    points = rows([0], [1], [2], [3], [100])  # n = 5, f = 1: the 2 nearest others
    scores = d.krum_scores(points, f=1).tolist()
    assert scores[:4] == [1 + 4, 1 + 1, 1 + 1, 1 + 4]
    assert scores[4] == 97**2 + 98**2
    # rows 1 and 2 tie: the lower client id wins, whatever the row order
    update, left_out = d.multi_krum(points, 1, 1, ids=[10, 11, 12, 13, 14])
    assert update.tolist() == [1] and left_out == [0, 2, 3, 4]
    update, left_out = d.multi_krum(points, 1, 1, ids=[14, 13, 12, 11, 10])
    assert update.tolist() == [2] and left_out == [0, 1, 3, 4]
    # Multi-Krum m = 3: rows 1, 2, then the tie 0 / 3 (score 5) goes to the lower id
    update, left_out = d.multi_krum(points, 1, 3, ids=[10, 11, 12, 13, 14])
    assert update.tolist() == [1.0] and left_out == [3, 4]
    update, left_out = d.multi_krum(points, 1, 3, ids=[14, 13, 12, 11, 10])
    assert update.tolist() == [2.0] and left_out == [0, 4]


def test_bulyan_picks_by_krum_then_averages_the_beta_closest_to_the_median():
    # n = 7, f = 1: θ = 5 picks (2, then 1 before 3 by id, 3, 0 before 4, 4), β = 3
    points = rows([0, 0], [1, 10], [2, 0], [3, 0], [4, 0], [50, 0], [-50, 0])
    update, left_out = d.bulyan(points, 1, ids=list(range(7)))
    assert left_out == [5, 6]
    # coordinate 0: picked {0..4}, median 2, closest three 2, 1, 3; coordinate 1:
    # picked {0, 10, 0, 0, 0}, median 0, closest three all 0
    assert update.tolist() == [2, 0]


def test_geometric_median_is_smoothed_weiszfeld():
    points, weights = rows([0], [1], [10]), torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64)
    v, beta = d.geometric_median(points, weights, nu=1e-6, iterations=1)
    alpha = [0.25, 0.25, 0.5]
    start = 0.25 * 0 + 0.25 * 1 + 0.5 * 10
    b = [a / abs(start - p) for a, p in zip(alpha, (0, 1, 10), strict=True)]
    assert v.item() == pytest.approx(
        sum(bi * p for bi, p in zip(b, (0, 1, 10), strict=True)) / sum(b)
    )
    assert beta.sum().item() == pytest.approx(1)
    # many iterations: in one dimension the geometric median is the (weighted) median
    v, _ = d.geometric_median(rows([0], [1], [10]), torch.ones(3, dtype=torch.float64), 1e-9, 200)
    assert v.item() == pytest.approx(1, abs=1e-4)
    # ν bounds the weight of a point the estimate sits on
    v, beta = d.geometric_median(rows([1], [1], [1]), torch.ones(3, dtype=torch.float64), 1e-6, 3)
    assert v.item() == 1 and beta.tolist() == pytest.approx([1 / 3] * 3)


def test_buckets_and_centred_clipping():
    generator = torch.Generator().manual_seed(0)
    buckets = d.buckets_of(5, 2, generator)
    assert sorted(len(b) for b in buckets) == [1, 2, 2]
    assert sorted(i for b in buckets for i in b) == list(range(5))
    v, clipped = d.centred_clip(rows([3, 4]), torch.zeros(2, dtype=torch.float64), 1.0, 1)
    assert v.tolist() == pytest.approx([0.6, 0.8]) and clipped == [0]
    v, clipped = d.centred_clip(rows([0.5, 0], [10, 0]), torch.zeros(2, dtype=torch.float64), 1, 1)
    assert v.tolist() == [0.75, 0] and clipped == [1]  # (0.5 + 10·(1/10)) / 2


def test_fltrust_trust_scores_and_rescaling():
    updates = rows([2, 0], [0, 3], [-1, 0], [1, 1])
    update, trust = d.fltrust(updates, torch.tensor([1.0, 0.0], dtype=torch.float64))
    root = math.sqrt(0.5)
    assert trust.tolist() == pytest.approx([1, 0, 0, root])
    expected = [(1 + root * root) / (1 + root), (root * root) / (1 + root)]
    assert update.tolist() == pytest.approx(expected)
    nobody, trust = d.fltrust(rows([-1, 0]), torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert nobody.tolist() == [0, 0] and trust.tolist() == [0]


def test_fltrusts_server_takes_the_median_clients_steps():
    # clients of 1000, 640 and 10 samples, 2 epochs of 64: 32, 20 and 2 steps; median 20
    assert d.matched_epochs([1000, 640, 10], 2, 64, False, own=100) == 10  # 2 steps an epoch
    assert d.matched_epochs([1000, 640, 10], 2, 64, True, own=100) == 20  # 1 (drop_last)
    assert d.matched_epochs([10, 10], 1, 64, False, own=500) == 1  # never fewer than one
    assert d.matched_epochs([640, 640, 10**9], 1, 64, False, own=640) == 1  # one liar moves nothing


def test_flame_keeps_the_majority_clips_to_the_median_norm_and_adds_lambda_s_noise():
    updates = rows([1, 0], [2, 0.01], [3, 0], [4, 0.02], [-5, 0.1])
    generator = torch.Generator().manual_seed(0)
    mean, admitted, s, noise = d.flame(updates, updates, 0.0, generator)
    assert admitted == [0, 1, 2, 3]
    norms = updates.norm(dim=1)
    assert s == pytest.approx(float(norms.sort().values[2]))  # the median of all five norms
    scale = (s / norms[:4]).clamp(max=1)
    assert mean.tolist() == pytest.approx((scale[:, None] * updates[:4]).mean(0).tolist())
    assert noise.abs().sum() == 0
    _, _, _, noise = d.flame(updates, updates, 0.5, torch.Generator().manual_seed(0))
    expected = torch.randn(2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert noise.tolist() == pytest.approx((expected * 0.5 * s).tolist())


# ---------------------------------------------------------------- hooks on a hand-made server


def hand_server(plugins: list, n: int = 3, pool: list | None = None, **data) -> Server:
    recipe = validate(
        tiny_recipe(
            plugins=plugins,
            data={"num_clients": n, **data},
            federation={"clients_per_round": n},
        )
    )
    empty = ImageSet(
        torch.zeros(0, 3, 1, 1, dtype=torch.uint8), torch.zeros(0, dtype=torch.long),
        ["a", "b"], (0.0, 0.0, 0.0), (1.0, 1.0, 1.0),
    )  # fmt: skip
    record = ServerRecord(recipe, torch.device("cpu"), ["a", "b"], empty, [])
    template = nn.ModuleDict({"lin": nn.Linear(2, 1)})
    record.template, record.round = template, 1
    record.pool = pool or [{"lin.weight": torch.zeros(1, 2), "lin.bias": torch.ones(1)}]
    record.ledger.model_keys = frozenset(template.state_dict())
    return Server(record)


def upload(client: int, w: list[float], b: float, weight: float = 10) -> Upload:
    return Upload(client, weight, {"lin.weight": torch.tensor([w]), "lin.bias": torch.tensor([b])})


def test_a_defence_claims_previous_plus_robust_update_and_logs_what_it_flagged():
    server = hand_server(["fedavg", "krum"], n=5)
    krum = d.Krum(d.Krum.Options(f=1, m=1))
    sent = [upload(c, [c, 0], 1 + c) for c in range(4)] + [upload(4, [100, 100], -99)]
    out = krum.aggregate(server, 0, sent)
    # updates (c, 0, c) for c < 4 and (100, 100, -100): Krum picks client 1 (tie with 2)
    assert out["lin.weight"].tolist() == [[1, 0]] and out["lin.bias"].tolist() == [2]
    assert server._record.row == {"flagged": [0, 2, 3, 4], "defence": "krum"}
    # a second cluster in the same round: its flagged clients join the list
    server._record.pool.append({"lin.weight": torch.zeros(1, 2), "lin.bias": torch.zeros(1)})
    more = [upload(c, [0, 0], 0) for c in (5, 6, 7, 8)] + [upload(9, [9, 9], 9)]
    krum.aggregate(server, 1, more)
    assert server._record.row["flagged"] == [0, 2, 3, 4, 6, 7, 8, 9]
    server._record.round, server._record.row = 2, {}  # a new round starts a new list
    krum.aggregate(server, 1, more)
    assert server._record.row["flagged"] == [6, 7, 8, 9]


def test_median_leaves_integer_and_non_model_keys_to_the_core_and_skips_empty_clients():
    pool = [{"lin.weight": torch.zeros(1, 2), "lin.bias": torch.zeros(1), "n": torch.tensor(3)}]
    server = hand_server(["fedavg", "median"], n=4, pool=pool)
    sent = [
        Upload(c, 1, {"lin.weight": torch.full((1, 2), float(v)), "lin.bias": torch.zeros(1),
                      "n": torch.tensor(c), "extra": torch.ones(1)})
        for c, v in enumerate([1, 4, 2, 10])
    ] + [Upload(9, 0, {"lin.weight": torch.zeros(1, 2), "lin.bias": torch.zeros(1)})]  # fmt: skip
    out = d.Median(d.Median.Options()).aggregate(server, 0, sent)
    assert set(out) == {"lin.weight", "lin.bias"} and out["lin.weight"].tolist() == [[3, 3]]
    assert server._record.row == {"flagged": [], "defence": "median"}


def test_bucketing_clips_bucket_means_around_last_rounds_update():
    server = hand_server(["fedavg", "bucketing"], n=4)
    sent = [upload(c, [v, 0], 1) for c, v in enumerate([1.0, 2.0, 4.0, 10.0])]
    wide = d.Bucketing(d.Bucketing.Options(s=2, tau=100.0))
    out = wide.aggregate(server, 0, sent)  # nothing clipped: the mean of two bucket means
    assert out["lin.weight"].tolist() == [[4.25, 0]] and server._record.row["flagged"] == []
    assert server.tensors["bucketing/0/centre"].tolist() == [0, 4.25, 0]  # keys sorted
    server._record.round = 2
    tight = d.Bucketing(d.Bucketing.Options(s=2, tau=0.5))
    out = tight.aggregate(server, 0, sent)  # any pairing: bucket means ≥ 1.25 away
    moved = out["lin.weight"][0, 0].item() - 4.25
    assert abs(moved) <= 0.5 and server._record.row["flagged"] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("plugin", "options", "n", "bound"),
    [("krum", {"f": 1}, 4, "n > 2f+2 = 4 and n ≥ m = 1"), ("bulyan", {"f": 1}, 6, "n ≥ 4f+3 = 7")],
)
def test_f_n_bounds_refused_before_round_1_and_in_a_round(plugin, options, n, bound):
    server = hand_server(["fedavg", {plugin: options}], n=n)
    cls = {"krum": d.Krum, "bulyan": d.Bulyan}[plugin]
    defence = cls(cls.Options(**options))
    with pytest.raises(RecipeError, match="plugins.1." + plugin) as refused:
        defence.configure(server)
    message = str(refused.value)
    assert f"{bound} for {plugin} with f = 1" in message and f"n = {n}" in message
    assert "federation.clients_per_round" in message
    big = hand_server(["fedavg", {plugin: options}], n=7)
    defence.configure(big)  # 7 clients a round: within both bounds
    with pytest.raises(RecipeError, match="round 1's cluster 0 has n = 3"):
        defence.aggregate(big, 0, [upload(c, [0, 0], 0) for c in range(3)])


def test_multi_krum_refuses_m_above_the_cohort():
    server = hand_server(["fedavg", {"krum": {"f": 0, "m": 4}}], n=3)
    with pytest.raises(RecipeError, match="n ≥ m = 4"):
        d.Krum(d.Krum.Options(f=0, m=4)).configure(server)


def test_fltrust_refuses_a_run_without_a_server_split():
    server = hand_server(["fedavg", "fltrust"])
    with pytest.raises(RecipeError, match="data.server_fraction"):
        d.FLTrust(d.FLTrust.Options()).configure(server)


def test_flame_noise_only_on_trainable_parameters_and_flags_the_minority():
    pool = [{"lin.weight": torch.zeros(1, 2), "lin.bias": torch.zeros(1), "bn": torch.zeros(1)}]
    server = hand_server(["fedavg", {"flame": {"lam": 0.1}}], n=5, pool=pool)
    server._record.ledger.model_keys = frozenset({"lin.weight", "lin.bias", "bn"})
    sent = [
        Upload(c, 1, {"lin.weight": torch.full((1, 2), 1.0 + c), "lin.bias": torch.zeros(1),
                      "bn": torch.tensor([1.0 + c])})
        for c in range(4)
    ] + [Upload(4, 1, {"lin.weight": torch.tensor([[-5.0, -5.0]]), "lin.bias": torch.zeros(1),
                       "bn": torch.ones(1)})]  # fmt: skip
    flame = d.FLAME(d.FLAME.Options(lam=0.1, cosine_on="updates"))
    out = flame.aggregate(server, 0, sent)
    assert server._record.row["flagged"] == [4]
    # a buffer: the clipped mean (S = the median norm, 3·√3; client c's norm (1+c)·√3)
    assert out["bn"].item() == pytest.approx((1 + 2 + 3 + 3) / 4)
    assert out["lin.bias"].item() != 0  # a parameter: noise λ·S


# ---------------------------------------------------------------- tiny runs


@pytest.mark.slow
def test_defences_in_tiny_runs_with_ifca_clusters_and_a_server_split():
    clustered = run_recipe(
        tiny_recipe(
            plugins=[{"ifca": {"num_clusters": 2, "random_rounds": 2}}, "median"],
            data={"num_clients": 4},
            federation={"clients_per_round": 4},
        )
    )
    assert all(set(r["clusters"].values()) == {0, 1} for r in clustered.rows)  # both aggregated
    assert all(r["defence"] == "median" and r["flagged"] == [] for r in clustered.rows)
    trusted = run_recipe(tiny_recipe(plugins=["fedavg", "fltrust"], data={"server_fraction": 0.2}))
    for row in trusted.rows:
        assert row["defence"] == "fltrust" and row["fltrust_reference_norm"] > 0
        assert row["fltrust_epochs"] >= 1
        assert row["flagged"] == sorted(row["flagged"])

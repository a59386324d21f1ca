"""Attacks (plugins/attacks.py) against their papers' definitions on hand-made updates, the
malicious set as simulation truth no server hook sees, and detection scored against it."""

from __future__ import annotations

import math
from statistics import NormalDist
from types import SimpleNamespace

import pytest
import torch
from conftest import prepared
from torch import nn

from fedkit import ImageSet, RecipeError, Upload, hookimpl
from fedkit.cli.report import detection_html
from fedkit.config.schema import validate
from fedkit.core import truth
from fedkit.core.engine import run_round
from fedkit.errors import FedkitError, PluginError
from fedkit.plugin.adversary import Adversary
from fedkit.plugin.server import Server
from fedkit.testing import tiny_recipe
from fedkit_plugins import attacks
from fedkit_plugins.attacks import (
    IPM,
    Backdoor,
    GaussianNoise,
    LabelFlip,
    MinMax,
    SignFlip,
    malicious_set,
    min_max_or_sum,
    z_max,
)


def options(cls, **values):
    return cls(cls.Options(**values))


def client(cid: int, received: dict, num_clients: int = 3, per_round: int = 3):
    """What the client-side attack hooks read of a context."""
    recipe = SimpleNamespace(
        data=SimpleNamespace(num_clients=num_clients),
        federation=SimpleNamespace(clients_per_round=per_round),
    )
    return SimpleNamespace(id=cid, round=1, recipe=recipe, received=received)


def test_the_malicious_set_follows_from_fraction_and_seed_alone():
    first = malicious_set(10, 0.2, 7)
    assert first == malicious_set(10, 0.2, 7) and len(first) == 2
    assert len(malicious_set(10, 0.25, 7)) == 2  # rounded down
    assert len(malicious_set(10, 0.3, 7)) == 3 and malicious_set(10, 0.0, 7) == []
    assert {tuple(malicious_set(10, 0.5, s)) for s in range(5)} != {tuple(first)}
    plugin = options(LabelFlip, fraction=0.2, seed=7)  # both sides decide the same set
    assert plugin.malicious_clients(SimpleNamespace(data=SimpleNamespace(num_clients=10))) == first
    assert [c for c in range(10) if plugin.malicious(client(c, {}, 10))] == first


def test_alie_is_mean_minus_z_max_std_of_the_malicious_updates():
    # n = 10, f = 2: s = floor(10/2 + 1) - 2 = 4, z_max = inv_cdf((10 - 4)/10)
    assert z_max(10, 2) == pytest.approx(NormalDist().inv_cdf(0.6))
    assert z_max(50, 12) == pytest.approx(NormalDist().inv_cdf(36 / 50))
    assert z_max(2, 1) == 0.0 and z_max(1, 1) == 0.0
    own = torch.tensor([[1.0, 2.0], [3.0, 6.0]], dtype=torch.float64)  # mean (2, 4), std (1, 2)
    z = z_max(10, 2)
    assert torch.allclose(attacks.alie(own, z), torch.tensor([2 - z, 4 - 2 * z]).double())


def test_ipm_is_minus_epsilon_times_the_benign_mean():
    benign = torch.tensor([[1.0, 0.0], [3.0, 2.0]])
    assert torch.equal(attacks.ipm(benign, 0.5), torch.tensor([-1.0, -0.5]))


def test_min_max_and_min_sum_find_the_papers_gamma():
    benign = torch.tensor([[0.0], [1.0], [4.0]], dtype=torch.float64)  # mean 5/3, ∇p = -1
    # min-max: max_i (m - b_i)^2 = (7/3 + γ)^2 <= max pairwise 16  →  γ = 5/3, m = 0
    found = min_max_or_sum(benign, "unit_vec", "max")
    assert found.item() == pytest.approx(0.0, abs=1e-4)
    # min-sum: 78/9 + 3γ^2 <= max_i Σ_j (b_i - b_j)^2 = 25  →  γ = 7/3, m = -2/3
    found = min_max_or_sum(benign, "unit_vec", "sum")
    assert found.item() == pytest.approx(-2 / 3, abs=1e-4)
    two = torch.tensor([[1.0, -2.0], [3.0, -4.0]], dtype=torch.float64)
    assert torch.equal(attacks.perturbation(two, "sign"), torch.tensor([-1.0, 1.0]).double())
    assert torch.allclose(attacks.perturbation(two, "std"), -two.std(0))
    unit = attacks.perturbation(two, "unit_vec")
    assert torch.allclose(unit, -two.mean(0) / two.mean(0).norm())


def test_crafted_uploads_replace_only_the_malicious_clients():
    state = {"w": torch.zeros(1), "n": torch.tensor(5)}
    ups = [Upload(c, 10.0, {"w": torch.tensor([float(v)]), "n": torch.tensor(6)}) for c, v in
           [(0, 0.0), (1, 1.0), (2, 4.0), (3, 9.0)]]  # fmt: skip
    adversary = SimpleNamespace(pool=[state], malicious=frozenset({3}))
    out = options(MinMax).attack_uploads(adversary, 0, ups)
    assert out[:3] == ups[:3] and out[3].tensors["w"].item() == pytest.approx(0.0, abs=1e-4)
    assert out[3].tensors["n"] is ups[3].tensors["n"]  # an integer buffer is left alone
    out = options(IPM, epsilon=0.5).attack_uploads(adversary, 0, ups)
    assert out[3].tensors["w"].item() == pytest.approx(-0.5 * 5 / 3)


def test_sign_flip_and_gaussian_noise_replace_the_clients_update():
    received = {"w": torch.ones(20000), "n": torch.tensor(1)}
    upload = {"w": torch.full((20000,), 3.0), "n": torch.tensor(2)}
    flip = options(SignFlip, fraction=1 / 3, seed=0, scale=2.0)
    bad = malicious_set(3, 1 / 3, 0)[0]
    sent = flip.process_upload(client(bad, received), upload)
    assert torch.equal(sent["w"], torch.full((20000,), -3.0)) and sent["n"] is upload["n"]
    assert (
        flip.process_upload(client(next(c for c in range(3) if c != bad), received), upload) is None
    )
    noise = options(GaussianNoise, fraction=1 / 3, seed=0, std=0.5)
    sent = noise.process_upload(client(bad, received), upload)["w"] - 1
    assert abs(sent.mean().item()) < 0.02 and sent.std().item() == pytest.approx(0.5, rel=0.03)


def images(labels: list[int]) -> ImageSet:
    n = len(labels)
    return ImageSet(torch.zeros(n, 3, 8, 8, dtype=torch.uint8), torch.tensor(labels),
                    ["a", "b", "c"], (0.5,) * 3, (0.25,) * 3)  # fmt: skip


def test_label_flipping_maps_y_to_c_minus_one_minus_y():
    flip = options(LabelFlip, fraction=1 / 3, seed=0)
    bad = malicious_set(3, 1 / 3, 0)[0]
    data = images([0, 1, 2, -1])
    assert flip.training_data(client(bad, {}), data).labels.tolist() == [2, 1, 0, -1]
    assert data.labels.tolist() == [0, 1, 2, -1]  # the client's own set is not changed
    assert flip.training_data(client((bad + 1) % 3, {}), data) is None


def test_backdoor_poisons_scales_and_measures_its_success():
    door = options(Backdoor, fraction=1 / 3, seed=0, target=2, poison_fraction=0.5, size=2)
    bad = malicious_set(3, 1 / 3, 0)[0]
    poisoned = door.training_data(client(bad, {}), images([0, 1, 0, 1]))
    stamped = poisoned.images[:, :, -2:, -2:].flatten(1).eq(255).all(1)
    assert stamped.sum() == 2 and poisoned.labels[stamped].tolist() == [2, 2]
    assert poisoned.images[~stamped].eq(0).all() and poisoned.labels[~stamped].tolist() != [2, 2]
    received, upload = {"w": torch.ones(2)}, {"w": torch.tensor([2.0, 0.0])}
    sent = door.process_upload(client(bad, received, per_round=4), upload)  # γ = n/η = 4
    assert torch.equal(sent["w"], torch.tensor([5.0, -3.0]))
    # a model that answers the target exactly when the trigger's pixel is white
    model = nn.ModuleDict({"encoder": nn.Flatten(), "classifier": nn.Linear(192, 3)})
    with torch.no_grad():
        model["classifier"].weight.zero_()
        model["classifier"].bias.copy_(torch.tensor([0.0, 0.0, -1.0]))
        model["classifier"].weight[2, 191] = 1.0  # last pixel, normalised: (1 - .5)/.25 = 2
    test = images([0, 1, 2, 2])
    adversary = Adversary(None, frozenset(), test, torch.device("cpu"), model, 1, [], [
        {k: v.clone() for k, v in model.state_dict().items()}])  # fmt: skip
    door.attack_evaluate(adversary)
    assert adversary.row == {"backdoor_success": 1.0}  # both victims (labels 0, 1) hit


def test_detection_precision_and_recall():
    found = truth.detection([1, 2, 5], frozenset({2, 5, 7, 9}), [1, 2, 3, 5, 7])
    assert found == {"detection_precision": 2 / 3, "detection_recall": 2 / 3}  # 9 not there
    assert truth.detection([], frozenset({2}), [2]) == {"detection_recall": 0.0}
    assert truth.detection([1], frozenset({2}), [1]) == {"detection_precision": 0.0}
    assert truth.detection(None, frozenset({2}), [2]) == {}


class LargestNorm:
    """A test defence: drops the client whose update has the largest norm (flagged)."""

    @hookimpl
    def aggregate(self, server, cluster, uploads):
        previous = server.pool[cluster]
        keys = [k for k in previous if previous[k].is_floating_point()]

        def norm(u):
            return math.sqrt(sum(float((u.tensors[k] - previous[k]).pow(2).sum()) for k in keys))

        worst = max(uploads, key=norm).client
        kept = [u for u in uploads if u.client != worst]
        total = sum(u.weight for u in kept)
        server.log(flagged=[worst], defence="largest_norm")
        return {k: sum(u.weight * u.tensors[k] for u in kept) / total for k in keys}


class Watcher:
    """Server hooks that look for the truth everywhere they can reach."""

    seen: list = []
    uploads: list = []

    @hookimpl
    def aggregate(self, server, cluster, uploads):
        self.uploads.append((dict(server.pool[cluster]), {u.client: u.tensors for u in uploads}))
        self.look(server)

    @hookimpl
    def round_end(self, server):
        self.look(server)

    @hookimpl
    def round_logged(self, server, metrics):
        self.look(server)
        self.seen.append(dict(metrics))

    def look(self, server):
        values = [getattr(server, a) for a in dir(Server) if not a.startswith("_")]
        self.seen.append([v for v in values if not callable(v)] + [server.state])


@pytest.mark.slow
def test_server_hooks_never_see_the_truth_and_defences_are_scored():
    Watcher.seen, Watcher.uploads = [], []
    raw = tiny_recipe(plugins=["fedavg", "largest", "watcher", {"ipm": {
        "fraction": 0.34, "seed": 1, "epsilon": 30.0}}])  # fmt: skip
    run = prepared(raw, largest=LargestNorm, watcher=Watcher)
    assert run.malicious == frozenset({2})
    rows = [run_round(run, r) for r in (1, 2)]
    for row in rows:
        assert row["flagged"] == [2] and row["defence"] == "largest_norm"
        assert row["detection_precision"] == 1.0 and row["detection_recall"] == 1.0
    for seen in Watcher.seen:
        assert "Adversary" not in repr(seen) and "malicious" not in repr(seen)
        assert not any(isinstance(v, frozenset) and v == run.malicious for v in seen)
    previous, uploads = Watcher.uploads[0]  # IPM's upload reached aggregate, not the honest one
    for key in [k for k, v in previous.items() if v.is_floating_point()]:
        benign = (uploads[0][key] + uploads[1][key]) / 2 - previous[key]
        assert torch.allclose(uploads[2][key], previous[key] - 30.0 * benign, atol=1e-5)
    assert "backdoor_success" not in rows[-1]
    run.close()


class Both(LabelFlip):
    @hookimpl
    def round_end(self, server):
        return None


def test_refusals():
    raw = tiny_recipe(plugins=["fedavg", "label_flip", "sign_flip"])
    with pytest.raises(RecipeError, match="malicious_clients"):
        prepared(raw)
    with pytest.raises(RecipeError, match="not both"):
        prepared(tiny_recipe(plugins=["fedavg", "both"]), both=Both)
    with pytest.raises(FedkitError, match="'alie' simulates an attack"):
        truth.refuse_deployed(validate(tiny_recipe(plugins=["fedavg", "alie"])))
    truth.refuse_deployed(validate(tiny_recipe()))


def test_the_report_tabulates_detection():
    rows = [{"round": 1, "test_accuracy": 0.5}, {"round": 2, "defence": "krum", "flagged": [2],
            "detection_precision": 1.0, "detection_recall": 0.5}]  # fmt: skip
    page = detection_html(SimpleNamespace(rows=rows))
    assert page.count("<tr><td>") == 1 and "<td>[2]</td><td>1.0000</td><td>0.5000</td>" in page
    assert detection_html(SimpleNamespace(rows=rows[:1])) == ""


def test_a_crafted_upload_must_be_a_malicious_clients_and_keep_its_shapes():
    ups = [Upload(c, 1.0, {"w": torch.zeros(2)}) for c in (0, 1)]
    adversary = SimpleNamespace(malicious=frozenset({1}))

    def answering(crafted):
        return SimpleNamespace(chain=lambda *a, **k: crafted, implementers=lambda h: ["evil"])

    fine = [ups[0], Upload(1, 1.0, {"w": torch.ones(2)})]
    assert truth.attacked(answering(fine), adversary, 0, ups) == fine
    for crafted, why in [
        ([Upload(0, 1.0, {"w": torch.ones(2)}), ups[1]], "not malicious"),
        ([ups[0], Upload(1, 1.0, {"w": torch.ones(3)})], "shapes"),
        ([ups[0]], "dropped"),
    ]:
        with pytest.raises(PluginError, match=why):
            truth.attacked(answering(crafted), adversary, 0, ups)

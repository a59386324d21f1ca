"""The hot path's rewrites: each fast path gives bit for bit what the plain code it
replaced gave, so fp32 runs are unchanged by them."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import timm
import torch
from torch import nn

import fedkit.core.engine
import fedkit.core.worker
from fedkit.config.schema import validate
from fedkit.core.aggregation import weighted_mean
from fedkit.core.messages import ClientSetup
from fedkit.core.worker import Worker, non_finite, plain_loading
from fedkit.plugin.server import Upload
from fedkit.seeding import seed_everything
from fedkit.testing import assert_same_runs, run_recipe, tiny_recipe

# The plain code the hot path replaced, kept here as the reference it must equal.


def plain_seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def plain_non_finite(tensors, owned=False):
    for key, value in tensors.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return key
    return None


def plain_weighted_mean(uploads, key):
    weights = torch.tensor([u.weight for u in uploads], dtype=torch.float64)
    first = uploads[0].tensors[key]
    stacked = torch.stack([u.tensors[key].to(torch.float64) for u in uploads])
    mean = torch.tensordot(weights, stacked, dims=1) / weights.sum()
    return mean.to(first.dtype) if first.is_floating_point() else mean.floor().to(first.dtype)


@pytest.mark.slow
def test_fp32_runs_are_unchanged_by_the_hot_path(monkeypatch):
    raw = tiny_recipe(plugins=["fedavg"])
    fast = run_recipe(raw)
    for module in (fedkit.core.worker, fedkit.core.engine):
        monkeypatch.setattr(module, "seed_everything", plain_seed_everything)
        monkeypatch.setattr(module, "non_finite", plain_non_finite)
    monkeypatch.setattr(fedkit.core.engine, "weighted_mean", plain_weighted_mean)
    monkeypatch.setattr(fedkit.core.worker, "plain_loading", lambda model: False)
    assert_same_runs(fast, run_recipe(raw))


def test_seeding_draws_the_same_streams_as_torch_manual_seed():
    seed_everything(123)
    fast = (random.random(), np.random.rand(), torch.rand(5), torch.randn(3))
    plain_seed_everything(123)
    plain = (random.random(), np.random.rand(), torch.rand(5), torch.randn(3))
    assert fast[:2] == plain[:2]
    assert torch.equal(fast[2], plain[2]) and torch.equal(fast[3], plain[3])


@pytest.mark.parametrize("shape", [(7, 5), (3, 40_000), (), (0, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_weighted_mean_is_the_float64_sum_upload_by_upload(dtype, shape):
    """Exactly the float64 running sum in upload order divided once (no stacked copy), and
    equal to the stacked dot product where every sum is exact."""
    g = torch.Generator().manual_seed(0)
    uploads = [
        Upload(i, float(w), {"w": (torch.randn(shape, generator=g) * 100).to(dtype)})
        for i, w in enumerate([3, 1, 4, 1, 5, 9])
    ]
    mixed = [*uploads[:3], Upload(9, 2.0, {"w": uploads[3].tensors["w"].double()})]
    for ups in (uploads, mixed):
        got = weighted_mean(ups, "w")
        total = sum(u.weight for u in ups)
        running = torch.zeros(shape, dtype=torch.float64)
        for u in ups:
            running.add_(u.tensors["w"], alpha=u.weight)  # one fused step per upload
        running /= total
        first = ups[0].tensors["w"]
        exact = running.to(first.dtype) if first.is_floating_point() else running.floor().long()
        assert got.dtype == first.dtype and torch.equal(got, exact)
        stacked = plain_weighted_mean(ups, "w")
        if dtype == torch.float64:  # products of float64 values round, so the order shows
            assert torch.allclose(got, stacked, rtol=1e-12)
        else:
            assert torch.equal(got, stacked)


def test_the_mean_does_not_depend_on_the_order_uploads_arrive_in():
    """Executors collect uploads in the order clients finish. Clients whose values sit a few
    ulps apart put the mean exactly half-way between two fp32 numbers; sample-count weights
    keep the float64 sum exact, so the tie is broken the same way in every order (a
    normalised running sum broke it differently in ~40 of 50,000 elements here)."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(50_000, generator=g)
    ulp = torch.nextafter(base, torch.full_like(base, math.inf)) - base
    uploads = [
        Upload(i, float(w), {"w": base + ulp * torch.randint(-3, 4, (50_000,), generator=g)})
        for i, w in enumerate([123, 91, 86])
    ]
    first = weighted_mean(uploads, "w")
    for order in ([2, 1, 0], [1, 0, 2]):
        assert torch.equal(weighted_mean([uploads[i] for i in order], "w"), first)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_names_the_first_bad_key(bad):
    state = {"a": torch.ones(3), "n": torch.arange(4), "b": torch.ones(2, 2), "c": torch.ones(5)}
    assert non_finite(state) is None
    state["c"][1] = bad
    state["b"][0, 1] = bad
    assert non_finite(state) == plain_non_finite(state) == "b"


def test_non_finite_is_not_fooled_by_sums_that_overflow():
    state = {"big": torch.full((4,), 3e38), "small": torch.ones(2)}
    assert non_finite(state) is None
    assert non_finite({"half": torch.full((4,), 6e4, dtype=torch.float16)}) is None


class CountingNorm(nn.LayerNorm):
    """A module that loads its own way (counts its loads)."""

    loads = 0

    def _load_from_state_dict(self, *args, **kwargs):
        CountingNorm.loads += 1
        super()._load_from_state_dict(*args, **kwargs)


def worker_for(model: nn.Module) -> Worker:
    setup = ClientSetup(validate(tiny_recipe()), model, frozenset(), "cpu", None, None)
    return Worker(setup)


def test_loading_a_state_copies_every_tensor_as_load_state_dict_does():
    model = nn.ModuleDict({"encoder": timm.create_model("test_resnet", num_classes=0)})
    worker = worker_for(model)
    state = {k: torch.randn_like(v.float()).to(v.dtype) for k, v in model.state_dict().items()}
    worker.load(state)
    reference = nn.ModuleDict({"encoder": timm.create_model("test_resnet", num_classes=0)})
    reference.load_state_dict(state)
    for (k, a), b in zip(
        worker.model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), k
    with pytest.raises(RuntimeError, match="size mismatch"):
        worker.load({**state, "encoder.conv1.0.weight": torch.zeros(1)})


def test_a_module_with_its_own_loading_gets_load_state_dict():
    model = nn.ModuleDict({"encoder": nn.Sequential(nn.Linear(3, 3), CountingNorm(3))})
    assert plain_loading(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    assert not plain_loading(model)
    worker = worker_for(model)
    CountingNorm.loads = 0
    worker.load({k: torch.ones_like(v) for k, v in model.state_dict().items()})
    assert CountingNorm.loads == 1
    assert all(bool((v == 1).all()) for v in worker.model.state_dict().values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_fused_check_of_owned_tensors_finds_what_the_plain_one_finds(dtype):
    state = {"a": torch.ones(3, dtype=dtype), "n": torch.arange(4), "b": torch.zeros(2, 2)}
    copy = {k: v.clone() for k, v in state.items()}
    assert non_finite(state, owned=True) is None
    assert all(torch.equal(state[k], copy[k]) for k in state)  # written back unchanged
    state["a"][2] = math.nan
    assert non_finite(state, owned=True) == plain_non_finite(state) == "a"

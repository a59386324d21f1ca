"""Precision and layout options (``precision``, ``channels_last``), and the hot-path
rewrites: each fast path gives bit for bit what the plain code it replaced gave."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch import nn

import fedkit.engine
import fedkit.worker
from fedkit import hookimpl, precision
from fedkit.aggregation import weighted_mean
from fedkit.errors import RecipeError
from fedkit.seeding import seed_everything
from fedkit.server import Upload
from fedkit.testing import assert_same_runs, run_recipe, tiny_recipe
from fedkit.worker import non_finite

SMALL = {"data": {"max_train": 120}, "federation": {"rounds": 1}}


def small(**top) -> dict:
    raw = tiny_recipe(**SMALL)
    raw.update(top)
    return raw


class Witness:
    """Records, from inside a client's training, what precision and layout it runs at."""

    seen: list[tuple[bool, torch.dtype, bool]] = []

    @hookimpl
    def loss_terms(self, ctx, model, batch):
        weight = model["encoder"].conv1[0].weight
        Witness.seen.append(
            (
                torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"),
                weight.is_contiguous(memory_format=torch.channels_last),
            )
        )
        return {}


def test_bf16_runs_are_reproducible_and_differ_from_fp32():
    raw = small(precision="bf16", channels_last=True)
    first, second = run_recipe(raw), run_recipe(raw)
    assert_same_runs(first, second)
    fp32 = run_recipe(small())
    differs = any(not torch.equal(a, b) for a, b in zip(*_values(first, fp32), strict=True))
    assert differs, "bf16 gave the fp32 model bit for bit: autocast did not act"
    assert abs(first.rows[-1]["train_loss"] - fp32.rows[-1]["train_loss"]) < 0.1


def _values(a, b):
    return [a.pool[0][k] for k in sorted(a.pool[0])], [b.pool[0][k] for k in sorted(b.pool[0])]


@pytest.mark.parametrize(
    ("top", "expected"),
    [
        ({}, (False, False)),
        ({"precision": "bf16", "channels_last": True}, (True, True)),
        ({"channels_last": True}, (False, True)),
    ],
)
def test_client_hooks_run_at_the_recipes_precision_and_layout(top, expected):
    Witness.seen = []
    raw = small(**top)
    raw["plugins"] = ["fedavg", "witness"]
    run_recipe(raw, plugins={"witness": Witness})
    autocast, last = expected
    assert Witness.seen
    assert {(on, cl) for on, _, cl in Witness.seen} == {(autocast, last)}
    if autocast:
        assert {dtype for _, dtype, _ in Witness.seen} == {torch.bfloat16}


def test_uploads_and_the_global_model_stay_float32_under_bf16():
    result = run_recipe(small(precision="bf16", channels_last=True))
    assert {v.dtype for v in result.pool[0].values() if v.is_floating_point()} == {torch.float32}


def test_bf16_on_a_cuda_device_without_it_is_a_recipe_error(monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    with pytest.raises(RecipeError, match="precision"):
        precision.check("bf16", torch.device("cuda"))
    warnings = precision.check("bf16", torch.device("cpu"))
    assert warnings and "emulated" in warnings[0]
    assert precision.check("fp32", torch.device("cuda")) == []


def test_bf16_forward_passes_see_every_optimiser_step():
    """A client's job is one block spanning many steps: no stale bf16 copy of a weight."""
    layer = nn.Linear(4, 1, bias=False)
    x = torch.ones(1, 4)
    with precision.compute("bf16", False, torch.device("cpu")):
        before = layer(x)
        with torch.no_grad():
            layer.weight.add_(1.0)
        after = layer(x)
    assert before.dtype == torch.bfloat16
    assert float((after - before).detach()) == pytest.approx(4.0, abs=0.05)


def test_layout_is_applied_only_inside_a_block_that_asks_for_it():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(4, 2))
    param = model[0].weight
    precision.adopt_layout(model)
    assert not param.is_contiguous(memory_format=torch.channels_last)
    with precision.compute("fp32", True, torch.device("cpu")):
        precision.adopt_layout(model)
    assert model[0].weight is param  # an optimiser holding it stays valid
    assert param.is_contiguous(memory_format=torch.channels_last)


# The plain code the hot path replaced, kept here as the reference it must equal.


def plain_seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def plain_non_finite(tensors):
    for key, value in tensors.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return key
    return None


def plain_weighted_mean(uploads, key):
    weights = torch.tensor([u.weight for u in uploads], dtype=torch.float64)
    weights = weights / weights.sum()
    first = uploads[0].tensors[key]
    stacked = torch.stack([u.tensors[key].to(torch.float64) for u in uploads])
    mean = torch.tensordot(weights, stacked, dims=1)
    return mean.to(first.dtype) if first.is_floating_point() else mean.floor().to(first.dtype)


def test_fp32_runs_are_unchanged_by_the_hot_path(monkeypatch):
    raw = tiny_recipe(plugins=["fedavg"])
    fast = run_recipe(raw)
    for module in (fedkit.worker, fedkit.engine):
        monkeypatch.setattr(module, "seed_everything", plain_seed_everything)
        monkeypatch.setattr(module, "non_finite", plain_non_finite)
    monkeypatch.setattr(fedkit.engine, "weighted_mean", plain_weighted_mean)
    assert_same_runs(fast, run_recipe(raw))


def test_seeding_draws_the_same_streams_as_torch_manual_seed():
    seed_everything(123)
    fast = (random.random(), np.random.rand(), torch.rand(5), torch.randn(3))
    plain_seed_everything(123)
    plain = (random.random(), np.random.rand(), torch.rand(5), torch.randn(3))
    assert fast[:2] == plain[:2]
    assert torch.equal(fast[2], plain[2]) and torch.equal(fast[3], plain[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_weighted_mean_equals_widening_each_upload(dtype):
    g = torch.Generator().manual_seed(0)
    uploads = [
        Upload(i, float(w), {"w": (torch.randn(7, 5, generator=g) * 100).to(dtype)})
        for i, w in enumerate([3, 1, 4, 1, 5, 9])
    ]
    assert torch.equal(weighted_mean(uploads, "w"), plain_weighted_mean(uploads, "w"))
    mixed = [*uploads[:3], Upload(9, 2.0, {"w": uploads[3].tensors["w"].double()})]
    assert torch.equal(weighted_mean(mixed, "w"), plain_weighted_mean(mixed, "w"))


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

"""Large populations: the ``sampled`` partitioner registers more clients than there are
images, client data is built only for the clients a round touches, and nothing in a
metrics row grows with the number of registered clients."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import tiny_recipe

from fedkit.config.schema import validate
from fedkit.core.engine import prepare, run_round
from fedkit.data.partition import sampled


def test_sampled_gives_every_client_its_size_of_images_from_the_pool():
    labels = np.arange(50) % 10
    split = sampled(labels, 1000, np.random.default_rng(0), size=3)
    assert len(split.clients) == 1000
    assert all(len(c) == 3 and c.min() >= 0 and c.max() < 50 for c in split.clients)
    again = sampled(labels, 1000, np.random.default_rng(0), size=3)
    assert all(np.array_equal(a, b) for a, b in zip(split.clients, again.clients, strict=True))


def population(clients: int):
    raw = tiny_recipe(
        data={
            "num_clients": clients,
            "partition": {"name": "sampled", "size": 3},
            "local_test_size": 3,
        },
        federation={"rounds": 2, "clients_per_round": 4},
        evaluation={"protocol": "supervised", "every": 1, "clients": 4},
    )
    return prepare(validate(raw))


@pytest.mark.slow
def test_a_metrics_row_does_not_grow_with_the_registered_clients():
    rows = {}
    for n in (20, 20_000):  # more clients than digits has training images
        run = population(n)
        try:
            rows[n] = [run_round(run, r) for r in (1, 2)]
            built = len(run.executor.clients._built)
        finally:
            run.close()
        assert built <= 2 * 4 + 4 + 4  # the rounds' trainers and evaluated clients only
    for small, large in zip(rows[20], rows[20_000], strict=True):
        assert small.keys() == large.keys()
        assert len(large["clients"]) == len(large["clusters"]) == 4
        assert abs(len(json.dumps(large)) - len(json.dumps(small))) < 0.1 * len(json.dumps(small))

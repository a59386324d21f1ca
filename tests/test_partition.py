"""Partitioners on synthetic label arrays: coverage, disjointness, determinism, errors."""

from __future__ import annotations

import numpy as np
import pytest

from fedkit import hookimpl
from fedkit.config.schema import DataConfig
from fedkit.data.partition import Partition, partition
from fedkit.errors import RecipeError
from fedkit.plugin.registry import Registries, discover, registries
from fedkit.testing import Loaded


def _labels(per_class: int = 100, num_classes: int = 10, seed: int = 1) -> np.ndarray:
    labels = np.repeat(np.arange(num_classes), per_class)
    return np.random.default_rng(seed).permutation(labels)


def _split(labels, name, num_clients=10, seed=0, regs: Registries | None = None, **params):
    cfg = DataConfig(num_clients=num_clients, partition={"name": name, **params})
    fn = (regs or registries()).partitioners.get(name)
    return partition(labels, cfg, np.random.default_rng(seed), fn)


CASES = [
    ("iid", {}),
    ("dirichlet", {"alpha": 0.5}),
    ("classes_per_client", {"k": 2}),
    ("labels_per_client", {"k": 3}),
    ("dirichlet", {"alpha": 0.5, "cap": True}),
]


def _check_disjoint_sorted(part: Partition) -> np.ndarray:
    joined = np.concatenate(part.clients)
    assert len(np.unique(joined)) == len(joined)
    for c in part.clients:
        assert c.dtype == np.int64
        assert np.all(np.diff(c) > 0)
    return joined


@pytest.mark.parametrize(("name", "params"), CASES)
def test_partition_covers_all_disjointly(name, params):
    labels = _labels()
    part = _split(labels, name, **params)
    assert len(part.clients) == 10
    joined = _check_disjoint_sorted(part)
    assert sorted(joined.tolist()) == list(range(len(labels)))


@pytest.mark.parametrize(("name", "params"), CASES)
def test_partition_is_deterministic_from_the_rng(name, params):
    labels = _labels()
    first, again = _split(labels, name, **params), _split(labels, name, **params)
    other = _split(labels, name, seed=1, **params)
    assert all(np.array_equal(a, b) for a, b in zip(first.clients, again.clients, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first.clients, other.clients, strict=True))


def test_iid_sizes_differ_by_at_most_one():
    sizes = [len(c) for c in _split(_labels(), "iid", num_clients=7).clients]
    assert sum(sizes) == 1000
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_respects_min_size():
    part = _split(_labels(), "dirichlet", alpha=0.05, min_size=20)
    assert min(len(c) for c in part.clients) >= 20


def test_dirichlet_unreachable_min_size_is_a_clear_error():
    with pytest.raises(RecipeError, match="data.partition.min_size"):
        _split(_labels(), "dirichlet", alpha=0.001, min_size=99)
    with pytest.raises(RecipeError, match="at most 100"):
        _split(_labels(), "dirichlet", alpha=1.0, min_size=101)


def test_classes_per_client_one_owner_per_class():
    labels = _labels()
    part = _split(labels, "classes_per_client", num_clients=5, k=2)
    held = [set(np.unique(labels[c]).tolist()) for c in part.clients]
    assert all(len(h) == 2 for h in held)
    assert sorted(c for h in held for c in h) == list(range(10))
    assert [set(c) for c in part.client_classes] == held


def test_classes_per_client_shares_classes_in_equal_shards():
    labels = _labels()
    part = _split(labels, "classes_per_client", num_clients=10, k=3)
    held = [np.unique(labels[c]).tolist() for c in part.clients]
    assert all(len(h) == 3 for h in held)
    uses = np.bincount([c for h in held for c in h], minlength=10)
    assert uses.tolist() == [3] * 10
    for c in part.clients:
        counts = np.bincount(labels[c])
        assert set(counts[counts > 0].tolist()) <= {33, 34}


def test_cluster_groups_matches_the_cp_cfl_setup():
    labels = _labels(per_class=600)
    part = _split(labels, "cluster_groups", num_clients=60)
    _check_disjoint_sorted(part)
    assert part.groups == [0] * 20 + [1] * 20 + [2] * 20
    expected = {0: [0, 1, 2, 3], 1: [3, 4, 5, 6], 2: [6, 7, 8, 9]}
    rows = set()
    for client, group in zip(part.clients, part.groups, strict=True):
        counts = np.bincount(labels[client], minlength=10)
        assert len(client) == 50
        assert np.flatnonzero(counts).tolist() == expected[group]
        assert sorted(counts[expected[group]].tolist()) == [5, 5, 20, 20]
        rows.add(tuple(counts.tolist()))
    assert len(rows) > 3


def test_cluster_groups_reports_how_many_images_it_needs():
    with pytest.raises(RecipeError, match="class 3 needs 500 images"):
        _split(_labels(per_class=300), "cluster_groups", num_clients=60)


def test_cluster_groups_validates_its_parameters():
    with pytest.raises(RecipeError, match="data.partition.per_class"):
        _split(_labels(), "cluster_groups", num_clients=6, per_class=[20, 5])
    with pytest.raises(RecipeError, match="data.partition.classes_per_group"):
        _split(_labels(), "cluster_groups", num_clients=6, classes_per_group=5, per_class=[1] * 5)
    with pytest.raises(RecipeError, match="data.partition.overlap"):
        _split(_labels(), "cluster_groups", num_clients=6, overlap=4)


def test_unknown_partitioner_suggests_the_closest_name():
    with pytest.raises(RecipeError) as info:
        _split(_labels(), "dirichlett", alpha=0.5)
    assert info.value.key == "data.partition.name"
    assert 'did you mean "dirichlet"' in str(info.value)


def test_unknown_parameter_lists_the_accepted_ones():
    with pytest.raises(RecipeError) as info:
        _split(_labels(), "dirichlet", alpah=0.5)
    assert info.value.key == "data.partition.alpah"
    assert "alpha, min_size" in str(info.value)
    assert 'did you mean "alpha"' in str(info.value)


@pytest.mark.parametrize(
    ("name", "params", "key"),
    [
        ("dirichlet", {}, "data.partition.alpha"),
        ("dirichlet", {"alpha": -1}, "data.partition.alpha"),
        ("dirichlet", {"alpha": "big"}, "data.partition.alpha"),
        ("classes_per_client", {"k": 11}, "data.partition.k"),
        ("classes_per_client", {"k": 1.5}, "data.partition.k"),
        ("iid", {"k": 2}, "data.partition.k"),
    ],
)
def test_bad_parameters_name_the_key(name, params, key):
    with pytest.raises(RecipeError) as info:
        _split(_labels(), name, **params)
    assert info.value.key == key


def test_too_many_clients_is_an_error():
    with pytest.raises(RecipeError, match="data.num_clients"):
        _split(_labels(per_class=1), "iid", num_clients=11)


def halves(labels, num_clients, rng, first=True):
    return Partition([np.arange(len(labels) // 2), np.arange(len(labels) // 2, len(labels))])


class Halves:
    """A plugin that registers a partitioner (a registry hook is a staticmethod)."""

    @staticmethod
    @hookimpl
    def register_partitioners(register):
        register("halves_test", halves)


def test_registered_partitioner_is_dispatched():
    regs = registries({**discover(), "halves": Loaded(Halves)})
    part = _split(_labels(), "halves_test", num_clients=2, first=False, regs=regs)
    assert [len(c) for c in part.clients] == [500, 500]
    assert regs.partitioners.entries["halves_test"].plugin == "halves"
    assert "halves_test" not in registries().partitioners  # installed ones are untouched


@pytest.mark.parametrize("k", [1, 2, 3])
def test_labels_per_client_is_niid_benchs_sort_and_partition(k):
    labels = _labels(per_class=60)
    part = _split(labels, "labels_per_client", k=k)
    holders = {c: [] for c in range(10)}
    for i, (idx, held) in enumerate(zip(part.clients, part.client_classes, strict=True)):
        assert len(held) == k and i % 10 in held  # client i holds class i mod K
        assert set(np.unique(labels[idx])) == set(held)
        for c in held:
            holders[c].append(int(np.sum(labels[idx] == c)))
    for c, counts in holders.items():  # a class cut in equal shards among its holders
        assert sum(counts) == 60 and max(counts) - min(counts) <= 1, c
    if k == 1:
        assert part.client_classes == [[i] for i in range(10)]


def test_labels_per_client_draws_the_other_classes_from_the_rng():
    labels = _labels()
    a = _split(labels, "labels_per_client", k=2, seed=0).client_classes
    b = _split(labels, "labels_per_client", k=2, seed=1).client_classes
    assert a != b


FLOWER_SEED_42 = {  # the label sets of Flower's niid_bench baseline, seed 42, 10 clients
    2: [[0, 7], [1, 6], [2, 4], [3, 4], [4, 8], [5, 0], [6, 2], [7, 0], [8, 5], [9, 7]],
    3: [[0, 7, 6], [1, 4, 8], [2, 0, 6], [3, 2, 0], [4, 5, 9], [5, 7, 1], [6, 8, 4],
        [7, 5, 3], [8, 1, 9], [9, 7, 6]],
}  # fmt: skip


@pytest.mark.parametrize("k", [2, 3])
def test_labels_per_client_with_a_draw_seed_holds_the_published_tables_label_sets(k):
    labels = _labels(per_class=60)
    part = _split(labels, "labels_per_client", k=k, draw_seed=42, seed=0)
    assert part.client_classes == [sorted(held) for held in FLOWER_SEED_42[k]]
    other = _split(labels, "labels_per_client", k=k, draw_seed=42, seed=7)  # the run's seed
    assert all(np.array_equal(a, b) for a, b in zip(part.clients, other.clients, strict=True))
    plain = _split(labels, "labels_per_client", k=k, seed=0)
    assert plain.client_classes != part.client_classes
    with pytest.raises(RecipeError, match="data.partition.draw_seed"):
        _split(labels, "labels_per_client", k=k, draw_seed=-1)


FLOWER_DIRICHLET_SEED_42 = {  # Flower's niid_bench Dirichlet(0.5) draw, seed 42, 10 clients,
    # on _labels(per_class=600): each client's size, and client 0's count of each class
    "sizes": [649, 331, 773, 618, 481, 762, 303, 781, 621, 681],
    "client_0": [133, 1, 24, 98, 10, 72, 45, 73, 41, 152],
}


def test_dirichlet_with_a_draw_seed_holds_the_published_tables_partition():
    labels = _labels(per_class=600)
    params = {"alpha": 0.5, "min_size": 10, "cap": True, "draw_seed": 42}
    part = _split(labels, "dirichlet", **params)
    assert [len(c) for c in part.clients] == FLOWER_DIRICHLET_SEED_42["sizes"]
    counts = np.bincount(labels[part.clients[0]], minlength=10).tolist()
    assert counts == FLOWER_DIRICHLET_SEED_42["client_0"]
    other = _split(labels, "dirichlet", seed=7, **params)  # the run's seed does not matter
    assert all(np.array_equal(a, b) for a, b in zip(part.clients, other.clients, strict=True))
    plain = _split(labels, "dirichlet", alpha=0.5, min_size=10, cap=True)
    assert [len(c) for c in plain.clients] != FLOWER_DIRICHLET_SEED_42["sizes"]
    with pytest.raises(RecipeError, match="data.partition.draw_seed"):
        _split(labels, "dirichlet", alpha=0.5, draw_seed=-1)


def test_capped_dirichlet_gives_no_later_class_to_a_client_at_its_even_share():
    labels = _labels(per_class=500)
    part = _split(labels, "dirichlet", alpha=0.1, cap=True)
    counts = np.array([[np.sum(labels[c] == k) for k in range(10)] for c in part.clients])
    capped = 0
    for k in range(1, 10):  # classes are dealt in order
        full = counts[:, :k].sum(axis=1) >= len(labels) / 10
        assert np.all(counts[full, k] <= 1), k  # 0, or 1 left by rounding the cuts down
        capped += int(full.sum())
    assert capped > 0  # the cap acted
    plain = _split(labels, "dirichlet", alpha=0.1)
    assert [len(c) for c in plain.clients] != [len(c) for c in part.clients]

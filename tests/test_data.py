"""Data sets, the federated split and the partition summary (no downloads, no shared data)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from rich.console import Console

from fedkit.config.schema import DataConfig
from fedkit.data import datasets, partition_table, render_partition, save_partition
from fedkit.data import federated as fed
from fedkit.errors import RecipeError
from fedkit.plugin.registry import registries
from fedkit.training.batching import normalize


def load_split(cfg: DataConfig, split: str):
    """A split of the data set the section names, found among the registered ones."""
    return datasets.load_split(cfg, split, registries().datasets.get(cfg.dataset))


def load_splits(cfg: DataConfig):
    return datasets.load_splits(cfg, registries().datasets.get(cfg.dataset))


def build_federated_data(cfg: DataConfig, seed: int):
    regs = registries()
    dataset, partitioner = regs.datasets.get(cfg.dataset), regs.partitioners.get(cfg.partition.name)
    return fed.build_federated_data(cfg, seed, dataset, partitioner)


@pytest.fixture(scope="module")
def digits8():
    """Digits at native 8×8, so pixels can be matched against scikit-learn's."""
    return load_splits(DataConfig(dataset="digits", image_size=8))


def test_digits_shapes_and_types():
    train = load_split(DataConfig(dataset="digits", image_size=16), "train")
    assert train.images.shape == (1437, 3, 16, 16)
    assert train.images.dtype == torch.uint8
    assert train.labels.dtype == torch.int64
    assert torch.equal(train.images[:, 0], train.images[:, 2])
    assert train.classes == [str(c) for c in range(10)]
    assert int(train.images.max()) == 255


def test_digits_split_is_a_disjoint_stratified_80_20(digits8):
    from sklearn.datasets import load_digits

    train, test = digits8
    assert (len(train), len(test)) == (1437, 360)
    bunch = load_digits()
    full = np.round(bunch.images * (255 / 16)).astype(np.uint8).reshape(len(bunch.target), -1)
    rows = np.concatenate(
        [train.images[:, 0].reshape(len(train), -1), test.images[:, 0].reshape(len(test), -1)]
    )
    labels = np.concatenate([train.labels.numpy(), test.labels.numpy()])
    key = np.lexsort(np.column_stack([labels, rows]).T)
    expected = np.lexsort(np.column_stack([bunch.target, full]).T)
    assert np.array_equal(rows[key], full[expected])
    assert np.bincount(test.labels.numpy()).min() >= 35


def test_stats_come_from_train_and_normalise(digits8):
    train, test = digits8
    assert train.mean == test.mean and train.std == test.std
    x = train.normalized()
    assert x.dtype == torch.float32 and x.shape == train.images.shape
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-3
    assert torch.equal(train.normalized([3, 5]), x[[3, 5]])
    sub = train.subset(np.array([0, 2]))
    assert len(sub) == 2 and sub.mean == train.mean


def test_standardize_false_feeds_images_on_the_0_to_1_scale():
    train, test = load_splits(DataConfig(dataset="digits", image_size=8, standardize=False))
    expected = train.images.float() / 255.0
    assert torch.equal(train.normalized(), expected)  # what evaluation reads
    assert torch.equal(normalize(train.images, train), expected)  # what training batches read
    assert test.mean == train.mean == (0.0, 0.0, 0.0) and test.std == (1.0, 1.0, 1.0)
    federated = build_federated_data(DataConfig(dataset="digits", standardize=False), 0)
    assert federated.train.mean == (0.0, 0.0, 0.0)  # clients' sets, and what nodes are sent


def test_max_train_and_max_test_keep_balanced_subsets():
    cfg = DataConfig(dataset="digits", image_size=8, max_train=100, max_test=50)
    train, test = load_splits(cfg)
    assert np.bincount(train.labels.numpy()).tolist() == [10] * 10
    assert np.bincount(test.labels.numpy()).tolist() == [5] * 10
    assert torch.equal(load_split(cfg, "train").images, train.images)


def test_unknown_dataset_suggests_a_name():
    with pytest.raises(RecipeError, match='did you mean "cifar10"'):
        load_split(DataConfig(dataset="cifar-10"), "train")


def test_missing_root_is_an_error_and_never_downloads(tmp_path):
    with pytest.raises(RecipeError) as info:
        load_split(DataConfig(dataset="cifar10", root=str(tmp_path / "absent")), "train")
    assert info.value.key == "data.root"
    assert "data.download: true" in str(info.value)
    with pytest.raises(RecipeError, match="data.root"):
        load_split(DataConfig(dataset="cifar10", root=str(tmp_path)), "train")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RecipeError, match="data.root"):
        load_split(DataConfig(dataset="mnist"), "test")


def _write(path, image):
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


@pytest.fixture
def folder(tmp_path):
    """A tiny ImageFolder tree: mixed modes, formats and sizes, solid colours per class."""
    colours = {"cat": (255, 0, 0), "dog": (0, 0, 255)}
    for split, count in (("train", 4), ("test", 2)):
        for name, colour in colours.items():
            for i in range(count):
                _write(tmp_path / split / name / f"{i}.png", Image.new("RGB", (12, 10), colour))
    _write(tmp_path / "train" / "cat" / "gray.png", Image.new("L", (8, 8), 255))
    _write(tmp_path / "train" / "dog" / "alpha.png", Image.new("RGBA", (8, 8), (0, 0, 255, 9)))
    _write(tmp_path / "train" / "dog" / "pal.bmp", Image.new("RGB", (8, 8), (0, 0, 255)))
    _write(tmp_path / "train" / "dog" / "photo.jpg", Image.new("RGB", (16, 16), (0, 0, 255)))
    (tmp_path / "train" / "dog" / "notes.txt").write_text("not an image")
    return tmp_path


def test_imagefolder_loads_every_format_resized(folder):
    train, test = load_splits(DataConfig(dataset="imagefolder", root=str(folder), image_size=8))
    assert train.classes == ["cat", "dog"]
    assert train.images.shape == (12, 3, 8, 8) and test.images.shape == (4, 3, 8, 8)
    assert np.bincount(train.labels.numpy()).tolist() == [5, 7]
    cat = train.images[0]
    assert cat[0].min() == 255 and cat[1:].max() == 0
    dogs = train.images[train.labels == 1].float()
    assert dogs[:, 2].min() >= 250 and dogs[:, :2].max() <= 5
    assert torch.all(train.images[train.labels == 0][-1] == 255)


def test_imagefolder_max_train_decodes_a_balanced_subset(folder):
    train = load_split(DataConfig(dataset="imagefolder", root=str(folder), max_train=4), "train")
    assert np.bincount(train.labels.numpy()).tolist() == [2, 2]


def test_imagefolder_flat_root_is_train_only(folder):
    cfg = DataConfig(dataset="imagefolder", root=str(folder / "train"), image_size=8)
    assert len(load_split(cfg, "train")) == 12
    with pytest.raises(RecipeError, match="test/ subfolder"):
        load_split(cfg, "test")


def test_imagefolder_test_class_missing_from_train(folder):
    _write(folder / "test" / "cow" / "0.png", Image.new("RGB", (8, 8)))
    with pytest.raises(RecipeError, match="cow"):
        load_split(DataConfig(dataset="imagefolder", root=str(folder)), "test")


def _federated_cfg(**changes) -> DataConfig:
    base = {
        "dataset": "digits",
        "image_size": 8,
        "num_clients": 5,
        "server_fraction": 0.2,
        "local_test_size": 40,
        "partition": {"name": "classes_per_client", "k": 2},
    }
    return DataConfig(**{**base, **changes})


@pytest.fixture(scope="module")
def federated():
    return build_federated_data(_federated_cfg(), seed=3)


def test_server_split_is_stratified_and_disjoint(federated):
    fd = federated
    clients = np.concatenate(fd.clients)
    assert len(fd.server) == round(0.2 * 1437)
    assert not set(fd.server.tolist()) & set(clients.tolist())
    assert len(fd.server) + len(clients) == len(fd.train)
    server_counts = np.bincount(fd.train.labels.numpy()[fd.server], minlength=10)
    assert server_counts.min() >= 27 and server_counts.max() <= 30


def test_local_tests_follow_client_classes(federated):
    fd = federated
    train_labels, test_labels = fd.train.labels.numpy(), fd.test.labels.numpy()
    for train_idx, test_idx in zip(fd.clients, fd.client_tests, strict=True):
        assert len(test_idx) == 40 and len(np.unique(test_idx)) == 40
        train_counts = np.bincount(train_labels[train_idx], minlength=10)
        test_counts = np.bincount(test_labels[test_idx], minlength=10)
        assert np.all(test_counts[train_counts == 0] == 0)
        share = train_counts / train_counts.sum() * 40
        assert np.all(np.abs(test_counts - share) < 1)


def test_federated_data_is_deterministic_from_seed(federated):
    again = build_federated_data(_federated_cfg(), seed=3)
    other = build_federated_data(_federated_cfg(), seed=4)
    for field in ("clients", "client_tests"):
        assert all(
            np.array_equal(a, b)
            for a, b in zip(getattr(federated, field), getattr(again, field), strict=True)
        )
    assert np.array_equal(federated.server, again.server)
    assert not np.array_equal(federated.server, other.server)
    assert federated.num_classes == 10 and sum(federated.client_sizes()) == 1437 - 287


def test_more_clients_than_images_is_an_error():
    with pytest.raises(RecipeError, match="data.num_clients"):
        build_federated_data(_federated_cfg(num_clients=5000, max_train=200), seed=0)


def test_partition_summary_renders_and_saves(federated, tmp_path):
    rows = partition_table(federated)
    assert [r["n_train"] for r in rows] == federated.client_sizes()
    assert all(sum(r["train_counts"]) == r["n_train"] for r in rows)
    assert rows[0]["group"] is None and len(rows[0]["test_counts"]) == 10
    console = Console(record=True, width=100)
    console.print(render_partition(rows, federated.train.classes))
    text = console.export_text()
    assert "client" in text and "c0=0" in text
    path = tmp_path / "partition.json"
    save_partition(rows, path)
    save_partition(rows, path)
    assert json.loads(path.read_text()) == rows
    assert [p.name for p in tmp_path.iterdir()] == ["partition.json"]


def test_local_test_sets_draw_from_class_members_as_from_a_scan_of_the_labels():
    rng = np.random.default_rng(0)
    test = rng.integers(0, 6, 300)
    members = fed.class_members(test)
    assert sorted(members) == sorted(set(test.tolist()))
    for c, where in members.items():
        assert np.array_equal(where, np.flatnonzero(test == c))
    clients = [rng.integers(0, 8, n) for n in (0, 1, 7, 40)]  # classes 6, 7: none in test
    a, b = np.random.default_rng(1), np.random.default_rng(1)
    scanned = {int(c): np.flatnonzero(test == c) for c in np.unique(test)}
    drawn = [fed.local_test_indices(c, scanned, 20, a) for c in clients]
    assert all(
        np.array_equal(x, fed.local_test_indices(c, members, 20, b))
        for x, c in zip(drawn, clients, strict=True)
    )
    pairs = zip(drawn, clients, strict=True)
    assert drawn[0].size == 0 and all(set(test[x].tolist()) <= set(c.tolist()) for x, c in pairs)

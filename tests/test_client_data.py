"""One client's data alone (``fedkit.data.build_client_data``), as a deployed node builds
it: exactly the whole build's client, without reading the other clients' images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedkit.config.schema import DataConfig
from fedkit.data import ClientData, Dataset, build_client_data, build_federated_data
from fedkit.data import datasets as ds
from fedkit.errors import FedkitError, RecipeError
from fedkit.plugin.registry import registries

DIGITS_CASES = {
    "iid": {"partition": "iid", "num_clients": 5},
    "dirichlet-server-limits": {
        "partition": {"name": "dirichlet", "alpha": 0.3},
        "num_clients": 6,
        "server_fraction": 0.2,
        "max_train": 700,
        "max_test": 150,
        "image_size": 12,
    },
    "dirichlet-draw-seed": {
        "partition": {"name": "dirichlet", "alpha": 0.5, "draw_seed": 7},
        "num_clients": 4,
    },
    "labels_per_client-server": {
        "partition": {"name": "labels_per_client", "k": 2},
        "num_clients": 7,
        "server_fraction": 0.1,
    },
    "classes_per_client-server": {
        "partition": {"name": "classes_per_client", "k": 3},
        "num_clients": 5,
        "server_fraction": 0.3,
        "standardize": False,
    },
    "cluster_groups": {"partition": "cluster_groups", "num_clients": 6},
    "sampled-overlapping": {"partition": {"name": "sampled", "size": 4}, "num_clients": 40},
}


def data_cfg(**changes) -> DataConfig:
    return DataConfig(**{"dataset": "digits", "image_size": 8, "local_test_size": 30, **changes})


def parts(cfg: DataConfig) -> tuple[Dataset, object]:
    regs = registries()
    return regs.datasets.get(cfg.dataset), regs.partitioners.get(cfg.partition.name)


def server_meta(whole) -> tuple[list[str], list[list[float]]]:
    """The classes and stats as the setup message carries them (through JSON)."""
    meta = {"classes": whole.train.classes, "stats": [whole.train.mean, whole.train.std]}
    decoded = json.loads(json.dumps(meta))
    return decoded["classes"], decoded["stats"]


def assert_same(one: ClientData, expected: ClientData) -> None:
    assert one.id == expected.id
    for got, want in ((one.train, expected.train), (one.test, expected.test)):
        assert got.images.dtype == want.images.dtype == torch.uint8
        assert torch.equal(got.images, want.images)
        assert torch.equal(got.labels, want.labels)
        assert got.classes == want.classes
        assert (got.mean, got.std) == (want.mean, want.std)
        # a copy of its own images, not a view into a whole split
        assert got.images.untyped_storage().nbytes() == got.images.numel()


@pytest.mark.parametrize("case", list(DIGITS_CASES))
def test_one_client_equals_the_whole_builds_client(case):
    cfg = data_cfg(**DIGITS_CASES[case])
    dataset, partitioner = parts(cfg)
    whole = build_federated_data(cfg, 11, dataset, partitioner)
    classes, stats = server_meta(whole)
    last = cfg.num_clients - 1
    for cid in sorted({0, last // 2, last}):
        one = build_client_data(cfg, 11, dataset, partitioner, cid, stats=stats, classes=classes)
        assert_same(one, whole.client(cid))


def test_without_classes_the_data_sets_own_are_taken():
    cfg = data_cfg(partition="iid", num_clients=3)
    dataset, partitioner = parts(cfg)
    whole = build_federated_data(cfg, 0, dataset, partitioner)
    one = build_client_data(cfg, 0, dataset, partitioner, 2, stats=server_meta(whole)[1])
    assert_same(one, whole.client(2))


def test_classes_that_differ_from_the_servers_are_refused():
    cfg = data_cfg(partition="iid", num_clients=3)
    dataset, partitioner = parts(cfg)
    stats = ((0.5,) * 3, (0.2,) * 3)
    with pytest.raises(RecipeError, match="data.dataset.*federation's classes"):
        build_client_data(cfg, 0, dataset, partitioner, 0, stats=stats, classes=list("abcdefghij"))
    with pytest.raises(ValueError, match="client must be in 0..2"):
        build_client_data(cfg, 0, dataset, partitioner, 3, stats=stats)
    with pytest.raises(ValueError, match="three channels"):
        build_client_data(cfg, 0, dataset, partitioner, 0, stats=((0.5,), (0.2,)))


# ----------------------------------------------------------------------- ImageFolder

CLASSES = ("ant", "bee", "cow")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A small ImageFolder of PNG and JPEG files of several sizes (every file distinct)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 9), ("test", 5)):
        for name in CLASSES:
            (tmp_path / split / name).mkdir(parents=True)
            for i in range(count):
                shape = (10 + i % 3, 12, 3)
                image = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
                image.save(tmp_path / split / name / f"{i:02d}.{'jpg' if i % 2 else 'png'}")
    return tmp_path


def listing(root: Path, split: str) -> list[str]:
    """The split's files in ImageFolder order: classes sorted, files sorted within each."""
    return [str(p) for name in CLASSES for p in sorted((root / split / name).iterdir())]


FOLDER_CASES = {
    "iid": {"partition": "iid", "num_clients": 4},
    "dirichlet-server-limits": {
        "partition": {"name": "dirichlet", "alpha": 1.0},
        "num_clients": 3,
        "server_fraction": 0.25,
        "max_train": 20,
        "max_test": 12,
    },
}


def folder_cfg(root: Path, case: str) -> DataConfig:
    return DataConfig(
        dataset="imagefolder", root=str(root), image_size=8, local_test_size=4,
        **FOLDER_CASES[case],
    )  # fmt: skip


@pytest.mark.parametrize("case", list(FOLDER_CASES))
def test_an_imagefolder_client_reads_only_its_own_files(folder, case, monkeypatch):
    cfg = folder_cfg(folder, case)
    dataset, partitioner = parts(cfg)
    assert dataset.reads_subsets
    whole = build_federated_data(cfg, 5, dataset, partitioner)
    classes, stats = server_meta(whole)
    read: list[str] = []
    real = ds._read_image
    monkeypatch.setattr(
        ds, "_read_image", lambda path, size: (read.append(path), real(path, size))[1]
    )
    for cid in range(cfg.num_clients):
        read.clear()
        one = build_client_data(cfg, 5, dataset, partitioner, cid, stats=stats, classes=classes)
        assert_same(one, whole.client(cid))
        own = own_files(folder, cfg, whole, cid)
        assert read == own and len(own) < len(listing(folder, "train"))


def test_an_imagefolder_client_builds_with_every_other_file_junk(folder):
    """Overwrite every file but client 1's own with bytes no decoder reads: its data still
    builds, identical, while the whole build now fails on the junk."""
    cfg = folder_cfg(folder, "dirichlet-server-limits")
    dataset, partitioner = parts(cfg)
    whole = build_federated_data(cfg, 5, dataset, partitioner)
    expected = whole.client(1)
    classes, stats = server_meta(whole)
    own = set(own_files(folder, cfg, whole, 1))
    for split in ("train", "test"):
        for path in listing(folder, split):
            if path not in own:
                Path(path).write_bytes(b"not an image")
    one = build_client_data(cfg, 5, dataset, partitioner, 1, stats=stats, classes=classes)
    assert_same(one, expected)
    with pytest.raises(RecipeError, match="readable image files"):
        build_federated_data(cfg, 5, dataset, partitioner)


def own_files(root: Path, cfg: DataConfig, whole, cid: int) -> list[str]:
    """Client ``cid``'s train then test files, in order: the whole build's positions mapped
    through ``max_train``/``max_test`` onto the file listing."""
    files = []
    for split, limit, positions in (
        ("train", cfg.max_train, whole.clients[cid]),
        ("test", cfg.max_test, whole.client_tests[cid]),
    ):
        names = np.asarray(listing(root, split))
        if limit is not None:
            names = names[ds.balanced_subset(ds.imagefolder_labels(cfg, split), limit)]
        files += [str(f) for f in names[positions]]
    return files


def test_a_data_set_with_only_a_loader_is_loaded_whole_and_sliced(folder):
    """An outside package's data set that offers ``load`` alone gives the same client."""
    cfg = folder_cfg(folder, "dirichlet-server-limits")
    plain, partitioner = Dataset(ds.load_imagefolder), parts(cfg)[1]
    assert not plain.reads_subsets
    whole = build_federated_data(cfg, 2, plain, partitioner)
    classes, stats = server_meta(whole)
    one = build_client_data(cfg, 2, plain, partitioner, 2, stats=stats, classes=classes)
    assert_same(one, whole.client(2))


def test_labels_and_subset_come_together_and_must_agree(folder):
    with pytest.raises(ValueError, match="both labels and subset"):
        Dataset(ds.load_imagefolder, labels=ds.imagefolder_labels)

    def shifted(cfg, split, indices):
        raw = ds.imagefolder_subset(cfg, split, indices)
        return ds.RawImages(raw.images, (raw.labels + 1) % len(CLASSES), raw.classes)

    lying = Dataset(ds.load_imagefolder, labels=ds.imagefolder_labels, subset=shifted)
    cfg = folder_cfg(folder, "iid")
    with pytest.raises(FedkitError, match="labels its subset loader returns"):
        build_client_data(cfg, 0, lying, parts(cfg)[1], 0, stats=((0.5,) * 3, (0.2,) * 3))

"""The federated view of a data set: clients' train and local test indices, server split.

Everything is index arrays into one shared train and one shared test ``ImageSet``, so a
run with many clients holds each image once. All randomness comes from streams spawned
from the run seed, so a seed fixes the whole layout. The layout needs labels only, so one
client's data can be built alone (``build_client_data``, a deployment's node).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedkit.config.schema import DataConfig
from fedkit.data.datasets import Dataset, ImageSet, LabelledSplit, Triple, load_splits
from fedkit.data.partition import Partitioner, overlapping, partition
from fedkit.errors import RecipeError


@dataclass
class ClientData:
    """A client's private data: its training set and its local test set."""

    id: int
    train: ImageSet
    test: ImageSet


@dataclass
class FederatedData:
    """Shared train/test sets and who holds which indices."""

    train: ImageSet
    test: ImageSet
    clients: list[np.ndarray]
    client_tests: list[np.ndarray]
    server: np.ndarray
    groups: list[int] | None

    @property
    def num_classes(self) -> int:
        return len(self.train.classes)

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def client_sizes(self) -> list[int]:
        return [len(c) for c in self.clients]

    def client(self, cid: int) -> ClientData:
        """Client ``cid``'s own data (copies of its images)."""
        return ClientData(
            cid, self.train.subset(self.clients[cid]), self.test.subset(self.client_tests[cid])
        )

    def server_split(self) -> ImageSet:
        """The server's own split (copies; empty without ``data.server_fraction``)."""
        return self.train.subset(self.server)


def build_federated_data(
    cfg: DataConfig, seed: int, dataset: Dataset, partitioner: Partitioner
) -> FederatedData:
    """Load the data set, hold out the server split, partition, draw local test sets."""
    train, test = load_splits(cfg, dataset)
    return split_federated(train, test, cfg, seed, partitioner)


def split_federated(
    train: ImageSet, test: ImageSet, cfg: DataConfig, seed: int, partitioner: Partitioner
) -> FederatedData:
    """The federated layout over already loaded sets (deterministic from ``seed``)."""
    labels = train.labels.numpy()
    server, clients, groups, test_rng = _assign(labels, cfg, seed, partitioner)
    members = class_members(test.labels.numpy())
    client_tests = [
        local_test_indices(labels[c], members, cfg.local_test_size, test_rng) for c in clients
    ]
    return FederatedData(train, test, clients, client_tests, server, groups)


def build_client_data(
    cfg: DataConfig,
    seed: int,
    dataset: Dataset,
    partitioner: Partitioner,
    client: int,
    *,
    stats: tuple[Sequence[float], Sequence[float]],
    classes: Sequence[str] | None = None,
) -> ClientData:
    """Client ``client``'s data alone: equal to ``build_federated_data(cfg, seed, dataset,
    partitioner).client(client)`` when ``stats`` and ``classes`` are the whole build's.

    The layout (server split, partition, local test sets) is computed from the labels
    only; then only this client's images are read (a data set that reads subsets, such as
    ``imagefolder``) or sliced out right after loading each split (any other data set,
    which then holds one whole split in memory at a time, briefly). Neither the server's
    split, the other clients' images nor the global test set is kept.

    ``stats`` are the normalisation ``(mean, std)`` the server computed over the whole
    train split (they cannot be computed from one client's images); ``classes``, when
    given (the server's class names), must be the data set's own, in order.
    """
    if not 0 <= client < cfg.num_clients:
        raise ValueError(f"client must be in 0..{cfg.num_clients - 1}, not {client}")
    mean, std = (_triple(values, stats) for values in stats)
    train = LabelledSplit(cfg, "train", dataset)
    labels = train.labels
    _, clients, _, test_rng = _assign(labels, cfg, seed, partitioner)
    own = train.images(clients[client])
    del train  # a data set loaded whole: free the other clients' images now
    test = LabelledSplit(cfg, "test", dataset)
    members = class_members(np.asarray(test.labels))
    for c in clients[:client]:  # the draws before this client's, from the same stream
        local_test_indices(labels[c], members, cfg.local_test_size, test_rng)
    held = local_test_indices(labels[clients[client]], members, cfg.local_test_size, test_rng)
    own_test = test.images(held)
    del test
    names = _checked_classes(cfg, dataset, own.classes, classes)
    return ClientData(
        client,
        ImageSet(own.images, own.labels, names, mean, std),
        ImageSet(own_test.images, own_test.labels, own_test.classes, mean, std),
    )


def _triple(values: Sequence[float], stats: object) -> Triple:
    if len(values) != 3:
        raise ValueError(f"stats must be (mean, std) of three channels each, not {stats!r}")
    return float(values[0]), float(values[1]), float(values[2])


def _checked_classes(
    cfg: DataConfig, dataset: Dataset, found: list[str], expected: Sequence[str] | None
) -> list[str]:
    """The data set's classes, refused when they are not the ``expected`` ones."""
    if expected is None:
        return found
    if list(expected) != list(found):
        key = "data.root" if dataset.needs_root else "data.dataset"
        raise RecipeError(
            key,
            f"the federation's classes ({', '.join(expected)})",
            ", ".join(found),
            hint=" (this machine's copy of the data set differs from the server's)",
        )
    return list(expected)


def _assign(
    labels: np.ndarray, cfg: DataConfig, seed: int, partitioner: Partitioner
) -> tuple[np.ndarray, list[np.ndarray], list[int] | None, np.random.Generator]:
    """The server split, each client's train indices and true groups, from the train
    labels alone; and the stream the local test sets are then drawn from, in client order."""
    server_rng, partition_rng, test_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)
    )
    n_server = int(round(cfg.server_fraction * len(labels)))
    server = stratified_sample(labels, n_server, server_rng)
    rest = np.setdiff1d(np.arange(len(labels)), server)
    if cfg.num_clients > len(rest) and not overlapping(partitioner):
        raise RecipeError(
            "data.num_clients",
            f"at most {len(rest)} (the train images left for clients after the server split)",
            cfg.num_clients,
        )
    split = partition(labels[rest], cfg, partition_rng, partitioner)
    clients = split.clients if len(rest) == len(labels) else [rest[c] for c in split.clients]
    return server, clients, split.groups, test_rng


def stratified_sample(labels: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of ``n`` items keeping the class proportions of ``labels``."""
    classes, counts = np.unique(labels, return_counts=True)
    quotas = _allocate(counts / counts.sum(), n) if n > 0 else np.zeros(len(classes), np.int64)
    picked = [
        rng.choice(np.flatnonzero(labels == c), size=min(q, k), replace=False)
        for c, q, k in zip(classes, quotas, counts, strict=True)
    ]
    return np.sort(np.concatenate(picked).astype(np.int64)) if picked else np.empty(0, np.int64)


def local_test_indices(
    client_labels: np.ndarray,
    test_members: Mapping[int, np.ndarray],
    size: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """``size`` test indices whose class mix follows the client's train labels, drawn
    from the test set's ``class_members`` (computed once for every client).

    Drawn without replacement within the client; a class with fewer test images than its
    share gives all it has, so the set can come out smaller than ``size``.
    """
    classes, counts = np.unique(client_labels, return_counts=True)
    if len(classes) == 0:
        return np.empty(0, np.int64)
    quotas = _allocate(counts / counts.sum(), size)
    picked = []
    for c, quota in zip(classes, quotas, strict=True):
        members = test_members.get(int(c), EMPTY)
        picked.append(rng.choice(members, size=min(int(quota), len(members)), replace=False))
    return np.sort(np.concatenate(picked).astype(np.int64))


EMPTY = np.empty(0, np.int64)


def class_members(labels: np.ndarray) -> dict[int, np.ndarray]:
    """Each class's indices in ``labels``, ascending: what ``np.flatnonzero(labels == c)``
    gives, computed in one pass (a federation of 10⁵ clients asks it once, not per client)."""
    order = np.argsort(labels, kind="stable")
    classes, starts = np.unique(labels[order], return_index=True)
    ends = [*starts[1:], len(order)]
    return {int(c): order[a:b] for c, a, b in zip(classes, starts, ends, strict=True)}


def _allocate(shares: np.ndarray, n: int) -> np.ndarray:
    """Split ``n`` by ``shares`` into integers summing to ``n`` (largest remainder)."""
    exact = shares * n
    quotas = np.floor(exact).astype(np.int64)
    short = n - int(quotas.sum())
    quotas[np.argsort(-(exact - quotas), kind="stable")[:short]] += 1
    return quotas

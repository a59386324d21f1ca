"""Partitioners: how a labelled train set is split among federated clients.

Each partitioner is ``fn(labels, num_clients, rng, **params) -> Partition``, registered
under a name by a plugin (``register_partitioners``; the ones below by fedkit's
``partitioners`` plugin); a recipe names one under ``data.partition`` with its
parameters, which are checked against the function's signature before it runs.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedkit.config.schema import DataConfig
from fedkit.errors import RecipeError, did_you_mean

_FIXED_ARGS = 3
_DIRICHLET_ATTEMPTS = 100


@dataclass
class Partition:
    """Train indices per client (disjoint, sorted), with true groups when defined."""

    clients: list[np.ndarray]
    groups: list[int] | None = None
    client_classes: list[list[int]] | None = None


Partitioner = Callable[..., Partition]


def partition(
    labels: np.ndarray, cfg: DataConfig, rng: np.random.Generator, fn: Partitioner
) -> Partition:
    """Split ``labels`` among ``cfg.num_clients`` with the partitioner ``fn`` (the one
    ``cfg.partition.name`` names), after checking its parameters."""
    check_params(cfg.partition.name, fn, cfg.partition.params)
    params = cfg.partition.params
    labels = np.asarray(labels)
    if cfg.num_clients > len(labels) and not overlapping(fn):
        raise RecipeError(
            "data.num_clients",
            f"at most {len(labels)} (the train images to share)",
            cfg.num_clients,
        )
    split = fn(labels, cfg.num_clients, rng, **params)
    check_partition(cfg.partition.name, split, cfg.num_clients, len(labels), overlapping(fn))
    return split


def overlapping(fn: Partitioner) -> bool:
    """Whether a partitioner declares that its clients may share images
    (``fn.overlapping = True``, as ``sampled`` does): then there may be more clients than
    images, and its partitions are not checked for disjoint clients."""
    return bool(getattr(fn, "overlapping", False))


def check_partition(
    name: str, split: Any, num_clients: int, size: int, shared: bool = False
) -> None:
    """Refuse a partition that would train on the wrong images, naming the partitioner
    and the first client at fault: one index array per client (``num_clients`` of them),
    integer indices in ``0 .. size-1``, no image twice (unless ``shared``: the
    partitioner declares overlap). Vectorised: one pass over all indices, before round 1."""

    def refuse(problem: str) -> RecipeError:
        return RecipeError(
            "data.partition.name",
            "a partitioner that returns one array of indices per client, each in "
            f"0..{size - 1} (the {size} train images it splits)"
            + (" (clients may share images: it declares overlap)" if shared else ", disjoint"),
            name,
            hint=f": {problem}",
        )

    if not isinstance(split, Partition):
        raise refuse(f"it returned {type(split).__name__}, not a fedkit.Partition")
    clients = split.clients
    if not isinstance(clients, Sequence | np.ndarray) or isinstance(clients, str | bytes):
        raise refuse(f"its clients are a {type(clients).__name__}, not a list of arrays")
    if len(clients) != num_clients:
        raise refuse(f"it gave {len(clients)} index arrays for data.num_clients={num_clients}")
    for label, values in (("groups", split.groups), ("client_classes", split.client_classes)):
        if values is not None and len(values) != num_clients:
            raise refuse(f"its {label} has {len(values)} entries for {num_clients} clients")
    kinds = {getattr(getattr(c, "dtype", None), "kind", "?") for c in clients}
    try:
        flat = np.concatenate(list(clients)) if num_clients else np.empty(0, np.int64)
    except (ValueError, TypeError):
        flat = None
    if flat is None or flat.ndim != 1 or not kinds <= {"i", "u"}:
        for cid, client in enumerate(clients):  # only when something is wrong: which client
            array = np.asarray(client)
            if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
                kind = f"{array.ndim}-d" if array.ndim != 1 else f"of {array.dtype}"
                raise refuse(f"client {cid}'s indices are an array {kind}, not of integers")
        if flat is None:
            raise refuse("its clients are not index arrays")
        flat = flat.astype(np.int64)  # integers, and empty lists that numpy reads as floats
    lengths = np.fromiter(map(len, clients), np.int64, num_clients)
    ends = np.cumsum(lengths)

    def owner(position: int) -> int:
        return int(np.searchsorted(ends, position, side="right"))

    outside = np.flatnonzero((flat < 0) | (flat >= size))
    if outside.size:
        first = int(outside[0])
        raise refuse(f"client {owner(first)} holds index {int(flat[first])}")
    if shared:
        return
    counts = np.bincount(flat.astype(np.int64, copy=False), minlength=size)
    twice = np.flatnonzero(counts > 1)
    if twice.size:
        image = int(twice[0])
        holders = sorted({owner(int(p)) for p in np.flatnonzero(flat == image)})
        who = (
            f"client {holders[0]} holds image {image} more than once"
            if len(holders) == 1
            else f"clients {holders[0]} and {holders[1]} both hold image {image}"
        )
        raise refuse(who)


def parameters_of(fn: Partitioner) -> dict[str, inspect.Parameter]:
    """The recipe parameters a partitioner accepts (its arguments after the fixed three)."""
    return dict(list(inspect.signature(fn).parameters.items())[_FIXED_ARGS:])


def check_params(name: str, fn: Partitioner, params: dict[str, Any]) -> None:
    """Reject unknown and missing parameters, naming the accepted ones."""
    accepted = parameters_of(fn)
    listing = ", ".join(accepted) or "no parameters"
    for key in params:
        if key not in accepted:
            raise RecipeError(
                f"data.partition.{key}",
                f"a parameter of partitioner {name!r} ({listing})",
                params[key],
                hint=did_you_mean(key, accepted),
            )
    for key, param in accepted.items():
        if param.default is inspect.Parameter.empty and key not in params:
            raise RecipeError(
                f"data.partition.{key}", f"a value (partitioner {name!r} requires it)"
            )


def _number(name: str, value: Any, *, integer: bool, minimum: float, strict: bool = False):
    """Check a numeric parameter; ``strict`` makes ``minimum`` exclusive."""
    kind = numbers.Integral if integer else numbers.Real
    ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (value > minimum if strict else value >= minimum):
        what = "an integer" if integer else "a finite number"
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise RecipeError(f"data.partition.{name}", f"{what} {bound}", value)
    return value


def _finish(chunks: Sequence[np.ndarray], **extra: Any) -> Partition:
    clients = [np.sort(np.asarray(c, dtype=np.int64)) for c in chunks]
    return Partition(clients, **extra)


def sampled(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, size: int = 3
) -> Partition:
    """Each client ``size`` training images drawn uniformly at random, independently of
    the others (clients may share images): a population far larger than the data set,
    as a cross-device study of a million simulated clients needs, held as index arrays
    only."""
    _number("size", size, integer=True, minimum=1)
    drawn = np.sort(rng.integers(0, len(labels), size=(num_clients, size)), axis=1)
    return Partition(list(drawn))


sampled.overlapping = True  # type: ignore[attr-defined]
"""Clients may share images, so there may be more clients than images (``overlapping``)."""


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> Partition:
    """Shuffle and split evenly: client sizes differ by at most one."""
    return _finish(np.array_split(rng.permutation(len(labels)), num_clients))


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float,
    min_size: int = 1,
    cap: bool = False,
    draw_seed: int | None = None,
) -> Partition:
    """Per class, client shares ~ Dir(alpha); redrawn until each client has ``min_size``.

    ``cap``: NIID-Bench's balancing. Classes are dealt in order, and a client that already
    holds its even share (images / clients) gets no part of the later classes.

    With ``draw_seed`` the draws come from ``numpy.random.default_rng(draw_seed)`` in the
    order of NIID-Bench's code as Flower's baseline runs it (each class shuffled before its
    shares are drawn), instead of from the run's generator: a run then holds the partition
    of that code's table for the same seed.
    """
    _number("alpha", alpha, integer=False, minimum=0, strict=True)
    _number("min_size", min_size, integer=True, minimum=0)
    if draw_seed is not None:
        _number("draw_seed", draw_seed, integer=True, minimum=0)
        rng = np.random.default_rng(draw_seed)
    if num_clients * min_size > len(labels):
        raise RecipeError(
            "data.partition.min_size",
            f"at most {len(labels) // num_clients} ({len(labels)} images, {num_clients} clients)",
            min_size,
        )
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(_DIRICHLET_ATTEMPTS):
        chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for members in by_class:
            if draw_seed is not None:
                members = rng.permutation(members)
            shares = rng.dirichlet(np.full(num_clients, float(alpha)))
            if cap:
                held = np.array([sum(len(p) for p in parts) for parts in chunks])
                capped = shares * (held < len(labels) / num_clients)
                shares = capped / capped.sum() if capped.sum() > 0 else shares
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
            if draw_seed is None:
                members = rng.permutation(members)
            for client, part in enumerate(np.split(members, cuts)):
                chunks[client].append(part)
        clients = [np.concatenate(parts) for parts in chunks]
        if min(len(c) for c in clients) >= min_size:
            return _finish(clients)
    raise RecipeError(
        "data.partition.min_size",
        f"a size that Dirichlet(alpha={alpha}) draws reach within {_DIRICHLET_ATTEMPTS} attempts",
        min_size,
        hint=" (raise alpha, lower min_size or use fewer clients)",
    )


def classes_per_client(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, k: int
) -> Partition:
    """The label-skew non-IID split: each client holds ``k`` classes, classes used evenly.

    Clients take ``k`` consecutive classes from a seeded cyclic class order, so every class
    goes to the same number of clients (±1); a class held by several clients is cut into
    equal shards among them.
    """
    classes = np.unique(labels)
    _number("k", k, integer=True, minimum=1)
    if k > len(classes):
        raise RecipeError("data.partition.k", f"at most {len(classes)} (the classes)", k)
    order = rng.permutation(classes)
    held = [[int(order[(i * k + j) % len(classes)]) for j in range(k)] for i in range(num_clients)]
    return _shards(labels, classes, held, rng)


def _shards(
    labels: np.ndarray, classes: np.ndarray, held: list[list[int]], rng: np.random.Generator
) -> Partition:
    """Each class cut into equal random shards, one per client that holds it (in client
    order); a class nobody holds is left out."""
    chunks: list[list[np.ndarray]] = [[] for _ in held]
    for c in classes:
        holders = [i for i, own in enumerate(held) if c in own]
        if not holders:
            continue
        shards = np.array_split(rng.permutation(np.flatnonzero(labels == c)), len(holders))
        for client, shard in zip(holders, shards, strict=True):
            chunks[client].append(shard)
    clients = [np.concatenate(parts) if parts else np.empty(0, np.int64) for parts in chunks]
    return _finish(clients, client_classes=[sorted(h) for h in held])


def labels_per_client(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    k: int,
    draw_seed: int | None = None,
) -> Partition:
    """NIID-Bench's "#C=k" label skew: client ``i`` holds class ``i mod K`` and ``k - 1``
    other classes drawn at random (distinct), and each class's images are cut into equal
    shards among the clients that hold it (a class nobody holds is left out).

    With ``draw_seed`` the draws come from ``numpy.random.default_rng(draw_seed)``, in the
    order of NIID-Bench's code as Flower's baseline runs it (a class drawn among all K
    until it is a new one, then each class shuffled and cut), instead of from the run's
    generator: a run then holds the label sets of that code's table for the same seed."""
    classes = np.unique(labels)
    _number("k", k, integer=True, minimum=1)
    if k > len(classes):
        raise RecipeError("data.partition.k", f"at most {len(classes)} (the classes)", k)
    if draw_seed is not None:
        _number("draw_seed", draw_seed, integer=True, minimum=0)
        rng = np.random.default_rng(draw_seed)
    held = []
    for i in range(num_clients):
        own = [int(classes[i % len(classes)])]
        if draw_seed is None:
            others = [int(c) for c in classes if c != own[0]]
            own += [int(c) for c in rng.choice(others, size=k - 1, replace=False)]
        else:
            while len(own) < k:
                drawn = int(classes[rng.choice(len(classes), 1)[0]])
                if drawn not in own:
                    own.append(drawn)
        held.append(own)
    return _shards(labels, classes, held, rng)


def cluster_groups(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    num_groups: int = 3,
    classes_per_group: int = 4,
    per_class: Sequence[int] = (20, 20, 5, 5),
    overlap: int = 1,
) -> Partition:
    """The clustered set-up: client groups sharing a class set, with uneven per-class counts.

    Clients are split evenly into ``num_groups`` contiguous groups; group g holds the
    ``classes_per_group`` classes starting at ``g * (classes_per_group - overlap)``. Each
    client holds all its group's classes, with ``per_class`` counts rotated by the
    client's position in the group so that which classes are large varies.
    """
    classes = np.unique(labels)
    group_classes = _group_classes(classes, num_groups, classes_per_group, overlap)
    per_class = _per_class(per_class, classes_per_group)
    if num_clients < num_groups:
        raise RecipeError(
            "data.num_clients", f"at least num_groups={num_groups} clients", num_clients
        )
    groups = np.concatenate(
        [
            np.full(len(m), g)
            for g, m in enumerate(np.array_split(np.arange(num_clients), num_groups))
        ]
    )
    wants = _cluster_wants(groups, group_classes, per_class)
    pools = _class_pools(labels, wants, rng)
    chunks = []
    for client_wants in wants:
        chunks.append(np.concatenate([pools[c].take(n) for c, n in client_wants.items()]))
    return _finish(
        chunks,
        groups=[int(g) for g in groups],
        client_classes=[sorted(w) for w in wants],
    )


def _group_classes(
    classes: np.ndarray, num_groups: int, classes_per_group: int, overlap: int
) -> list[list[int]]:
    _number("num_groups", num_groups, integer=True, minimum=1)
    _number("classes_per_group", classes_per_group, integer=True, minimum=1)
    _number("overlap", overlap, integer=True, minimum=0)
    if overlap >= classes_per_group:
        raise RecipeError(
            "data.partition.overlap", f"less than classes_per_group={classes_per_group}", overlap
        )
    step = classes_per_group - overlap
    needed = (num_groups - 1) * step + classes_per_group
    if needed > len(classes):
        raise RecipeError(
            "data.partition.classes_per_group",
            f"groups that fit in the {len(classes)} classes of the data set "
            f"({num_groups} groups of {classes_per_group} with overlap {overlap} need {needed})",
            classes_per_group,
        )
    return [
        [int(c) for c in classes[g * step : g * step + classes_per_group]]
        for g in range(num_groups)
    ]


def _per_class(per_class: Any, classes_per_group: int) -> list[int]:
    if not isinstance(per_class, (list, tuple)) or len(per_class) != classes_per_group:
        raise RecipeError(
            "data.partition.per_class",
            f"a list of {classes_per_group} counts (one per class of a group)",
            per_class,
        )
    for count in per_class:
        _number("per_class", count, integer=True, minimum=0)
    return [int(c) for c in per_class]


def _cluster_wants(
    groups: np.ndarray, group_classes: list[list[int]], per_class: list[int]
) -> list[dict[int, int]]:
    """How many images of each class each client should get (rotated per client)."""
    wants = []
    position = {g: 0 for g in range(len(group_classes))}
    for g in groups:
        shift = position[int(g)]
        position[int(g)] += 1
        counts = np.roll(per_class, shift)
        wants.append({c: int(n) for c, n in zip(group_classes[g], counts, strict=True) if n > 0})
    return wants


class _Pool:
    """A class's shuffled indices, handed out without replacement."""

    def __init__(self, indices: np.ndarray) -> None:
        self.indices, self.next = indices, 0

    def take(self, n: int) -> np.ndarray:
        out = self.indices[self.next : self.next + n]
        self.next += n
        return out


def _class_pools(
    labels: np.ndarray, wants: list[dict[int, int]], rng: np.random.Generator
) -> dict[int, _Pool]:
    """Shuffled pools per class, after checking the data set holds enough of each."""
    pools = {}
    for c in sorted({c for w in wants for c in w}):
        need = sum(w.get(c, 0) for w in wants)
        members = np.flatnonzero(labels == c)
        if need > len(members):
            raise RecipeError(
                "data.partition.per_class",
                f"counts the train split can supply: class {c} needs {need} images across "
                f"the clients holding it, the split has {len(members)}",
                hint=" (lower per_class or num_clients, or raise data.max_train)",
            )
        pools[c] = _Pool(rng.permutation(members))
    return pools

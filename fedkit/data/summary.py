"""The partition summary: per-client sizes and class counts, printed and saved with a run.

Rows are plain dicts of JSON types, so the saved file reads back equal to what was built.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from rich.table import Table

from fedkit.data.federated import FederatedData
from fedkit.rundir.atomic import write_chunks

_CAPTION_CLASSES = 20


def partition_rows(fd: FederatedData, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """One row per client (the first ``limit`` clients; all by default), made as they
    are asked for: sizes, true group, and per-class counts (lists by class id)."""
    train_labels, test_labels = fd.train.labels.numpy(), fd.test.labels.numpy()
    pairs = zip(fd.clients, fd.client_tests, strict=True)
    for i, (train_idx, test_idx) in enumerate(itertools.islice(pairs, limit)):
        yield {
            "client": i,
            "n_train": int(len(train_idx)),
            "n_test": int(len(test_idx)),
            "group": None if fd.groups is None else int(fd.groups[i]),
            "train_counts": _counts(train_labels[train_idx], fd.num_classes),
            "test_counts": _counts(test_labels[test_idx], fd.num_classes),
        }


def partition_table(fd: FederatedData, limit: int | None = None) -> list[dict[str, Any]]:
    """The rows of ``partition_rows`` as a list."""
    return list(partition_rows(fd, limit))


def _counts(labels: np.ndarray, num_classes: int) -> list[int]:
    labels = labels[labels >= 0]
    return np.bincount(labels, minlength=num_classes).tolist()


def render_partition(rows: list[dict[str, Any]], classes: list[str]) -> Table:
    """A compact table: client, train, test, group and non-zero train class counts."""
    shown = ", ".join(f"c{i}={name}" for i, name in enumerate(classes[:_CAPTION_CLASSES]))
    more = f", … ({len(classes)} classes)" if len(classes) > _CAPTION_CLASSES else ""
    table = Table(title="Partition", caption=shown + more, show_edge=False, pad_edge=False)
    for name in ("client", "train", "test"):
        table.add_column(name, justify="right")
    table.add_column("group", justify="right")
    table.add_column("classes (train counts)", overflow="fold")
    for row in rows:
        counts = " ".join(f"c{c}:{n}" for c, n in enumerate(row["train_counts"]) if n)
        group = "-" if row["group"] is None else str(row["group"])
        table.add_row(str(row["client"]), str(row["n_train"]), str(row["n_test"]), group, counts)
    return table


def save_partition(rows: Iterable[dict[str, Any]], path: str | os.PathLike) -> None:
    """Write the rows as a JSON list, one row per line, atomically (streamed: a million
    clients' rows are never all in memory)."""

    def pieces() -> Iterator[str]:
        yield "["
        for i, row in enumerate(rows):
            yield ("\n" if i == 0 else ",\n") + json.dumps(row)
        yield "\n]\n"

    write_chunks(path, pieces())

"""The partition summary: per-client sizes and class counts, printed and saved with a run.

Rows are plain dicts of JSON types, so the saved file reads back equal to what was built.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from rich.table import Table

from fedkit.data.federated import FederatedData
from fedkit.rundir.atomic import write_text

_CAPTION_CLASSES = 20


def partition_table(fd: FederatedData) -> list[dict[str, Any]]:
    """One row per client: sizes, true group, and per-class counts (lists by class id)."""
    train_labels, test_labels = fd.train.labels.numpy(), fd.test.labels.numpy()
    rows = []
    for i, (train_idx, test_idx) in enumerate(zip(fd.clients, fd.client_tests, strict=True)):
        rows.append(
            {
                "client": i,
                "n_train": int(len(train_idx)),
                "n_test": int(len(test_idx)),
                "group": None if fd.groups is None else int(fd.groups[i]),
                "train_counts": _counts(train_labels[train_idx], fd.num_classes),
                "test_counts": _counts(test_labels[test_idx], fd.num_classes),
            }
        )
    return rows


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


def save_partition(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Write the rows as JSON atomically."""
    write_text(path, json.dumps(rows, indent=1) + "\n")

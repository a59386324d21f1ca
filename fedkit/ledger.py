"""The communication and privacy ledger: every byte between clients and server.

One row per (round, client): bytes sent down and up, each in three categories:

* ``model``: keys of the template model's state dict (parameters and buffers);
* ``aux``: non-model keys a plugin declared auxiliary (control variates, optimiser state);
* ``data``: every other key: data-derived (features, statistics, public data).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor

from fedkit.keys import matching

CATEGORIES = ("model", "aux", "data")
FIELDS = tuple(f"{d}_{c}" for d in ("down", "up") for c in CATEGORIES)


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Ledger:
    """Byte counts per round and client; JSON-serialisable for checkpoints.

    ``model_keys`` and ``aux_patterns`` decide the category of each key; the server sets
    them once the template and the plugins' declarations are known.
    """

    def __init__(self, rows: list[dict[str, int]] | None = None) -> None:
        self.rows: dict[tuple[int, int], dict[str, int]] = {}
        self.model_keys: frozenset[str] = frozenset()
        self.aux_patterns: tuple[str, ...] = ()
        for row in rows or []:
            self.rows[(row["round"], row["client"])] = {**dict.fromkeys(FIELDS, 0), **row}

    def category(self, key: str) -> str:
        if key in self.model_keys:
            return "model"
        return "aux" if matching([key], self.aux_patterns) else "data"

    def record(
        self, round: int, client: int, direction: str, tensors: Mapping[str, Tensor]
    ) -> None:
        """Add a transfer (``direction`` is ``down`` or ``up``), split by category."""
        row = self.rows.setdefault(
            (round, client), {"round": round, "client": client, **dict.fromkeys(FIELDS, 0)}
        )
        for key, value in tensors.items():
            row[f"{direction}_{self.category(key)}"] += value.numel() * value.element_size()

    def totals(self, round: int | None = None) -> dict[str, int]:
        """Sums over all rows (or one round's rows), plus ``total``."""
        sums = dict.fromkeys(FIELDS, 0)
        for (r, _), row in self.rows.items():
            if round is None or r == round:
                for field in FIELDS:
                    sums[field] += row[field]
        sums["total"] = sum(sums[f] for f in FIELDS)
        return sums

    def to_rows(self) -> list[dict[str, int]]:
        return [self.rows[k] for k in sorted(self.rows)]

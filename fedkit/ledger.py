"""The communication and privacy ledger: every byte between clients and server.

One row per (round, client): bytes sent down and up, each split into model parameters
and data-derived tensors (features, statistics: anything that is not a model key).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor

FIELDS = ("down_model", "down_data", "up_model", "up_data")


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Ledger:
    """Byte counts per round and client; JSON-serialisable for checkpoints."""

    def __init__(self, rows: list[dict[str, int]] | None = None) -> None:
        self.rows: dict[tuple[int, int], dict[str, int]] = {}
        for row in rows or []:
            self.rows[(row["round"], row["client"])] = dict(row)

    def record(
        self, round: int, client: int, direction: str, tensors: Mapping[str, Tensor], model_keys
    ) -> None:
        """Add a transfer; keys in ``model_keys`` count as model, the rest as data-derived."""
        row = self.rows.setdefault(
            (round, client), {"round": round, "client": client, **dict.fromkeys(FIELDS, 0)}
        )
        row[f"{direction}_model"] += tensor_bytes(t for k, t in tensors.items() if k in model_keys)
        row[f"{direction}_data"] += tensor_bytes(
            t for k, t in tensors.items() if k not in model_keys
        )

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

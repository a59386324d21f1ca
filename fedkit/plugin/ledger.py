"""The communication and privacy ledger: every byte between clients and server.

One row per (round, client): bytes sent down (the round's job), up (the client's
reply) and ``eval`` (the evaluation exchange: the state sent to a client to score on its
own test data, and the scores it returns). Tensors are booked by key, at their
``nbytes``, in three categories:

* ``model``: keys of the template model's state dict (parameters and buffers);
* ``aux``: non-model keys a plugin declared auxiliary (control variates, optimiser state);
* ``data``: every other key: data-derived (features, statistics, public data).

What a client reports (``ctx.log``, its evaluation scores) is booked as ``metrics``:
``up_metrics`` for a training reply's values, ``eval_metrics`` for an evaluation's
scores. A value's bytes are those of its name plus its compact JSON encoding in UTF-8
(``value_bytes``): ``loss=0.25`` is ``len("loss") + len("0.25")`` = 8 bytes, whatever a
transport adds around it. ``total`` is the sum of every field, so it counts everything
that crossed. A reply the server refused (``fedkit.core.reply_checks``) is not booked:
the server discarded it, and ``failures.jsonl`` records it instead.

Secure aggregation's own messages are booked as ``secagg`` (``down_secagg``,
``up_secagg``: SecAgg+'s settings, public keys, encrypted shares, masked vectors and
unmasking shares, counted as Flower counts a message's values). A client whose upload
went into SecAgg+'s sum sent it only there, masked, so its ``up`` tensor fields stay 0;
a client that dropped out of the protocol books what was sent to it and what it sent
before it left (decision 0029).

Privacy is booked beside the bytes: a plugin that releases something under differential
privacy calls ``spend`` with the (ε, δ) spent by the end of a round, cumulative, under a
level name of its choosing (``client``, ``sample``); the round's metrics row carries the
entries under ``privacy``, so the run summary's final row has the whole run's.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

CATEGORIES = ("model", "aux", "data")
DIRECTIONS = ("down", "up", "eval")
TENSOR_FIELDS = tuple(f"{d}_{c}" for d in DIRECTIONS for c in CATEGORIES)
"""Bytes of tensors, per direction and category."""
METRIC_FIELDS = ("up_metrics", "eval_metrics")
"""Bytes of reported values: a training reply's, an evaluation's scores."""
PROTOCOL_FIELDS = ("down_secagg", "up_secagg")
"""Bytes of secure aggregation's own messages to and from a client (masked uploads too)."""
FIELDS = TENSOR_FIELDS + METRIC_FIELDS + PROTOCOL_FIELDS
"""Every field of a ledger row and of the totals (besides ``total``)."""


def value_bytes(name: str, value: Any) -> int:
    """The bytes a reported value is booked at: the UTF-8 length of its name plus that of
    its compact JSON encoding (``json.dumps(value, separators=(",", ":"),
    ensure_ascii=False)``; ``true``, ``0.25``, ``"text"`` with its quotes, ``NaN``)."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return len(name.encode()) + len(text.encode())


class Ledger:
    """Byte counts per round and client.

    ``model_keys`` and ``aux_patterns`` decide the category of each key; the server sets
    them once the template and the plugins' declarations are known. ``rows`` are the rows
    not yet written out: a run directory appends them to ``ledger.jsonl`` at every
    checkpoint (``flush``) and keeps only their running totals (``flushed``), so memory
    and checkpoints do not grow with the rounds done.
    """

    def __init__(self, flushed: dict[str, int] | None = None) -> None:
        self.rows: dict[tuple[int, int], dict[str, int]] = {}
        self.flushed: dict[str, int] = {**dict.fromkeys(FIELDS, 0), **(flushed or {})}
        self._model_keys: frozenset[str] = frozenset()
        self._aux_patterns: tuple[str, ...] = ()
        self._categories: dict[str, str] = {}
        self.privacy: dict[int, dict[str, dict[str, Any]]] = {}

    @property
    def model_keys(self) -> frozenset[str]:
        return self._model_keys

    @model_keys.setter
    def model_keys(self, keys: frozenset[str]) -> None:
        self._model_keys, self._categories = frozenset(keys), {}

    @property
    def aux_patterns(self) -> tuple[str, ...]:
        return self._aux_patterns

    @aux_patterns.setter
    def aux_patterns(self, patterns: tuple[str, ...]) -> None:
        self._aux_patterns, self._categories = tuple(patterns), {}

    def category(self, key: str) -> str:
        """``model``, ``aux`` or ``data`` (memoised until the keys or patterns change: a
        round books every key per client)."""
        found = self._categories.get(key)
        if found is None:
            if key in self._model_keys:
                found = "model"
            elif any(fnmatch.fnmatchcase(key, p) for p in self._aux_patterns):
                found = "aux"
            else:
                found = "data"
            self._categories[key] = found
        return found

    def _row(self, round: int, client: int) -> dict[str, int]:
        """The pending row of (``round``, ``client``), made empty on first use."""
        return self.rows.setdefault(
            (round, client), {"round": round, "client": client, **dict.fromkeys(FIELDS, 0)}
        )

    def record(
        self, round: int, client: int, direction: str, tensors: Mapping[str, Tensor]
    ) -> None:
        """Add a transfer (``direction``: ``down``, ``up`` or ``eval``), split by category."""
        row = self._row(round, client)
        for key, value in tensors.items():
            row[direction + "_" + self.category(key)] += value.nbytes

    def record_values(
        self, round: int, client: int, direction: str, values: Mapping[str, Any]
    ) -> None:
        """Add reported values (``direction``: ``up`` for a training reply's, ``eval`` for
        an evaluation's scores) at ``value_bytes`` each."""
        if not values:
            return
        row = self._row(round, client)
        row[direction + "_metrics"] += sum(value_bytes(k, v) for k, v in values.items())

    def record_protocol(self, round: int, client: int, down: int, up: int) -> None:
        """Add the bytes of secure aggregation's messages to (``down``) and from (``up``)
        a client in ``round``."""
        if min(down, up) < 0:
            raise ValueError(f"protocol bytes: expected counts ≥ 0, found {down}, {up}")
        row = self._row(round, client)
        row["down_secagg"] += int(down)
        row["up_secagg"] += int(up)

    def spend(self, round: int, *, epsilon: float, delta: float, level: str, **about: Any) -> None:
        """Book the privacy spent by the end of ``round`` at ``level``: (``epsilon``,
        ``delta``) over every round so far, not this round's share; ``about`` adds JSON
        values that say how it was counted (the accountant, the noise). Call it from a
        server hook up to ``round_end``."""
        if not (isinstance(level, str) and level):
            raise ValueError(f"privacy level: expected a non-empty name, found {level!r}")
        if not epsilon >= 0 or not 0 <= delta < 1:
            raise ValueError(f"privacy spent: expected ε ≥ 0, 0 ≤ δ < 1; found {epsilon}, {delta}")
        entry = {"epsilon": float(epsilon), "delta": float(delta), **about}
        self.privacy.setdefault(round, {})[level] = entry

    def spent(self, round: int) -> dict[str, dict[str, Any]]:
        """The privacy booked for ``round`` by level (handed over once: the metrics row
        keeps it), dropping any booked for an earlier round."""
        for r in [r for r in self.privacy if r < round]:
            del self.privacy[r]
        return self.privacy.pop(round, {})

    def restore(self, flushed: Mapping[str, int]) -> None:
        """Take a checkpoint's totals back (a field an older fedkit did not book is 0)."""
        self.rows.clear()
        self.privacy.clear()
        self.flushed = {**dict.fromkeys(FIELDS, 0), **flushed}

    def totals(self, round: int | None = None) -> dict[str, int]:
        """Sums over the whole run (or one round not yet flushed), plus ``total``."""
        sums = dict(self.flushed) if round is None else dict.fromkeys(FIELDS, 0)
        for (r, _), row in self.rows.items():
            if round is None or r == round:
                for field in FIELDS:
                    sums[field] += row[field]
        sums["total"] = sum(sums[f] for f in FIELDS)
        return sums

    def to_rows(self) -> list[dict[str, int]]:
        """The rows not flushed yet, by (round, client)."""
        return [self.rows[k] for k in sorted(self.rows)]

    def flush(self) -> list[dict[str, int]]:
        """Hand over the pending rows (to be appended to a file) and keep their totals."""
        rows = self.to_rows()
        for row in rows:
            for field in FIELDS:
                self.flushed[field] += row[field]
        self.rows.clear()
        return rows

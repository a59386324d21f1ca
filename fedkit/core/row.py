"""Turning what clients report into a round's metrics row: their training reports, and
the scores of their personal models on evaluation rounds.

Every numeric value a client reports (its training loss, extra loss terms, whatever
``ctx.log`` or ``after_local_train`` returned) becomes ``train_<name>``: the mean over
the round's clients weighted by their sample counts (booleans become the fraction that
was true). Every value, numeric or not, is also kept per client under ``per_client``.
The values are JSON numbers, booleans and short strings: the client's ``ctx.log`` and the
server's reply checks (``fedkit.plugin.reported``) let nothing else through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedkit.core.messages import ClientResult, EvalResult


def is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float))


def summarise(results: Sequence[ClientResult]) -> dict[str, Any]:
    """``train_<name>`` sample-weighted means and the ``per_client`` values."""
    per_client = {str(r.client): dict(r.metrics) for r in results}
    names: dict[str, None] = {}
    for values in per_client.values():
        names.update({k: None for k, v in values.items() if is_number(v)})
    row: dict[str, Any] = {}
    for name in names:
        pairs = [
            (float(per_client[str(r.client)][name]), r.weight)
            for r in results
            if is_number(per_client[str(r.client)].get(name))
        ]
        total = sum(w for _, w in pairs)
        if total > 0:
            row[f"train_{name}"] = sum(v * w for v, w in pairs) / total
        else:
            row[f"train_{name}"] = sum(v for v, _ in pairs) / len(pairs)
    row["per_client"] = per_client
    return row


def evaluation_entries(results: Sequence[EvalResult]) -> dict[str, Any]:
    """What clients' evaluations add to a round's row: for every numeric score ``m``,
    ``personalized_m`` (the mean over the clients that reported it) and ``client_m`` (each
    client's value), in client-id order; clients whose evaluation failed, under
    ``eval_failures``; those answered on a second attempt, under ``eval_retried``."""
    done = sorted((r for r in results if r.failure is None), key=lambda r: r.client)
    names: dict[str, None] = {}
    for r in done:
        names.update({k: None for k, v in r.metrics.items() if is_number(v)})
    row: dict[str, Any] = {}
    for name in names:
        values = {
            str(r.client): float(r.metrics[name]) for r in done if is_number(r.metrics.get(name))
        }
        row[f"personalized_{name}"] = float(np.mean(list(values.values())))
        row[f"client_{name}"] = values
    failed = sorted((r for r in results if r.failure is not None), key=lambda r: r.client)
    if failed:
        row["eval_failures"] = {str(r.client): f"{r.failure}: {r.error}" for r in failed}
    retried = {str(r.client): r.retried for r in done if r.retried}
    if retried:
        row["eval_retried"] = retried
    return row

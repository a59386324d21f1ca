"""A run directory's log files and their readers, light enough for reports and scripts.

These readers import neither torch nor the engine, so ``fedkit report`` and analysis
scripts start fast. The rows' meaning is described in ``docs/runs.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECIPE = "recipe.yaml"
METRICS = "metrics.jsonl"
CLIENTS = "clients.jsonl"
LEDGER = "ledger.jsonl"
FAILURES = "failures.jsonl"
LOGS = (METRICS, CLIENTS, LEDGER, FAILURES)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a JSON-lines file (none if it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(out: str | Path) -> list[dict[str, Any]]:
    """The run's metrics rows (per-client values are in ``read_clients``)."""
    return read_jsonl(Path(out) / METRICS)


def read_clients(out: str | Path) -> list[dict[str, Any]]:
    """Per round: ``per_client`` values and the ``clusters`` the sampled clients chose."""
    return read_jsonl(Path(out) / CLIENTS)


def read_ledger(out: str | Path) -> list[dict[str, Any]]:
    """Bytes per round and client: down/up × model/aux/data."""
    return read_jsonl(Path(out) / LEDGER)


def read_failures(out: str | Path) -> list[dict[str, Any]]:
    """Clients that failed: round, client, attempt, kind and message."""
    return read_jsonl(Path(out) / FAILURES)

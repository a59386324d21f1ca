"""A run directory's log files: their names, their readers, and how they are written.

Logs are JSON lines, appended at each checkpoint with the rounds done since the last
one: ``metrics.jsonl`` (one small row per round), ``clients.jsonl`` (per round: what
each sampled client reported, the cluster it chose, per-client evaluation),
``ledger.jsonl`` (bytes per round and client) and ``failures.jsonl`` (clients that
failed). Each is fsynced as it grows and has a second copy under
``checkpoints/journal/``; a checkpoint records each log's length and the hash of that
prefix, so resume cuts whatever was appended after it and rebuilds a damaged or deleted
log from its copy. Nothing is rewritten as a run grows. ``times.jsonl`` is the
exception, on purpose: the wall time of every session and round, appended as each
round ends and never cut, so time spent on rounds a kill threw away still counts
(decision 0014). This module imports neither torch
nor the engine, so ``fedkit report`` and analysis scripts start fast; the rows' meaning
is in ``docs/runs.md``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedkit.errors import FedkitError
from fedkit.rundir.atomic import write_bytes
from fedkit.rundir.integrity import sha256_file

RECIPE = "recipe.yaml"
METRICS = "metrics.jsonl"
CLIENTS = "clients.jsonl"
LEDGER = "ledger.jsonl"
FAILURES = "failures.jsonl"
LOGS = (METRICS, CLIENTS, LEDGER, FAILURES)
TIMES = "times.jsonl"
EVALUATIONS = "evaluations.jsonl"
STOPS = "stops.jsonl"
CLASSES = "classes.json"


def read_jsonl(path: str | Path, needs: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every row of a JSON-lines file (none if it does not exist). A file that is not
    text, a line that is not JSON, or a row that is not an object with the ``needs``
    keys stops with an error naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise FedkitError(f"{path}: not a text file; expected JSON lines{DAMAGED}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise FedkitError(f"{path}, line {number}: not JSON ({exc}){DAMAGED}") from None
        if not isinstance(row, dict) or any(key not in row for key in needs):
            wanted = "a JSON object" + (f" with {', '.join(needs)}" if needs else "")
            raise FedkitError(
                f"{path}, line {number}: expected {wanted}, found {line[:80]!r}{DAMAGED}"
            )
        rows.append(row)
    return rows


DAMAGED = "; the file is damaged or not fedkit's (its copy in checkpoints/journal/ may be intact)"


def read_metrics(out: str | Path) -> list[dict[str, Any]]:
    """The run's metrics rows (per-client values are in ``read_clients``)."""
    return read_jsonl(Path(out) / METRICS, needs=("round",))


def read_times(out: str | Path) -> list[dict[str, Any]]:
    """Every session's set-up and round times (a line a kill cut short is skipped)."""
    return _whole_lines(Path(out) / TIMES)


def _whole_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of an append-only file, skipping lines that do not parse."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def total_seconds(times: list[dict[str, Any]]) -> float:
    """A run's wall time across all its sessions: set-up (data, models, server
    pre-training) and every round run, including rounds a kill threw away."""
    return sum(float(r.get("setup", 0.0)) + float(r.get("seconds", 0.0)) for r in times)


def append_time(out: Path, row: dict[str, Any]) -> None:
    """Append one line to ``times.jsonl``."""
    _append_line(out / TIMES, row)


def _append_line(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line in one write: a kill leaves a whole line or a partial last
    one, which the readers skip (these files are not checkpointed, so never cut)."""
    line = json.dumps(row, sort_keys=True) + "\n"
    with path.open("a") as handle:
        handle.write(line)
        handle.flush()


def read_evaluations(out: str | Path) -> list[dict[str, Any]]:
    """Every ``fedkit eval`` of the run, oldest first (a line cut short is skipped)."""
    return _whole_lines(Path(out) / EVALUATIONS)


def append_stop(out: Path, row: dict[str, Any]) -> None:
    """Append why a session stopped before its last round (a round that failed its
    quorum, with every failed client): the round's own logs are never committed, and
    this file is never cut, so the trace survives the resume."""
    _append_line(out / STOPS, row)


def read_stops(out: str | Path) -> list[dict[str, Any]]:
    """Every recorded stop (a line a kill cut short is skipped)."""
    return _whole_lines(Path(out) / STOPS)


def append_evaluation(out: Path, row: dict[str, Any]) -> None:
    """Append one ``fedkit eval`` result (append-only: earlier ones are kept)."""
    _append_line(out / EVALUATIONS, row)


def read_clients(out: str | Path) -> list[dict[str, Any]]:
    """Per round: ``per_client`` values and the ``clusters`` the sampled clients chose."""
    return read_jsonl(Path(out) / CLIENTS, needs=("round",))


def read_ledger(out: str | Path) -> list[dict[str, Any]]:
    """Bytes per round and client: down/up × model/aux/data."""
    return read_jsonl(Path(out) / LEDGER, needs=("round", "client"))


def read_failures(out: str | Path) -> list[dict[str, Any]]:
    """Clients that failed: round, client, attempt, kind and message."""
    return read_jsonl(Path(out) / FAILURES)


JOURNAL = Path("checkpoints") / "journal"
PER_CLIENT = ("per_client", "clusters")


def per_client_key(key: str, value: Any) -> bool:
    """Whether a row entry holds one value per client (it goes to ``clients.jsonl``)."""
    return key in PER_CLIENT or (key.startswith("client_") and isinstance(value, dict))


def split_row(row: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A round's metrics row without its per-client parts, and those parts: what each
    sampled client reported, the cluster each chose, per-client evaluation
    (``client_*``) — so rows stay small however many clients there are."""
    slim = {k: v for k, v in row.items() if not per_client_key(k, v)}
    sampled = {str(c) for c in row.get("clients", [])}
    clusters = {c: k for c, k in row.get("clusters", {}).items() if c in sampled}
    clients = {k: v for k, v in row.items() if per_client_key(k, v) and k not in PER_CLIENT}
    per_client = row.get("per_client", {})
    return slim, {"round": row["round"], "per_client": per_client, "clusters": clusters, **clients}


def append_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append rows and make them durable (the checkpoint then records the file's length)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
        handle.flush()
        os.fsync(handle.fileno())


def append_logs(out: Path, entries: dict[str, list[dict[str, Any]]]) -> None:
    """Append new rows to each log and to its journal copy."""
    for name, new in entries.items():
        append_jsonl(out / name, new)
        append_jsonl(out / JOURNAL / name, new)


def log_states(out: Path) -> dict[str, dict[str, Any]]:
    """Each log's length and the SHA-256 of its content (recorded by a checkpoint)."""
    states = {}
    for name in LOGS:
        path = out / name
        length = path.stat().st_size if path.exists() else 0
        states[name] = {"length": length, "sha256": sha256_file(path) if length else ""}
    return states


def _intact(path: Path, state: dict[str, Any]) -> bool:
    length = state["length"]
    if length == 0:
        return True
    return (
        path.is_file()
        and path.stat().st_size >= length
        and sha256_file(path, length) == state["sha256"]
    )


def _cut(path: Path, length: int) -> None:
    if path.exists() and path.stat().st_size > length:
        with path.open("r+b") as handle:
            handle.truncate(length)


def restore_logs(out: Path, states: dict[str, dict[str, Any]]) -> list[str]:
    """Bring every log (and its journal copy) back to what the checkpoint recorded: cut
    what came after, rebuild a damaged or missing one from the other copy. Returns notes
    on what was repaired; stops when both copies of a log are damaged."""
    notes = []
    for name, state in states.items():
        main, copy = out / name, out / JOURNAL / name
        main_ok, copy_ok = _intact(main, state), _intact(copy, state)
        if not main_ok and not copy_ok:
            raise FedkitError(
                f"{main} and its copy {copy} are both damaged or shorter than the checkpoint "
                f"recorded ({state['length']} bytes); the rows up to the checkpoint are lost"
            )
        if not main_ok:
            write_bytes(main, copy.read_bytes()[: state["length"]])
            notes.append(f"{name} was damaged or missing; rebuilt from {JOURNAL / name}")
        elif not copy_ok:
            write_bytes(copy, main.read_bytes()[: state["length"]])
        for path in (main, copy):
            _cut(path, state["length"])
    return notes


def holds_run(out: Path) -> bool:
    """Whether ``out`` is a run ``--resume`` can continue. A fresh run writes its recipe
    before its first checkpoint, so a folder with neither is a start that was stopped
    before it began: nothing in it is worth keeping."""
    return (out / RECIPE).is_file() or (out / "checkpoints").is_dir()

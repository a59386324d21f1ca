"""The run directory: resolved recipe, partition, append-only logs, checkpoints, summary.

Logs are JSON lines, appended at each checkpoint with the rounds done since the last
one: ``metrics.jsonl`` (one small row per round), ``clients.jsonl`` (per round: what
each sampled client reported and the cluster it chose), ``ledger.jsonl`` (bytes per
round and client) and ``failures.jsonl`` (clients that failed). The checkpoint records
each log's length, so ``fedkit run --resume DIR`` cuts whatever was appended after it
and continues exactly where it left off. Nothing is rewritten as a run grows.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from fedkit import checkpoint
from fedkit.atomic import write_json, write_text
from fedkit.data.summary import partition_table, save_partition
from fedkit.engine import Reporter, Run, SilentReporter, prepare, run_round
from fedkit.errors import FedkitError
from fedkit.recipe import Recipe, dump_recipe, load_recipe

RECIPE = "recipe.yaml"
METRICS = "metrics.jsonl"
CLIENTS = "clients.jsonl"
LEDGER = "ledger.jsonl"
FAILURES = "failures.jsonl"
LOGS = (METRICS, CLIENTS, LEDGER, FAILURES)
PER_CLIENT = ("per_client", "clusters")


def default_out(recipe_name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{recipe_name}-{stamp}"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(out: Path) -> list[dict[str, Any]]:
    """The run's metrics rows (per-client values are in ``read_clients``)."""
    return read_jsonl(out / METRICS)


def read_clients(out: Path) -> list[dict[str, Any]]:
    """Per round: ``per_client`` values and the ``clusters`` the sampled clients chose."""
    return read_jsonl(out / CLIENTS)


def read_ledger(out: Path) -> list[dict[str, Any]]:
    """Bytes per round and client: down/up × model/aux/data."""
    return read_jsonl(out / LEDGER)


def split_row(row: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A round's metrics row without its per-client parts, and those parts: what each
    sampled client reported and the cluster each chose (so rows stay small however many
    clients there are)."""
    slim = {k: v for k, v in row.items() if k not in PER_CLIENT}
    sampled = {str(c) for c in row.get("clients", [])}
    clusters = {c: k for c, k in row.get("clusters", {}).items() if c in sampled}
    return slim, {
        "round": row["round"],
        "per_client": row.get("per_client", {}),
        "clusters": clusters,
    }


def append_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append rows and make them durable (the checkpoint then records the file's length)."""
    with path.open("a") as handle:
        handle.write("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
        handle.flush()
        os.fsync(handle.fileno())


def log_lengths(out: Path) -> dict[str, int]:
    return {name: (out / name).stat().st_size if (out / name).exists() else 0 for name in LOGS}


def cut_logs(out: Path, lengths: dict[str, int]) -> None:
    """Drop whatever was appended to the logs after a checkpoint."""
    for name in LOGS:
        path = out / name
        if path.exists() and path.stat().st_size > lengths.get(name, 0):
            with path.open("r+b") as handle:
                handle.truncate(lengths.get(name, 0))


def start(recipe: Recipe, out: Path) -> Run:
    """Prepare a fresh run, lay out its directory and write the round-0 checkpoint
    (refuses to overwrite a run)."""
    if (out / RECIPE).exists():
        raise FedkitError(f"{out} already holds a run; use --resume {out} or another --out")
    out.mkdir(parents=True, exist_ok=True)
    run = prepare(recipe, out=out)
    write_text(out / RECIPE, dump_recipe(recipe))
    save_partition(partition_table(run.server.data), out / "partition.json")
    checkpoint.save(run, out, 0, log_lengths(out))
    return run


def resume(out: Path) -> tuple[Run, int]:
    """Rebuild a run from its directory and restore its newest checkpoint."""
    if not (out / RECIPE).is_file():
        raise FedkitError(f"{out}: no {RECIPE} here; expected a run directory to resume")
    snapshot = checkpoint.read(out)
    run = prepare(load_recipe(out / RECIPE), snapshot=snapshot, out=out)
    if snapshot is None:
        return run, 0
    cut_logs(out, snapshot.sidecar["logs"])
    checkpoint.collect(out, snapshot.sidecar["clients"])
    return run, snapshot.round


def write_logs(run: Run, out: Path, rows: list[dict[str, Any]]) -> None:
    """Append the rounds done since the last checkpoint to the logs."""
    slim, clients = zip(*(split_row(row) for row in rows), strict=True) if rows else ((), ())
    append_jsonl(out / METRICS, list(slim))
    append_jsonl(out / CLIENTS, list(clients))
    append_jsonl(out / LEDGER, run.server.ledger.flush())
    failed = [
        {"round": row["round"], "client": int(cid), "error": error}
        for row in rows
        for cid, error in row.get("failures", {}).items()
    ]
    append_jsonl(out / FAILURES, failed)


def commit(run: Run, out: Path, rows: list[dict[str, Any]], round: int) -> None:
    """Append ``rows`` (the rounds since the last checkpoint) to the logs, then write the
    checkpoint after ``round``, which records the logs' lengths."""
    write_logs(run, out, rows)
    checkpoint.save(run, out, round, log_lengths(out))


def execute(run: Run, out: Path, done: int = 0, reporter: Reporter = SilentReporter()) -> dict:
    """Run rounds ``done+1 .. R``, checkpointing as configured; returns the summary."""
    rounds, every = run.recipe.federation.rounds, run.recipe.engine.checkpoint_every
    began = time.perf_counter()
    pending: list[dict[str, Any]] = []
    last = read_metrics(out)[-1:] if done else []
    try:
        for r in range(done + 1, rounds + 1):
            pending.append(run_round(run, r, reporter))
            if r % every == 0 or r == rounds:
                commit(run, out, pending, r)
                last, pending = [split_row(pending[-1])[0]], []
    finally:
        run.close()
    summary = {
        "rounds": rounds,
        "final": last[-1] if last else {},
        "bytes": run.server.ledger.totals(),
        "plugins": run.plugins.names,
        "seconds_this_session": round(time.perf_counter() - began, 2),
    }
    write_json(out / "summary.json", summary)
    return summary

"""The run directory: resolved recipe, partition, append-only logs, checkpoints, summary.

Logs are JSON lines, appended at each checkpoint with the rounds done since the last
one: ``metrics.jsonl`` (one small row per round), ``clients.jsonl`` (per round: what
each sampled client reported and the cluster it chose), ``ledger.jsonl`` (bytes per
round and client) and ``failures.jsonl`` (clients that failed). Every row also goes to a
copy under ``checkpoints/journal/``. The checkpoint records each log's length and the
hash of that prefix, so ``fedkit run --resume DIR`` cuts whatever was appended after it,
rebuilds a damaged or deleted log from its journal copy (and says so), and continues
exactly where the checkpoint left off. Nothing is rewritten as a run grows.

fedkit writes only in a directory it created or found empty, refuses to resume with a
recipe other than the one the checkpoint was written with (except a longer
``federation.rounds`` or other evaluation settings, given with ``--set``), and removes
only files it wrote.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from fedkit.config.schema import Recipe, apply_overrides, dump_recipe, load_recipe, validate
from fedkit.core.engine import Reporter, Run, SilentReporter, prepare, run_round
from fedkit.data.summary import partition_table, save_partition
from fedkit.errors import FedkitError, RecipeError
from fedkit.rundir import checkpoint
from fedkit.rundir.atomic import remove_temporary, write_bytes, write_json, write_text
from fedkit.rundir.integrity import sha256_file
from fedkit.rundir.lock import LOCK
from fedkit.rundir.logs import (
    CLIENTS,
    FAILURES,
    LEDGER,
    LOGS,
    METRICS,
    RECIPE,
    read_metrics,
)

JOURNAL = Path("checkpoints") / "journal"
PER_CLIENT = ("per_client", "clusters")
RESUME_KEYS = ("federation.rounds", "evaluation.")
"""Recipe keys ``--resume`` accepts with ``--set``: a longer run, other evaluation."""


def default_out(recipe_name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{recipe_name}-{stamp}"


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


def claim(out: Path) -> None:
    """Make ``out`` a new run directory: it must not exist, or be empty (a lock file that
    this process holds aside), and not be a file."""
    if out.exists() and not out.is_dir():
        raise FedkitError(f"--out {out} is a file; give a directory")
    if (out / RECIPE).exists():
        raise FedkitError(f"{out} already holds a run; use --resume {out} or another --out")
    foreign = sorted(p.name for p in out.iterdir() if p.name != LOCK) if out.exists() else []
    if foreign:
        shown = ", ".join(foreign[:5]) + (", …" if len(foreign) > 5 else "")
        raise FedkitError(
            f"{out} exists and holds files that are not a fedkit run ({shown}); "
            "fedkit only writes in a new or empty directory: choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)


def start(recipe: Recipe, out: Path) -> Run:
    """Prepare a fresh run, lay out its directory and write the round-0 checkpoint
    (refuses a directory that already holds a run or anything else)."""
    claim(out)
    run = prepare(recipe, out=out)
    write_text(out / RECIPE, dump_recipe(recipe))
    save_partition(partition_table(run.server.data), out / "partition.json")
    checkpoint.save(run, out, 0, log_states(out))
    return run


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flat(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: value}


def recipe_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old → new`` for every key that differs between two resolved recipes."""
    a, b = _flat(old), _flat(new)
    return [
        f"{k}: {a.get(k, '(absent)')!r} → {b.get(k, '(absent)')!r}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k)
    ]


def resumed_recipe(
    out: Path, saved: dict[str, Any], overrides: list[str]
) -> tuple[Recipe, list[str]]:
    """The recipe to continue with: the one the checkpoint was written with, plus the
    ``--set`` overrides ``--resume`` accepts (``federation.rounds``, ``evaluation.*``).
    A ``recipe.yaml`` edited by hand is refused with the changed keys; a damaged one is
    rebuilt from the checkpoint's copy."""
    notes: list[str] = []
    try:
        current = load_recipe(out / RECIPE).model_dump(mode="json")
    except (RecipeError, UnicodeDecodeError, OSError) as exc:
        current = None
        reason = str(exc).splitlines()[0]
        notes.append(
            f"{out / RECIPE} was missing or unreadable ({reason}); rebuilt from the checkpoint"
        )
    if current is not None and current != saved:
        changes = "; ".join(recipe_changes(saved, current))
        raise FedkitError(
            f"{out / RECIPE} changed since its checkpoint was written (edited, or damaged): "
            f"{changes}. A run continues with its own recipe, which the checkpoint keeps: "
            "delete the file to have it rebuilt, start a new run with the changes, or "
            "extend this one with --resume DIR --set federation.rounds=N"
        )
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_KEYS):
            raise RecipeError(
                "--set",
                "only federation.rounds or evaluation.* with --resume (a run "
                "continues with the recipe it started with)",
                item,
            )
    raw = json.loads(json.dumps(saved))
    apply_overrides(raw, overrides, file=str(out / RECIPE))
    return validate(raw, file=str(out / RECIPE)), notes


def resume(out: Path, overrides: list[str] | None = None) -> tuple[Run, int]:
    """Rebuild a run from its directory and its newest intact checkpoint. ``notes`` (on
    the returned run) say what was repaired or skipped."""
    if not out.is_dir() or not ((out / RECIPE).is_file() or (out / "checkpoints").is_dir()):
        raise FedkitError(f"{out}: no {RECIPE} here; expected a run directory to resume")
    for folder in (out, out / "checkpoints", out / JOURNAL, out / checkpoint.CLIENTS):
        if folder.is_dir():
            remove_temporary(folder)
    snapshot = checkpoint.read(out)
    if snapshot is None:
        recipe = load_recipe(out / RECIPE, overrides or [])
        run = prepare(recipe, out=out)
        run.notes = []
        return run, 0
    recipe, notes = resumed_recipe(out, snapshot.sidecar["recipe"], overrides or [])
    if recipe.federation.rounds < snapshot.round:
        raise RecipeError(
            "federation.rounds",
            f"at least {snapshot.round} (the rounds this run has done)",
            recipe.federation.rounds,
        )
    if recipe.model_dump(mode="json") != snapshot.sidecar["recipe"] or notes:
        write_text(out / RECIPE, dump_recipe(recipe))
        snapshot.sidecar["recipe"] = recipe.model_dump(mode="json")
    notes = [*snapshot.notes, *notes, *restore_logs(out, snapshot.sidecar["logs"])]
    run = prepare(recipe, snapshot=snapshot, out=out)
    checkpoint.prune(out, recipe.engine.keep_checkpoints)
    run.notes = notes
    return run, snapshot.round


def write_logs(run: Run, out: Path, rows: list[dict[str, Any]]) -> None:
    """Append the rounds done since the last checkpoint to the logs and their copies."""
    slim, clients = zip(*(split_row(row) for row in rows), strict=True) if rows else ((), ())
    failed = [
        {"round": row["round"], "client": int(cid), "error": error}
        for row in rows
        for cid, error in row.get("failures", {}).items()
    ]
    entries = {
        METRICS: list(slim),
        CLIENTS: list(clients),
        LEDGER: run.server.ledger.flush(),
        FAILURES: failed,
    }
    for name, new in entries.items():
        append_jsonl(out / name, new)
        append_jsonl(out / JOURNAL / name, new)


def commit(run: Run, out: Path, rows: list[dict[str, Any]], round: int) -> None:
    """Append ``rows`` (the rounds since the last checkpoint) to the logs, then write the
    checkpoint after ``round``, which records the logs' lengths and hashes."""
    write_logs(run, out, rows)
    checkpoint.save(run, out, round, log_states(out))


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


def describe_state(out: Path) -> str | None:
    """A note when a run directory's newest checkpoint is not its last round."""
    try:
        recipe = yaml.safe_load((out / RECIPE).read_text())
        rounds = recipe["federation"]["rounds"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    done = checkpoint.latest_round(out)
    if done is not None and done < rounds:
        return f"{out} stopped after round {done} of {rounds}; its newest checkpoint is used"
    return None

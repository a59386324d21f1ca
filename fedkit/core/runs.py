"""A whole run: fresh or resumed, with a run directory or in memory, and the public API
that does all of it, ``run(recipe)``.

A run directory holds the resolved recipe, the partition, the append-only logs
(``fedkit.rundir.logs``), checkpoints (``fedkit.rundir.checkpoint``) and a summary.
fedkit writes only in a directory it created or found empty, refuses to resume with a
recipe other than the one the checkpoint was written with (except a longer
``federation.rounds`` or other evaluation settings, given with ``--set``), and removes
only files it wrote. The rounds themselves come from ``fedkit.core.engine.rounds``, the
one loop over rounds.
"""

from __future__ import annotations

import copy
import inspect
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from torch import Tensor

from fedkit.config.schema import (
    Recipe,
    apply_overrides,
    dump_recipe,
    load_raw,
    load_recipe,
    validate,
)
from fedkit.config.shipped import resolve
from fedkit.core.engine import Reporter, Run, SilentReporter, checkpoint_state, prepare, rounds
from fedkit.core.executor import Placement
from fedkit.core.preflight import check
from fedkit.data.summary import partition_rows, save_partition
from fedkit.errors import FedkitError, RecipeError, RoundFailed
from fedkit.plugin.authoring import check_plugin
from fedkit.plugin.manager import Plugins
from fedkit.plugin.registry import discover, implemented_hooks, installed
from fedkit.rundir import checkpoint
from fedkit.rundir.atomic import remove_temporary, write_json, write_text
from fedkit.rundir.lock import LOCK
from fedkit.rundir.logs import (
    CLASSES,
    CLIENTS,
    FAILURES,
    JOURNAL,
    LEDGER,
    METRICS,
    RECIPE,
    append_logs,
    append_stop,
    append_time,
    holds_run,
    log_states,
    read_metrics,
    read_times,
    restore_logs,
    split_row,
    total_seconds,
)
from fedkit.rundir.store import MEMORIES

RESUME_KEYS = ("federation.rounds", "evaluation.")
"""Recipe keys ``--resume`` accepts with ``--set``: a longer run, other evaluation."""


def default_out(recipe_name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{recipe_name}-{stamp}"


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


def start(
    recipe: Recipe, out: Path, plugins: Plugins | None = None, executor: Placement = None
) -> Run:
    """Prepare a fresh run, lay out its directory and write the round-0 checkpoint
    (refuses a directory that already holds a run or anything else). ``plugins``: the
    ones ``preflight.check`` built (else built here); ``executor``: as ``prepare``'s."""
    claim(out)
    run = prepare(recipe, plugins, out=out, executor=executor)
    write_text(out / RECIPE, dump_recipe(run.recipe))
    save_partition(partition_rows(run.data), out / "partition.json")
    write_json(out / CLASSES, run.data.train.classes)
    save(run, out, 0)
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
    rebuilt from the checkpoint's copy. A key a later fedkit added, which neither copy
    names, is no change: both take its default, so a run started before an upgrade
    resumes after it."""
    notes: list[str] = []
    # keys added to fedkit since the checkpoint was written take their defaults on both sides
    saved = validate(json.loads(json.dumps(saved)), file=str(out / RECIPE)).model_dump(mode="json")
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


def resume(
    out: Path, overrides: list[str] | None = None, executor: Placement = None
) -> tuple[Run, int]:
    """Rebuild a run from its directory and its newest intact checkpoint (``executor``: as
    ``prepare``'s). ``notes`` (on the returned run) say what was repaired or skipped."""
    if not holds_run(out):
        raise FedkitError(f"{out}: no {RECIPE} here; expected a run directory to resume")
    for folder in (out, out / "checkpoints", out / JOURNAL, out / MEMORIES):
        if folder.is_dir():
            remove_temporary(folder)
    snapshot = checkpoint.read(out)
    if snapshot is None:
        recipe = load_recipe(out / RECIPE, overrides or [])
        run = prepare(recipe, out=out, executor=executor)
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
    run = prepare(recipe, snapshot=snapshot, out=out, executor=executor)
    checkpoint.prune(out, recipe.engine.keep_checkpoints)
    run.notes = notes
    return run, snapshot.round


def save(run: Run, out: Path, round: int) -> None:
    """The checkpoint after ``round``: the client side persists the memories that changed
    (it answers with file names and hashes), the server side its pool, tensors and state."""
    server = run.server
    checkpoint.save(
        out,
        round,
        pool=server.pool,
        server_tensors=server.tensors,
        clients=run.executor.persist(out / MEMORIES),
        state=checkpoint_state(run),
        logs=log_states(out),
        keep=run.recipe.engine.keep_checkpoints,
        held=run.flight.tensors() if run.flight is not None else None,
    )


def commit(run: Run, out: Path, rows: list[dict[str, Any]], round: int) -> None:
    """Append ``rows`` (the rounds since the last checkpoint) to the logs and their
    copies, then write the checkpoint after ``round``, which records the logs' lengths
    and hashes."""
    slim, clients = zip(*(split_row(row) for row in rows), strict=True) if rows else ((), ())
    failed = [
        {"round": row["round"], "client": int(cid), "error": error}
        for row in rows
        for cid, error in row.get("failures", {}).items()
    ] + [
        {"round": row["round"], "client": int(cid), "error": error, "retried": True}
        for row in rows
        for cid, error in row.get("retried", {}).items()
    ]
    append_logs(
        out,
        {
            METRICS: list(slim),
            CLIENTS: list(clients),
            LEDGER: run.server.ledger.flush(),
            FAILURES: failed,
        },
    )
    save(run, out, round)


def execute(run: Run, out: Path, done: int = 0, reporter: Reporter = SilentReporter()) -> dict:
    """Run rounds ``done+1 .. R``, checkpointing as configured; returns the summary."""
    every, total = run.recipe.engine.checkpoint_every, run.recipe.federation.rounds
    began = time.perf_counter()
    session = 1 + max((int(r.get("session", 0)) for r in read_times(out)), default=0)
    append_time(out, {"session": session, "setup": round(began - run.began, 3), "after": done})
    pending: list[dict[str, Any]] = []
    last = read_metrics(out)[-1:] if done else []
    try:
        for row in stopping(run, out, session, rounds(run, done, reporter)):
            times = {k: round(v, 3) for k, v in run.times.items()}
            append_time(out, {"session": session, "round": row["round"], **times})
            pending.append(row)
            if row["round"] % every == 0 or row["round"] == total:
                commit(run, out, pending, row["round"])
                last, pending = [split_row(pending[-1])[0]], []
    finally:
        run.close()
    summary = {
        "rounds": total,
        "final": last[-1] if last else {},
        "bytes": run.server.ledger.totals(),
        "plugins": run.plugins.names,
        "seconds_this_session": round(time.perf_counter() - began, 2),
        "seconds": round(total_seconds(read_times(out)), 2),
        "sessions": session,
    }
    wire = getattr(run.executor, "wire", None)  # an executor that moves bytes over a network
    if wire:
        summary["wire_bytes"] = dict(wire)
    write_json(out / "summary.json", summary)
    return summary


def stopping(
    run: Run, out: Path, session: int, rows: Iterator[dict[str, Any]]
) -> Iterator[dict[str, Any]]:
    """The rounds' rows; a round that fails is recorded in ``stops.jsonl`` first."""
    try:
        yield from rows
    except RoundFailed as exc:
        stop = {"session": session, "round": run.server.round, "error": str(exc)}
        append_stop(out, {**stop, "failures": exc.failures})
        raise


def describe_state(out: Path) -> str | None:
    """A note when a run directory's newest checkpoint is not its last round."""
    try:
        recipe = yaml.safe_load((out / RECIPE).read_text())
        rounds = recipe["federation"]["rounds"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    done = checkpoint.latest_round(out)
    if done is not None and done < rounds:
        return f"{out} stopped after round {done} of {rounds}; its newest intact checkpoint is used"
    return None


class Loaded:
    """Stands in for an entry point whose target is already loaded (a class or object)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def load(self) -> Any:
        return self.obj


def with_plugins(plugins: Mapping[str, Any]) -> dict[str, Any]:
    """The installed plugins and ``plugins`` (name → plugin class, module or object, or an
    entry point), each checked as an installed one is: a name, and something that
    implements fedkit hooks. Without this a stray value (``{"x": 5}``) would be accepted
    as a plugin that does nothing, and a recipe naming it would run without its method."""
    if not isinstance(plugins, Mapping):
        raise RecipeError("plugins", "a mapping of plugin name → plugin class or module", plugins)
    extra: dict[str, Any] = {}
    for name, value in plugins.items():
        where = f"plugins[{name!r}]"
        if not isinstance(name, str) or not name.strip():
            raise RecipeError(where, "a plugin name (a non-empty string) as the key", name)
        if installed(value):
            extra[name] = value
            continue
        authored = inspect.isclass(value) or inspect.ismodule(value)
        if not implemented_hooks(value) and not (authored and check_plugin(name, value)):
            raise RecipeError(
                where,
                "a plugin: a class, module or object with @hookimpl methods named like "
                "fedkit hooks (see docs/plugins.md)",
                value,
            )
        extra[name] = Loaded(value)
    return {**discover(), **extra}


@dataclass
class RunResult:
    """What ``run`` produced: every round's metrics row (in memory, whole; with a run
    directory, as ``metrics.jsonl`` keeps them, per-client values in ``clients.jsonl``),
    the ledger rows (in memory; with a run directory, in ``ledger.jsonl``), the run itself
    (closed), the summary and the run directory (``None`` in memory)."""

    rows: list[dict[str, Any]]
    ledger: list[dict[str, int]]
    run: Run
    summary: dict[str, Any] | None = None
    out: Path | None = None

    @property
    def pool(self) -> list[dict[str, Tensor]]:
        """The cluster states after the last round."""
        return self.run.server.pool

    def dataframe(self) -> Any:
        """The metrics rows as a pandas DataFrame, one row per round, nested values as
        ``bytes.up_model`` columns (per-client values left out: ``clients.jsonl``).
        Needs pandas (``pip install pandas``)."""
        try:
            import pandas
        except ImportError:
            raise FedkitError("RunResult.dataframe needs pandas: pip install pandas") from None
        rows = [{k: v for k, v in r.items() if k != "per_client"} for r in self.rows]
        return pandas.json_normalize(rows).set_index("round")


def run(
    recipe: Recipe | Mapping[str, Any] | str | Path,
    *,
    out: str | Path | None = None,
    overrides: list[str] | None = None,
    plugins: Mapping[str, Any] | None = None,
    rounds_to_run: int | None = None,
    reporter: Reporter = SilentReporter(),
    executor: str | None = None,
) -> RunResult:
    """Run a recipe: a ``Recipe``, a mapping, a YAML file or a shipped recipe's name.

    With ``out``, in a new run directory exactly as ``fedkit run`` does (checkpoints,
    logs, summary); without, in memory. ``overrides``: ``--set``-style ``key=value``
    items. ``plugins``: name → plugin class (or module) to use besides the installed
    ones, e.g. one not installed yet (checked: see ``with_plugins``). ``rounds_to_run``:
    stop after that many rounds (in memory only). ``executor``: where clients run,
    instead of ``engine.executor``."""
    raw = _raw(recipe)
    apply_overrides(raw, overrides or [])
    available = with_plugins(plugins) if plugins else None
    parsed = validate(raw)
    checked = check(parsed, available)
    if out is not None:
        if rounds_to_run is not None:
            raise ValueError("rounds_to_run runs in memory: leave out `out`")
        target = Path(out)
        the_run = start(parsed, target, checked, executor)
        summary = execute(the_run, target, 0, reporter)
        rows = read_metrics(target)
        return RunResult(rows, [], the_run, summary, target)
    the_run = prepare(parsed, checked, executor=executor)
    try:
        rows = []
        for row in rounds(the_run, 0, reporter):
            rows.append(row)
            if rounds_to_run is not None and row["round"] >= rounds_to_run:
                break
    finally:
        the_run.close()
    return RunResult(rows, the_run.server.ledger.to_rows(), the_run)


def _raw(recipe: Recipe | Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(recipe, Recipe):
        return recipe.model_dump(mode="json")
    if isinstance(recipe, Mapping):
        return copy.deepcopy(dict(recipe))
    return load_raw(resolve(str(recipe)))


DRY_CLIENTS = 32
"""The most clients a dry round runs (a recipe's cohort, capped: each costs a step)."""


def dry_round(raw: dict[str, Any]) -> None:
    """One round of a recipe on a few of the embedded digits (the recipe's image size,
    its clients per round up to ``DRY_CLIENTS`` with eight images each, small batches):
    raises what a real run would raise in round 1 — key-claim conflicts, shape mistakes,
    plugins that cannot work together, a cohort a robust aggregator cannot take — in
    seconds."""
    raw = {**raw, "data": dict(raw.get("data", {})), "federation": dict(raw.get("federation", {}))}
    server_share = 0.5 if raw["data"].get("server_fraction") else 0.0  # a few images each
    cohort = raw["federation"].get("clients_per_round", 2)
    k = min(max(2, cohort), DRY_CLIENTS) if isinstance(cohort, int) else 2
    raw["data"].update(
        dataset="digits",
        root=None,
        download=False,
        num_clients=k,
        server_fraction=server_share,
        max_train=8 * k,  # a step or two per client
        max_test=20,
        partition={"name": "iid"},
        local_test_size=4,
    )
    raw["federation"].update(rounds=1, clients_per_round=k, local_epochs=1, batch_size=4)
    raw["evaluation"] = {"protocol": "none", "every": 0}
    raw["engine"] = {"executor": "sequential", "store": "memory"}
    raw["faults"] = {}
    if (raw.get("systems") or {}).get("concurrency") is not None:  # async: all clients at once
        raw["systems"] = {**raw["systems"], "concurrency": k}
    run(raw)

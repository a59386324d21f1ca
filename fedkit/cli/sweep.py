"""``fedkit sweep RECIPE --set KEY=V1,V2 ... --out DIR``: a grid of runs and its table.

Every ``--set`` with several comma-separated values is an axis; the sweep runs the
cartesian product of the axes, one run directory per cell under ``DIR`` (named by the
cell's values), each as its own ``fedkit run`` process. ``DIR/sweep.json`` (the manifest)
records the grid; running the same command again trains only what is missing: a finished
cell is skipped, an interrupted one resumes from its newest checkpoint (so a killed sweep
ends with the numbers an uninterrupted one gives). ``--parallel N`` runs N cells at once
and splits the machine's cores between them (torch threads per cell). At the end, the
final and best value of every metric, as mean ± std over the cells that differ only in
``seed``, is printed and written as ``table.md``, ``table.csv`` and ``table.json``.
"""

from __future__ import annotations

import csv
import ctypes
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

from rich.table import Table

from fedkit.cli.compare import markdown
from fedkit.config.schema import parse_value
from fedkit.errors import FedkitError, RecipeError
from fedkit.rundir.atomic import write_json, write_text
from fedkit.rundir.lock import RunLock
from fedkit.rundir.logs import holds_run, read_metrics

MANIFEST = "sweep.json"
"""The sweep's manifest in its directory: recipe, fixed overrides, axes and cells."""

SEED = "seed"
"""The axis a table aggregates over (its cells are repeats, not settings)."""


@dataclass(frozen=True)
class Cell:
    """One run of the grid: its directory name and the value of every axis."""

    name: str
    values: dict[str, str]

    @property
    def overrides(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.values.items()]


def split_values(text: str) -> list[str]:
    """``a,b,[c,d]`` → ``["a", "b", "[c,d]"]``: commas inside brackets or quotes stay."""
    parts, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    parts.append("".join(current).strip())
    return parts


def axes_of(sets: Iterable[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The fixed overrides and the axes (key → values) of the ``--set`` options."""
    fixed, axes = [], {}
    for item in sets:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RecipeError("--set", "KEY=VALUE or KEY=V1,V2,...", item)
        values = split_values(text)
        if any(v == "" for v in values):
            raise RecipeError(f"--set {key}", "comma-separated values, none empty", text)
        if key in axes or any(f.split("=", 1)[0] == key for f in fixed):
            raise RecipeError(f"--set {key}", "each key once (list its values: K=V1,V2)", item)
        if len(values) == 1:
            fixed.append(f"{key}={values[0]}")
        else:
            distinct(key, values)
            axes[key] = values
    return fixed, axes


def reading(value: Any) -> Any:
    """A parsed value in a form where two values compare equal exactly when a recipe
    reads them alike: ``1``, ``01`` and ``1.0`` are one number, ``true`` is not ``1``."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int | float):
        return ("number", value)
    if isinstance(value, list):
        return ("list", tuple(reading(v) for v in value))
    if isinstance(value, dict):
        return ("map", tuple(sorted((str(k), reading(v)) for k, v in value.items())))
    try:
        hash(value)
    except TypeError:  # a YAML !!set, say
        return (type(value).__name__, repr(value))
    return (type(value).__name__, value)


def distinct(key: str, values: list[str]) -> None:
    """Refuse an axis with two spellings of one value (``seed=1,01``: YAML reads both as
    1), which would run one setting twice and count it as two seeds."""
    seen: dict[Any, str] = {}
    for value in values:
        parsed = reading(parse_value(value, f"{key}={value}"))
        if parsed in seen:
            first = seen[parsed]
            same = "the same value" if first == value else f"both {parse_value(value)!r}"
            raise RecipeError(
                f"--set {key}",
                f"distinct values ({first!r} and {value!r} are {same} in a recipe)",
                ",".join(values),
            )
        seen[parsed] = value


def labels(keys: list[str]) -> dict[str, str]:
    """Each axis's short name in cell names: its last part, or the whole key when two
    axes would share it."""
    short = {key: key.rsplit(".", 1)[-1] for key in keys}
    counts = {s: list(short.values()).count(s) for s in short.values()}
    return {key: (s if counts[s] == 1 else key) for key, s in short.items()}


def cells_of(axes: dict[str, list[str]]) -> list[Cell]:
    """The cartesian product of the axes, in the order the values were given."""
    if not axes:
        return [Cell("run", {})]
    names = labels(list(axes))
    cells: dict[str, Cell] = {}
    for combination in product(*axes.values()):
        values = dict(zip(axes, combination, strict=True))
        name = "_".join(f"{names[k]}-{safe(v)}" for k, v in values.items())
        other = cells.get(name.casefold())
        if other is not None:
            key = next(k for k in axes if other.values[k] != values[k])
            raise RecipeError(
                f"--set {key}",
                f"values that name different folders ({other.values[key]!r} and "
                f"{values[key]!r} would both run in {name!r}: a folder name keeps only the "
                "letters, digits and . + - of a value, and some file systems ignore case)",
                ",".join(axes[key]),
            )
        cells[name.casefold()] = Cell(name, values)
    return list(cells.values())


def safe(value: str) -> str:
    """A value as part of a directory name."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "~", value).strip("~") or "~"


def manifest_of(recipe: str, fixed: list[str], axes: dict[str, list[str]]) -> dict[str, Any]:
    return {
        "recipe": recipe,
        "fixed": fixed,
        "axes": axes,
        "cells": [{"name": c.name, "values": c.values} for c in cells_of(axes)],
    }


def claim(out: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest, or check that the one in ``out`` is the same sweep."""
    path = out / MANIFEST
    if path.is_file():
        try:
            existing = json.loads(path.read_text())
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise FedkitError(f"{path}: unreadable sweep manifest ({exc})") from None
        if existing != manifest:
            changed = [k for k in manifest if existing.get(k) != manifest[k]]
            raise FedkitError(
                f"{path} holds a different sweep (its {', '.join(changed)} differ): rerun "
                "it with the same recipe and --set options, or choose another --out"
            )
        return
    if out.exists() and any(out.iterdir()):
        raise FedkitError(f"{out} exists and is not a sweep directory: choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, manifest)


def finished(folder: Path, rounds: int) -> bool:
    """Whether a cell's run ended: a run writes ``summary.json`` only when its last round
    is committed (an interrupted one has none)."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(summary, dict) and summary.get("rounds") == rounds


def last_line(log: Path) -> str:
    """The last line a cell's process wrote (its error, when it failed)."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def threads_per_cell(parallel: int) -> int:
    """The machine's cores split between the cells that run at once (at least one)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // parallel)


def _die_with_parent() -> None:
    """In a cell's process (Linux): end when the sweep's process ends, even by kill -9,
    so a rerun never finds a cell still running."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class Job:
    cell: Cell
    folder: Path
    command: list[str]
    process: subprocess.Popen | None = None
    began: float = 0.0


def discard_unstarted(folder: Path) -> None:
    """Remove a cell's folder that a kill left before its run wrote a recipe (a lock file,
    an empty memory store), so that the cell starts afresh instead of failing to resume.
    Refused while a process still holds the folder's lock."""
    if folder.exists() and not holds_run(folder):
        with RunLock(folder):
            shutil.rmtree(folder)


def command(recipe: str, fixed: list[str], cell: Cell, folder: Path, engine: list[str]) -> list:
    """The ``fedkit run`` of a cell: a fresh start, or a resume of what it left."""
    base = [sys.executable, "-m", "fedkit", "run", "-q", "--no-report"]
    if holds_run(folder):
        return [*base, "--resume", str(folder)]
    sets = [x for item in [*fixed, *cell.overrides, *engine] for x in ("--set", item)]
    return [*base, recipe, "--out", str(folder), *sets]


def run_cells(
    jobs: list[Job], out: Path, parallel: int, say: Callable[[str], None]
) -> list[tuple[Job, int]]:
    """Run the jobs, ``parallel`` at a time; the failed ones with their exit codes."""
    env = {**os.environ}
    threads = str(threads_per_cell(parallel))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = threads
    (out / "logs").mkdir(exist_ok=True)
    waiting, running, failed = list(jobs), [], []
    try:
        while waiting or running:
            while waiting and len(running) < parallel:
                job = waiting.pop(0)
                log = (out / "logs" / f"{job.cell.name}.log").open("a")
                job.process = subprocess.Popen(
                    job.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
                log.close()
                job.began = time.monotonic()
                what = "resuming" if "--resume" in job.command else "starting"
                say(f"{what} {job.cell.name}")
                running.append(job)
            time.sleep(0.2)
            for job in [j for j in running if j.process.poll() is not None]:
                running.remove(job)
                code, seconds = job.process.returncode, time.monotonic() - job.began
                if code == 0:
                    say(f"finished {job.cell.name} ({seconds:.0f} s)")
                else:
                    failed.append((job, code))
                    log = out / "logs" / f"{job.cell.name}.log"
                    say(f"failed {job.cell.name} (exit {code}, {log}): {last_line(log)}")
    except KeyboardInterrupt:
        for job in running:
            job.process.send_signal(signal.SIGINT)
        for job in running:
            job.process.wait()
        raise FedkitError(
            f"sweep interrupted; run the same command again to continue ({out / MANIFEST})"
        ) from None
    return failed


def scalar_metrics(row: dict[str, Any]) -> list[str]:
    """A row's numeric top-level metrics (not the round, not nested values)."""
    return [
        k
        for k, v in row.items()
        if k != "round" and isinstance(v, int | float) and not isinstance(v, bool)
    ]


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table_rows(out: Path, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Per setting (the cells that differ only in ``seed``): every metric's final and best
    value as mean, std and n."""
    groups: dict[tuple, list[list[dict[str, Any]]]] = {}
    settings = [k for k in manifest["axes"] if k != SEED]
    for entry in manifest["cells"]:
        rows = read_metrics(out / entry["name"])
        if rows:
            key = tuple(entry["values"][k] for k in settings)
            groups.setdefault(key, []).append(rows)
    table = []
    for key, runs in groups.items():
        line: dict[str, Any] = dict(zip(settings, key, strict=True))
        line["n"] = len(runs)
        metrics = [m for m in scalar_metrics(runs[0][-1]) if all(m in r[-1] for r in runs)]
        for metric in metrics:
            finals = [float(r[-1][metric]) for r in runs]
            pick = min if "loss" in metric else max
            bests = [pick(float(x[metric]) for x in r if metric in x) for r in runs]
            for kind, values in (("final", finals), ("best", bests)):
                mean, std = mean_std(values)
                line[f"{metric} {kind}"] = {"mean": mean, "std": std}
        table.append(line)
    return table


def render(rows: list[dict[str, Any]]) -> tuple[Table, str, str]:
    """The table for the terminal, as Markdown and as CSV."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    table = Table(title="fedkit sweep (mean ± std over seeds)")
    for column in columns:
        table.add_column(column, overflow="fold")
    flat = io.StringIO()
    writer = csv.writer(flat)
    head = []
    for column in columns:
        stats = isinstance(rows[0].get(column), dict) if rows else False
        head += [f"{column} mean", f"{column} std"] if stats else [column]
    writer.writerow(head)
    for row in rows:
        cells, record = [], []
        for column in columns:
            value = row.get(column)
            if isinstance(value, dict):
                cells.append(f"{value['mean']:.4f} ± {value['std']:.4f}")
                record += [value["mean"], value["std"]]
            else:
                cells.append("–" if value is None else str(value))
                record.append("" if value is None else value)
        table.add_row(*cells)
        writer.writerow(record)
    return table, markdown(table) + "\n", flat.getvalue()


def sweep(
    recipe: str,
    path: Path,
    sets: list[str],
    out: Path,
    parallel: int,
    engine: list[str],
    rounds_of: Callable[[list[str]], int],
    say: Callable[[str], None],
) -> tuple[Table, list[tuple[Job, int]]]:
    """Run (or continue) a sweep; returns its table and the cells that failed. Every
    cell's recipe is validated first (``rounds_of`` checks its keys and values and answers
    its rounds, without loading torch); its plugins are checked by its own run."""
    if parallel < 1:
        raise RecipeError("--parallel", "a whole number of at least 1", parallel)
    fixed, axes = axes_of(sets)
    manifest = manifest_of(str(path), fixed, axes)
    cells = cells_of(axes)
    rounds = {c.name: rounds_of([*fixed, *c.overrides, *engine]) for c in cells}
    claim(out, manifest)
    jobs = []
    for cell in cells:
        folder = out / cell.name
        if finished(folder, rounds[cell.name]):
            continue
        discard_unstarted(folder)
        jobs.append(Job(cell, folder, command(recipe, fixed, cell, folder, engine)))
    skipped = len(cells) - len(jobs)
    if skipped:
        say(f"{skipped} of {len(cells)} cells already finished")
    failed = run_cells(jobs, out, parallel, say) if jobs else []
    rows = table_rows(out, manifest)
    table, md, flat = render(rows)
    write_text(out / "table.md", md)
    write_text(out / "table.csv", flat)
    write_json(out / "table.json", rows)
    return table, failed

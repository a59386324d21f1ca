"""When clients are reachable, on the virtual clock (``systems.availability``).

A model answers one question in O(1) or O(log windows) per client: until when is this
client reachable, seen at virtual time ``t``? (``None``: not reachable at ``t``.) Nothing
is computed for the whole population per round: the sampler asks about the candidates it
draws, the clock about the clients it ran.

* ``always``: every client, forever.
* ``diurnal``: client ``c`` is reachable while ``(t / period + phase_c) mod 1 < online``,
  its phase uniform in [0, 1) from a generator seeded by (seed, client).
* ``trace``: windows read from a file (``read_windows``), repeating every ``period``
  seconds; client ``c`` follows trace client ``c mod D`` (``D`` the trace's clients).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fedkit.config.schema import AvailabilityConfig
from fedkit.errors import RecipeError
from fedkit.seeding import derive

FOREVER = math.inf


class Availability:
    """An availability model: ``until(client, t)`` is the end of the window holding ``t``
    (``inf`` when the client never leaves), or ``None`` when it is not reachable at ``t``."""

    def until(self, client: int, t: float) -> float | None:
        return FOREVER


class Diurnal(Availability):
    """Reachable for the fraction ``online`` of every ``period``, phases seeded per client."""

    def __init__(self, seed: int, period: float, online: float) -> None:
        self.seed, self.period, self.online = seed, period, online
        self._phases: dict[int, float] = {}

    def phase(self, client: int) -> float:
        found = self._phases.get(client)
        if found is None:
            rng = np.random.default_rng(derive(self.seed, "phase", client))
            found = self._phases[client] = float(rng.random())
        return found

    def until(self, client: int, t: float) -> float | None:
        if self.online >= 1:
            return FOREVER
        position = (t / self.period + self.phase(client)) % 1.0
        if position >= self.online:
            return None
        return t + (self.online - position) * self.period


class Windows(Availability):
    """Windows from a trace: per trace client, sorted disjoint ``[start, end)`` seconds
    within one ``period``, which repeats. Held as two flat arrays and each trace client's
    offset into them (a few bytes per window: a week of 136,000 users is millions of
    windows, which Python tuples would hold in gigabytes)."""

    def __init__(
        self, starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray, period: float
    ) -> None:
        self.starts, self.ends, self.offsets, self.period = starts, ends, offsets, period
        self.clients = len(offsets) - 1

    @classmethod
    def of(cls, windows: list[list[tuple[float, float]]], period: float) -> Windows:
        """From per-client lists of sorted disjoint ``(start, end)`` pairs."""
        flat = [pair for w in windows for pair in w]
        starts = np.array([s for s, _ in flat], dtype=np.float64)
        ends = np.array([e for _, e in flat], dtype=np.float64)
        offsets = np.concatenate([[0], np.cumsum([len(w) for w in windows])]).astype(np.int64)
        return cls(starts, ends, offsets, period)

    def until(self, client: int, t: float) -> float | None:
        index = client % self.clients
        lo, hi = int(self.offsets[index]), int(self.offsets[index + 1])
        base = math.floor(t / self.period) * self.period
        offset = t - base
        i = bisect.bisect_right(self.starts, offset, lo, hi) - 1
        if i < lo or self.ends[i] <= offset:
            return None
        return base + float(self.ends[i])


def checked_file(path: str, key: str) -> Path:
    """The file the recipe key ``key`` names, if it is an existing CSV or JSON-lines file."""
    file = Path(path)
    if not file.is_file():
        raise RecipeError(key, "an existing CSV or JSON-lines file", path)
    if file.suffix not in (".csv", ".jsonl", ".json"):
        expected = "a .csv, .jsonl or .json file (FedScale's pickles are not read: convert them)"
        raise RecipeError(key, expected, path)
    return file


def iter_rows(path: str, key: str) -> Iterator[dict[str, Any]]:
    """The rows of a CSV file (a header line, then values) or a JSON-lines file (one object
    per line; ``.jsonl`` or ``.json``), for the recipe key ``key`` naming it, read one at
    a time (a trace of millions of rows is never held as dictionaries)."""
    import csv
    import json

    file = checked_file(path, key)
    try:
        with file.open(newline="") as lines:
            if file.suffix == ".csv":
                yield from csv.DictReader(lines)
                return
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    expected = f"a JSON object on line {number} ({exc.msg})"
                    raise RecipeError(key, expected, path) from None
                if not isinstance(row, dict):
                    raise RecipeError(key, f"a JSON object on line {number}", row)
                yield row
    except UnicodeDecodeError:
        raise RecipeError(key, "a text file (CSV or JSON lines)", "binary data") from None


def read_rows(path: str, key: str) -> list[dict[str, Any]]:
    """Every row of a CSV or JSON-lines file (``iter_rows``), as a list."""
    return list(iter_rows(path, key))


def number(row: dict[str, Any], name: str, key: str, at: int, low: float = 0.0) -> float:
    """Column ``name`` of row ``at`` as a float of at least ``low`` (a clear error if not)."""
    try:
        value = float(row[name])
    except KeyError:
        raise RecipeError(key, f"a column {name!r} (row {at})", sorted(row)) from None
    except (TypeError, ValueError):
        raise RecipeError(key, f"a number in column {name!r} (row {at})", row[name]) from None
    if not value >= low or math.isinf(value):
        raise RecipeError(key, f"a finite number ≥ {low:g} in column {name!r} (row {at})", value)
    return value


TRACE = "systems.availability.trace"


def read_windows(path: str, period: float) -> Windows:
    """A trace of windows: rows ``client, start, end`` (seconds from the trace's start,
    ``start < end <= period``), trace clients numbered 0..D-1 with at least one window
    each. Overlapping windows of one client are merged. A well-formed CSV file is read
    in bulk (numpy); anything else, or a file the bulk reader finds fault with, row by row,
    which names the first bad row."""
    columns = csv_columns(path) if checked_file(path, TRACE).suffix == ".csv" else None
    if columns is not None:
        found = windows_of(*columns, period)
        if found is not None:
            return found
    return Windows.of(windows_by_row(path, period), period)


def csv_columns(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The client, start and end columns of a CSV trace as float arrays, or ``None`` when
    numpy cannot read it as plain numbers (quoted or missing values, text, an odd header):
    the row-by-row reader then says what is wrong."""
    import csv
    import warnings

    try:
        with open(path, newline="") as lines:
            header = next(csv.reader(lines), [])
        at = [header.index(name) for name in ("client", "start", "end")]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an empty file: the check below refuses it
            table = np.loadtxt(
                path, delimiter=",", skiprows=1, usecols=at, ndmin=2, comments=None,
                encoding="utf-8",
            )  # fmt: skip
    except (ValueError, UnicodeDecodeError, IndexError):
        return None
    return table[:, 0], table[:, 1], table[:, 2]


def windows_of(
    client: np.ndarray, start: np.ndarray, end: np.ndarray, period: float
) -> Windows | None:
    """The merged windows of a trace's columns, or ``None`` when a row breaks a rule (the
    row-by-row reader then names it): the same windows ``windows_by_row`` gives."""
    if len(client) == 0:
        return None
    for column in (client, start, end):
        if not (np.isfinite(column) & (column >= 0)).all():
            return None
    if not ((start < end) & (end <= period)).all():
        return None
    ids = client.astype(np.int64)  # as int() truncates
    clients = int(ids.max()) + 1
    counts = np.bincount(ids, minlength=clients)
    if (counts == 0).any():
        return None
    step = np.diff(ids)
    if (step < 0).any() or ((step == 0) & (np.diff(start) < 0)).any():  # not sorted yet
        order = np.lexsort((start, ids))
        ids, start, end = ids[order], start[order], end[order]
    # the latest end so far within each client: a running maximum over integer keys that
    # order by client, then by end (its rank among all ends: exact, whatever the floats)
    levels, rank = np.unique(end, return_inverse=True)
    base = ids * len(levels)
    reach = levels[np.maximum.accumulate(base + rank.reshape(-1)) - base]
    first = np.ones(len(ids), dtype=bool)
    first[1:] = (ids[1:] != ids[:-1]) | (start[1:] > reach[:-1])  # else joins the one before
    begins = np.flatnonzero(first)
    ids, start, end = ids[begins], start[begins], reach[np.append(begins[1:], len(first)) - 1]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(ids, minlength=clients))])
    return Windows(start, end, offsets.astype(np.int64), period)


def windows_by_row(path: str, period: float) -> list[list[tuple[float, float]]]:
    """``read_windows`` one row at a time: per trace client, its merged windows."""
    per: dict[int, list[tuple[float, float]]] = {}
    for at, row in enumerate(iter_rows(path, TRACE), 1):
        client = int(number(row, "client", TRACE, at))
        start, end = number(row, "start", TRACE, at), number(row, "end", TRACE, at)
        if not start < end <= period:
            raise RecipeError(
                TRACE, f"start < end ≤ period ({period:g}) on row {at}", f"{start:g}, {end:g}"
            )
        per.setdefault(client, []).append((start, end))
    if not per or sorted(per) != list(range(len(per))):
        raise RecipeError(TRACE, "trace clients numbered 0..D-1, each with a window", sorted(per))
    return [merged(per[c]) for c in range(len(per))]


def merged(windows: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted windows, overlapping or touching ones joined."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(windows):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def build(cfg: AvailabilityConfig, seed: int) -> Availability:
    """The recipe's availability model (a trace is read here, once)."""
    if cfg.model == "diurnal":
        return Diurnal(seed, cfg.period, cfg.online)
    if cfg.model == "trace":
        assert cfg.trace is not None  # the schema requires it
        return read_windows(cfg.trace, cfg.period)
    return Availability()

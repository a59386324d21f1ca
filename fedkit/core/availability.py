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
from collections.abc import Iterable
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
    """Windows from a trace: per trace client, sorted disjoint ``(start, end)`` seconds
    within one ``period``, which repeats."""

    def __init__(self, windows: list[list[tuple[float, float]]], period: float) -> None:
        self.windows, self.period = windows, period
        self._starts = [[s for s, _ in w] for w in windows]

    def until(self, client: int, t: float) -> float | None:
        index = client % len(self.windows)
        windows, starts = self.windows[index], self._starts[index]
        base = math.floor(t / self.period) * self.period
        offset = t - base
        i = bisect.bisect_right(starts, offset) - 1
        if i < 0 or windows[i][1] <= offset:
            return None
        return base + windows[i][1]


def read_rows(path: str, key: str) -> list[dict[str, Any]]:
    """The rows of a CSV file (a header line, then values) or a JSON-lines file (one object
    per line; ``.jsonl`` or ``.json``), for the recipe key ``key`` naming it."""
    import csv
    import json

    file = Path(path)
    if not file.is_file():
        raise RecipeError(key, "an existing CSV or JSON-lines file", path)
    if file.suffix not in (".csv", ".jsonl", ".json"):
        expected = "a .csv, .jsonl or .json file (FedScale's pickles are not read: convert them)"
        raise RecipeError(key, expected, path)
    try:
        text = file.read_text()
    except UnicodeDecodeError:
        raise RecipeError(key, "a text file (CSV or JSON lines)", "binary data") from None
    if file.suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                expected = f"a JSON object on line {number} ({exc.msg})"
                raise RecipeError(key, expected, path) from None
            if not isinstance(row, dict):
                raise RecipeError(key, f"a JSON object on line {number}", row)
            rows.append(row)
        return rows
    return list(csv.DictReader(text.splitlines()))


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


def read_windows(path: str, period: float) -> list[list[tuple[float, float]]]:
    """A trace of windows: rows ``client, start, end`` (seconds from the trace's start,
    ``start < end <= period``), trace clients numbered 0..D-1 with at least one window
    each. Overlapping windows of one client are merged."""
    key = "systems.availability.trace"
    per: dict[int, list[tuple[float, float]]] = {}
    for at, row in enumerate(read_rows(path, key), 1):
        client = int(number(row, "client", key, at))
        start, end = number(row, "start", key, at), number(row, "end", key, at)
        if not start < end <= period:
            raise RecipeError(
                key, f"start < end ≤ period ({period:g}) on row {at}", f"{start:g}, {end:g}"
            )
        per.setdefault(client, []).append((start, end))
    if not per or sorted(per) != list(range(len(per))):
        raise RecipeError(key, "trace clients numbered 0..D-1, each with a window", sorted(per))
    return [merged(per[c]) for c in range(len(per))]


def merged(windows: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
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
        return Windows(read_windows(cfg.trace, cfg.period), cfg.period)
    return Availability()

"""The virtual clock (``systems:``): how long each client's job would take on its device
and link, which clients a round may sample, which it keeps, and when the round ends.

A job's virtual duration is

    latency + down bytes / down bandwidth + samples / speed + up bytes / up bandwidth

with the bytes the ledger books for the job (the ``downlink`` tensors, the cluster
states the client fetched, its upload and reported values) and the samples it trained
(its sample count, which it reports as its weight, times ``federation.local_epochs``).
Rounds are synchronous: a round lasts until its last kept client finishes, or until
``systems.deadline`` when fewer than ``clients_per_round`` were kept and a deadline is set.

Everything per client is drawn from a generator seeded by (seed, client) or read from a
file once, and looked up for the clients a round touches only: no per-round work grows
with the population. The clock's one piece of state is the virtual time (``now``), kept
in checkpoints, so a resumed run samples and times exactly as an uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedkit.config.schema import Recipe, SystemsConfig
from fedkit.core import availability
from fedkit.core.messages import ClientResult
from fedkit.errors import RecipeError, RoundFailed
from fedkit.plugin.ledger import value_bytes
from fedkit.seeding import derive

if TYPE_CHECKING:
    from fedkit.plugin.server import Server

PROBES = 50
"""Candidates the sampler may draw per client it wants (reachable or not) before it
takes fewer: bounds a round's sampling by the cohort, not the population."""


@dataclass(frozen=True)
class Device:
    """One client's device: ``speed`` in samples per second, bandwidths in bytes per
    second, ``latency`` in seconds per job."""

    speed: float
    down: float
    up: float
    latency: float

    def duration(self, down_bytes: float, samples: float, up_bytes: float) -> float:
        """The virtual seconds of one job that downloads, trains on and uploads this much."""
        return self.latency + down_bytes / self.down + samples / self.speed + up_bytes / self.up


def round_seconds(t: float) -> float:
    """Virtual seconds as a metrics row shows them (to the millisecond)."""
    return round(t, 3)


def mbps(value: float) -> float:
    """Megabits per second in bytes per second."""
    return value * 1e6 / 8


def read_devices(path: str, latency: float) -> list[Device]:
    """A devices file: rows ``speed`` (samples/s), ``down_mbps``, ``up_mbps`` and optionally
    ``latency`` (seconds; by default ``systems.link.latency``). Client ``c`` takes row
    ``c mod D``."""
    key = "systems.devices"
    rows = availability.read_rows(path, key)
    if not rows:
        raise RecipeError(key, "at least one device row", path)
    devices = []
    for at, row in enumerate(rows, 1):
        speed = availability.number(row, "speed", key, at)
        down = availability.number(row, "down_mbps", key, at)
        up = availability.number(row, "up_mbps", key, at)
        lat = availability.number(row, "latency", key, at) if row.get("latency") else latency
        if min(speed, down, up) <= 0:
            raise RecipeError(key, f"speed, down_mbps, up_mbps > 0 (row {at})", row)
        devices.append(Device(speed, mbps(down), mbps(up), lat))
    return devices


class Clock:
    """The virtual clock of one run (``systems.enabled``)."""

    def __init__(self, recipe: Recipe) -> None:
        cfg: SystemsConfig = recipe.systems
        self.cfg, self.seed = cfg, recipe.seed
        self.k = recipe.federation.clients_per_round
        self.epochs = recipe.federation.local_epochs
        self.now = 0.0
        self.table = read_devices(cfg.devices, cfg.link.latency) if cfg.devices else None
        self.availability = availability.build(cfg.availability, recipe.seed)
        self._devices: dict[int, Device] = {}

    def device(self, client: int) -> Device:
        """The client's device: its row of the devices file, else drawn (lognormal speed and
        bandwidths) from a generator seeded by (seed, client)."""
        found = self._devices.get(client)
        if found is None:
            if self.table is not None:
                found = self.table[client % len(self.table)]
            else:
                speed, link = self.cfg.speed, self.cfg.link
                z = np.random.default_rng(derive(self.seed, "device", client)).standard_normal(3)
                found = Device(
                    speed.median * math.exp(speed.sigma * z[0]),
                    mbps(link.down_mbps) * math.exp(link.sigma * z[1]),
                    mbps(link.up_mbps) * math.exp(link.sigma * z[2]),
                    link.latency,
                )
            self._devices[client] = found
        return found

    def wanted(self, population: int) -> int:
        """Clients to sample: ceil(clients_per_round × over_selection), at most all."""
        return min(population, math.ceil(self.k * self.cfg.over_selection - 1e-9))

    def probe(
        self,
        rng: np.random.Generator,
        wanted: int,
        n: int,
        eligible: Sequence[int] | None,
        busy: Collection[int] = (),
    ) -> list[int]:
        """Up to ``wanted`` clients reachable now and not ``busy``, drawn one by one from
        ``rng`` among the ``n`` eligible (``eligible``, or ids ``0..n-1``): at most
        ``PROBES`` candidates per wanted client, so the work follows the cohort."""
        chosen: list[int] = []
        seen: set[int] = set()
        for _ in range(PROBES * wanted):
            if len(chosen) == wanted or len(seen) == n:
                break
            j = int(rng.integers(n))
            if j in seen:
                continue
            seen.add(j)
            client = j if eligible is None else int(eligible[j])
            if client not in busy and self.availability.until(client, self.now) is not None:
                chosen.append(client)
        return chosen

    def sample(self, round: int, eligible: Sequence[int] | None, population: int) -> list[int]:
        """The round's clients among those reachable now (``eligible``: by default every one
        of ``population``). Always reachable: a uniform draw, the same as without the clock
        when there is no over-selection. Otherwise candidates are drawn one by one and kept
        when reachable, at most ``PROBES`` per wanted client; when none is reachable the
        server waits ``availability.wait`` virtual seconds and draws again, for at most one
        availability period."""
        n = population if eligible is None else len(eligible)
        m = self.wanted(n)
        rng = np.random.default_rng(derive(self.seed, "sample", round))
        if self.cfg.availability.model == "always":
            pool = n if eligible is None else np.asarray(eligible)
            return sorted(int(c) for c in rng.choice(pool, size=m, replace=False))
        return self.waiting(round, lambda: self.probe(rng, m, n, eligible), bool)

    def waiting(
        self, round: int, draw: Callable[[], list[int]], enough: Callable[[list[int]], bool]
    ) -> list[int]:
        """``draw()``'s clients, sorted, once ``enough`` of them: until then the server
        waits ``availability.wait`` virtual seconds between draws, for at most one
        availability period (then ``RoundFailed``)."""
        spec = self.cfg.availability
        for _ in range(math.ceil(spec.period / spec.wait) + 1):
            chosen = draw()
            if enough(chosen):
                return sorted(chosen)
            self.now += spec.wait
        raise RoundFailed(
            f"round {round}: no client was reachable for a whole availability period "
            f"({spec.period:g} virtual seconds; systems.availability)"
        )

    def reachable(self, clients: list[int]) -> tuple[list[int], list[ClientResult]]:
        """A sampler plugin's answer split into the reachable clients and failures
        (``unavailable``) for the others."""
        ok, away = [], []
        for c in clients:
            if self.availability.until(c, self.now) is None:
                text = f"not reachable at virtual time {self.now:.1f}s (systems.availability)"
                away.append(ClientResult.failed(c, "unavailable", text))
            else:
                ok.append(c)
        return ok, away

    def job_seconds(self, server: Server, result: ClientResult, sizes: dict[int, int]) -> float:
        """A successful job's virtual duration, from the bytes the ledger booked for it
        before its reply (``downlink``), what it fetched and what it sends back."""
        row = server.ledger.rows.get((server.round, result.client), {})
        down = sum(v for f, v in row.items() if f.startswith("down_"))
        for cluster in result.fetched:
            if cluster not in sizes:
                sizes[cluster] = sum(t.nbytes for t in server.pool[cluster].values())
            down += sizes[cluster]
        up = sum(t.nbytes for t in result.upload.values())
        up += sum(value_bytes(k, v) for k, v in result.metrics.items())
        return self.device(result.client).duration(down, result.weight * self.epochs, up)

    def fate(
        self, result: ClientResult, start: float, seconds: float
    ) -> tuple[ClientResult | None, float]:
        """A successful reply to a job of ``seconds`` begun at virtual time ``start``: the
        failure the clock turns it into (``deadline``: past ``systems.deadline``;
        ``unavailable``: its client left first), or ``None``, and when the job ended."""
        deadline = self.cfg.deadline
        if deadline is not None and seconds > deadline:
            text = f"its job takes {seconds:.1f} virtual seconds, past systems.deadline"
            text += f" ({deadline:g} s)"
            return ClientResult.failed(result.client, "deadline", text, result.fetched), (
                start + deadline
            )
        leaves = self.availability.until(result.client, start)
        if leaves is None or start + seconds > leaves:
            at = start if leaves is None else leaves
            text = f"left at virtual time {at:.1f}s, {seconds:.1f}s into its job"
            return ClientResult.failed(result.client, "unavailable", text, result.fetched), at
        return None, start + seconds

    def settle(
        self, server: Server, results: list[ClientResult], away: Sequence[ClientResult] = ()
    ) -> list[ClientResult]:
        """The round's replies as the server keeps them (failures first, then successful
        jobs in the order they finish, virtually). A job past ``deadline`` fails
        (``deadline``), one whose client leaves before it ends fails (``unavailable``), one
        after the first ``clients_per_round`` to finish is discarded (``over-selected``).
        Then the clock moves to the round's end."""
        start, deadline = self.now, self.cfg.deadline
        sizes: dict[int, int] = {}
        timed = sorted(
            ((self.job_seconds(server, r, sizes), r) for r in results if r.failure is None),
            key=lambda pair: (pair[0], pair[1].client),
        )
        failed = [r for r in results if r.failure is not None]
        out = sorted([*failed, *away], key=lambda r: r.client)
        kept, ends = 0, [0.0]
        for seconds, r in timed:
            failed, end = self.fate(r, start, seconds)
            if failed is not None:
                out.append(failed)
                if failed.failure == "unavailable":  # the round waited until it left
                    ends.append(end - start)
            elif kept >= self.k:
                text = f"finished after the first {self.k} (systems.over_selection)"
                out.append(ClientResult.failed(r.client, "over-selected", text, r.fetched))
            else:
                kept += 1
                ends.append(seconds)
                out.append(r)
        duration = max(ends)
        if deadline is not None and kept < self.k:
            duration = deadline
        self.now = start + duration
        return out

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the virtual time."""
        return {"now": self.now}

    def restore(self, state: dict[str, Any] | None) -> None:
        self.now = float((state or {}).get("now", 0.0))

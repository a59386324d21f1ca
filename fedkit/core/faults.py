"""Injected client faults, for testing how runs survive failing clients.

The recipe's ``faults`` section gives, per sampled client and round, the probability of
each fault; the draw is seeded by (seed, round, client), so a resumed run meets the same
faults. The server attaches the drawn fault to the client's job and the worker acts it
out: ``exception`` raises inside the client's round, ``dropout`` never answers, ``nan``
puts a NaN into the upload, ``straggler`` sleeps ``delay`` seconds first, and ``crash``
kills the worker process on a job's first attempt (the Ray executor replaces the worker
and retries the client once; in-process executors record it as a failure).
"""

from __future__ import annotations

import numpy as np

from fedkit.config.schema import FaultConfig
from fedkit.seeding import derive

KINDS = ("exception", "dropout", "nan", "straggler", "crash")


class InjectedFault(RuntimeError):
    """An exception raised on purpose by the ``exception`` fault."""


class InjectedCrash(RuntimeError):
    """Raised by the ``crash`` fault; a worker in its own process exits on it."""


def draw(cfg: FaultConfig, seed: int, round: int, client: int) -> str | None:
    """The fault of one client in one round, or ``None``."""
    probabilities = [getattr(cfg, kind) for kind in KINDS]
    if not any(probabilities):
        return None
    rng = np.random.default_rng(derive(seed, "fault", round, client))
    u = rng.random()
    for kind, p in zip(KINDS, probabilities, strict=True):
        if u < p:
            return kind
        u -= p
    return None
